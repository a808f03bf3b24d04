"""What an error from ``accept(2)`` means to a listener that must outlive it (the rendezvous
store, the relay): either that one client is gone, or the listener must pause and try again.

Linux hands a connection's pending network error to ``accept`` (ECONNABORTED, EPROTO, ...): the
client is gone, the listener is fine, the next one may be taken at once. Running out of
descriptors (or memory) leaves the client waiting in the backlog, so accepting again at once
would spin: the listener pauses instead. Any other error is taken the same way, and said.

Standard library only: this runs on the nodes.
"""

from __future__ import annotations

import errno

OUT_OF_DESCRIPTORS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
CONNECTION_GONE = frozenset(
    {
        errno.ECONNABORTED,
        errno.EPROTO,
        errno.ENOPROTOOPT,
        errno.ENETDOWN,
        errno.ENONET,
        errno.EHOSTDOWN,
        errno.EHOSTUNREACH,
        errno.ENETUNREACH,
        errno.EOPNOTSUPP,
        errno.EPERM,
        errno.EINTR,
    }
)
"""What accept(2) reports of a connection that failed before it was taken."""

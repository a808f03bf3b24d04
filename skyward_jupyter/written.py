"""Whether the notebook wrote a piece of its memory since a given moment, without reading it.

A large global that has not changed need not be hashed again to be known unchanged, if no byte
of it was written since it was last hashed. Linux says so cheaply: the memory is write-protected
through a userfaultfd in its asynchronous mode (no thread answers faults: the kernel lifts a
page's protection at its first write and remembers it), and the ``PAGEMAP_SCAN`` query of
``/proc/self/pagemap`` says whether any page of a range was written since.

Every write this process makes passes through its page tables and is seen: the program's own,
the kernel's on its behalf (``read()`` into the buffer), another process's through
``process_vm_writev``, pages dropped by ``madvise``. Only private anonymous memory is watched,
because another process writes a shared or file mapping through its own page tables. A device
writing by DMA bypasses page tables: host memory pinned the usual way (``pin_memory()``,
``cudaHostAlloc``) comes from the driver's own mappings, which are not anonymous and so are not
watched; memory of an array registered for DMA in place (``cudaHostRegister``, RDMA) and written
by the device would not be seen.

Where the kernel lacks any part of this (before Linux 6.7, a seccomp filter that refuses
``userfaultfd``, other architectures), a probe at first use finds out and nothing is watched:
every global is hashed, as before.
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import platform
import struct
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

WATCH_MIN_BYTES = 1 << 20
"""Smaller values are hashed every time: cheaper than a protection and its faults."""

_SYSCALL = {"x86_64": 323, "aarch64": 282}
_USER_MODE_ONLY = 1  # what an unprivileged process may ask for; asynchronous faults need no more
_API = 0xAA
_FEATURES = (1 << 13) | (1 << 15)  # UFFD_FEATURE_WP_UNPOPULATED | UFFD_FEATURE_WP_ASYNC
_UFFDIO_API = 0xC018AA3F
_UFFDIO_REGISTER = 0xC020AA00
_UFFDIO_WRITEPROTECT = 0xC018AA06
_REGISTER_WP = 1 << 1
_PROTECT = 1
_PAGEMAP_SCAN = 0xC0606610
_CHECK_WPASYNC = 1 << 1  # the scan fails on memory not watched this way (mapped anew since)
_PAGE_IS_WRITTEN = 1 << 1
_PAGE = mmap.PAGESIZE

Ranges = tuple[tuple[int, int], ...]


def pages(buffers: Sequence[object]) -> tuple[Ranges, tuple[memoryview, ...]] | None:
    """The whole pages ``buffers`` fill (to watch), and their bytes outside them (to read each
    time: those pages hold other memory too, whose writes say nothing about these bytes). None
    where one cannot be watched (read-only, or not contiguous: it may change through another
    object's buffer).
    """
    found, edges = [], []
    for buffer in buffers:
        view = memoryview(buffer)  # type: ignore[arg-type]
        if view.readonly or not view.c_contiguous or not view.nbytes:
            return None
        view = view.cast("B")
        address = ctypes.addressof(ctypes.c_char.from_buffer(view))
        start = -(-address // _PAGE) * _PAGE - address
        end = (address + view.nbytes) // _PAGE * _PAGE - address
        if start >= end:
            edges.append(view)
            continue
        found.append((address + start, address + end))
        edges += [view[:start], view[end:]]
    return tuple(found), tuple(edges)


@dataclass(eq=False)
class Watch:
    """Ranges write-protected at one moment; ``spoiled`` once known written since."""

    ranges: Ranges
    spoiled: bool = field(default=False)


class Writes:
    """The process's one userfaultfd: protecting a range forgets the earlier writes to it, so
    every watch still live is read first (and spoiled where written) before a new one begins.
    """

    def __init__(self) -> None:
        self._uffd = self._pagemap = -1
        self._usable: bool | None = None
        self._live: set[Watch] = set()
        self._found = ctypes.create_string_buffer(24)  # one struct page_region
        self._closer: weakref.finalize[..., Writes] | None = None
        """Closes the two descriptors: at :meth:`close`, or when this object goes (the
        interpreter's exit included), whichever comes first."""

    def close(self) -> None:
        """Close the userfaultfd and ``/proc/self/pagemap`` (the extension's unload: the
        session's end). The kernel lifts the protection of every range with the descriptor, so
        nothing tells of their writes any more: every live watch is spoiled (its value hashed
        again). A later :meth:`watch` opens them anew.
        """
        for live in self._live:
            live.spoiled = True
        self._live.clear()
        if self._closer is not None:
            self._closer()
        self._closer = None
        self._uffd = self._pagemap = -1
        self._usable = None

    def watch(self, where: Ranges) -> Watch | None:
        """Protect ``where`` from now on (call before reading it); None where it cannot be."""
        if not self._open() or not all(map(_private_anonymous, where)):
            return None
        return self._protect(where)

    def _protect(self, where: Ranges) -> Watch | None:
        for live in list(self._live):
            self.written(live)
        try:
            for start, end in where:
                size = end - start
                fcntl.ioctl(
                    self._uffd, _UFFDIO_REGISTER, bytearray(_pack(start, size, _REGISTER_WP, 0))
                )
                fcntl.ioctl(
                    self._uffd, _UFFDIO_WRITEPROTECT, bytearray(_pack(start, size, _PROTECT))
                )
        except OSError:
            return None
        watch = Watch(where)
        self._live.add(watch)
        return watch

    def written(self, watch: Watch) -> bool:
        """Whether any page of ``watch`` was written (or mapped anew) since it began."""
        if not watch.spoiled:
            watch.spoiled = any(self._scan(start, end) for start, end in watch.ranges)
            if watch.spoiled:
                self._live.discard(watch)
        return watch.spoiled

    def release(self, watch: Watch) -> None:
        """No longer asked about: later protections need not read it first."""
        self._live.discard(watch)

    def _scan(self, start: int, end: int) -> bool:
        found = ctypes.addressof(self._found)
        written = _PAGE_IS_WRITTEN
        query = _pack(96, _CHECK_WPASYNC, start, end, 0, found, 1, 0, 0, written, 0, written)
        try:
            return bool(fcntl.ioctl(self._pagemap, _PAGEMAP_SCAN, bytearray(query)) > 0)
        except OSError:  # not watched any more (unmapped, mapped anew): assume written
            return True

    def _open(self) -> bool:
        if self._usable is None:
            self._usable = self._start()
        return self._usable

    def _start(self) -> bool:
        """Open the userfaultfd and ``/proc/self/pagemap``, and check on a page of our own that
        a write is seen and its absence too: the answer is trusted only if both hold.
        """
        number = _SYSCALL.get(platform.machine())
        if number is None:
            return False
        libc = ctypes.CDLL(None, use_errno=True)
        uffd = libc.syscall(number, os.O_CLOEXEC | os.O_NONBLOCK | _USER_MODE_ONLY)
        if uffd < 0:
            return False
        try:
            fcntl.ioctl(uffd, _UFFDIO_API, bytearray(_pack(_API, _FEATURES, 0)))
            pagemap = os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            os.close(uffd)
            return False
        self._uffd, self._pagemap = uffd, pagemap
        probe = mmap.mmap(-1, _PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        start = ctypes.addressof(ctypes.c_char.from_buffer(probe))
        watch = self._protect(((start, start + _PAGE),))
        seen = False
        if watch is not None:
            quiet = not self.written(watch)
            probe[0] = 1
            seen = quiet and self.written(watch)
            self.release(watch)
        probe.close()
        if seen:
            self._closer = weakref.finalize(self, _close, uffd, pagemap)
        else:
            _close(uffd, pagemap)
            self._uffd = self._pagemap = -1
        return seen


def _close(*descriptors: int) -> None:
    for descriptor in descriptors:
        os.close(descriptor)


def _pack(*fields: int) -> bytes:
    return struct.pack(f"{len(fields)}Q", *fields)


def _private_anonymous(span: tuple[int, int]) -> bool:
    """Whether ``span`` lies in private anonymous mappings alone (``/proc/self/maps``)."""
    start, end = span
    covered = start
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            low, high = (int(x, 16) for x in fields[0].split("-"))
            if high <= covered or low >= end:
                continue
            if low > covered or fields[1][3] != "p" or fields[4] != "0":
                return False
            covered = high
            if covered >= end:
                return True
    return False


WRITES = Writes()
"""One per process (see :class:`Writes`)."""

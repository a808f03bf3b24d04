"""What reaches a rank besides code: large values through the nodes' relays, the node's files.

Each node's first rank runs a relay (:mod:`.relay`): the head's keeps what the notebook stashed
with it, the others fetch a value from their parent in the notebook's tree when told
(:class:`~skyward_jupyter.protocol.Fetch`) and serve it to their children. Whichever way a value
came, the node's first rank writes it to the node's store (:mod:`.node_blobs`), where every rank
of the node maps it: one copy crosses the node's link, one lies in its memory. Every rank loads a
cell's globals from the command itself or, for a relayed one, from that store; one rank per node
keeps the notebook's directories in step (:mod:`.node_files`) and every rank enters them before
the cell.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .. import protocol as p
from .. import wire
from .network import route_to
from .node_blobs import NodeBlobs
from .node_files import NodeFiles
from .relay import BlobStore, RelayError, RelayKeys, RelayServer, Source, fetch

WAIT = 600.0
"""Seconds a rank waits for its node's copy of a value (the relays' own limits come first)."""


class Arrivals:
    def __init__(
        self,
        node: int,
        first: bool,
        head: str,
        keys: RelayKeys | None,
        say: Callable[[str], None],
        note: Callable[[str], None],
    ) -> None:
        """``first``: this is the node's first rank (it runs the relay and fetches for the
        node); ``head``: the head's address (the head's relay listens there, the others' on
        the address that routes to it); ``say`` writes to the rank's diagnostics, ``note``
        to the user, with the next cell's result.
        """
        self.blobs = BlobStore()
        self.files = NodeFiles(node)
        self._node = node
        self._first = first
        self._keys = keys
        self._say = say
        self._note = note
        self._spill_said = False
        self._dropped: set[str] = set()
        """Digests dropped while they were fetched or written: not kept when they arrive."""
        self._keeping = threading.Lock()
        self.relay_port: int | None = None
        self.node_blobs: NodeBlobs | None = None
        if keys is None:
            return  # ranks on the notebook's own machine: every value comes over the pipe
        self.node_blobs = NodeBlobs(keys.token, node)
        try:
            self.node_blobs.open()
            if first:
                self.node_blobs.sweep()
        except OSError as exc:
            say(f"this node cannot keep large values in {self.node_blobs.dir}: {exc}")
            self.node_blobs = None
            return
        if not first:
            return
        try:
            address = head if node == 0 else route_to(head).address
            self.relay_port = RelayServer(self.blobs, address, keys, say).port
        except OSError as exc:  # the notebook then leaves this node out of the tree
            say(f"this node's relay cannot listen (on the route to {head}): {exc}")

    def on_wire(self, message: object) -> bool:
        """Handle what the reader thread must not queue behind a running cell (the node's
        first rank fetches and keeps values while it runs one); True when ``message`` was one
        of those.
        """
        if isinstance(message, p.Stash):
            blob = message.blob.data
            self._wanted(message.digest)
            self.blobs.put(message.digest, blob)
            self._start(self._keep, message.digest, blob)
            return True
        if isinstance(message, p.Fetch):
            self._wanted(message.digest)
            self._start(self._fetch, message)
            return True
        if isinstance(message, p.Drop):
            with self._keeping:
                self._dropped.update(message.digests)
                self.blobs.drop(message.digests)
                if self.node_blobs is not None:
                    self.node_blobs.drop(message.digests)
            return True
        return False

    def _wanted(self, digest: str) -> None:
        """A value comes again after an earlier cell dropped it (the same global sent once
        more): this copy is kept.
        """
        with self._keeping:
            self._dropped.discard(digest)

    def _start(self, target: Callable[..., None], *args: Any) -> None:
        threading.Thread(target=target, args=args, name="relay-fetch", daemon=True).start()

    def _fetch(self, command: p.Fetch) -> None:
        """Fetch a value for this node (on a thread of its own), or say why not to the relay's
        children and the node's ranks.
        """
        assert self._keys is not None
        sources = tuple(Source(*s) for s in command.sources)
        try:
            blob = fetch(sources, self._keys, command.digest, command.nbytes)
        except RelayError as exc:
            self.blobs.fail(command.digest)
            self._fail(command.digest, f"node {self._node} could not fetch a value: {exc}")
            return
        self.blobs.put(command.digest, blob)  # the children need not wait for the file
        self._keep(command.digest, blob)

    def _keep(self, digest: str, blob: bytes | bytearray | memoryview) -> None:
        """Write the value to the node's store, then serve it from there: the copy in this
        process's memory goes.
        """
        if self.node_blobs is None:
            return
        try:
            view = self.node_blobs.publish(digest, blob)
        except OSError as exc:
            self._fail(
                digest,
                f"node {self._node} cannot keep a value of {len(memoryview(blob).cast('B'))} "
                f"bytes: {exc}",
            )
            return
        with self._keeping:
            if digest in self._dropped:
                self.node_blobs.drop((digest,))
            else:
                self.blobs.put(digest, view)

    def _fail(self, digest: str, why: str) -> None:
        self._say(why)
        if self.node_blobs is None:
            return
        try:
            self.node_blobs.fail(digest, why)
        except OSError as exc:  # the node's ranks then wait until their limit: say it here
            self._say(f"could not tell the node's ranks ({exc})")

    def sync(self, command: p.SyncFiles) -> p.Synced:
        return self.files.sync(command, self._blob)

    def prepare(self, command: p.RunCell) -> list[dict[str, Any]]:
        """Enter the cell's directory, then load its globals (a module a global refers to may
        be one of the directory's), by groups: those that travel together (share tensors) in
        one, each other alone. Raises with the global's name when one cannot load.
        """
        self.files.enter(command.workdir)
        groups: dict[int, dict[str, Any]] = {}
        loaded: dict[int, Any] = {}
        """By the shipped value's identity: globals that travel together (one
        :class:`~skyward_jupyter.protocol.Together`) are loaded once, so they share objects."""
        for name, shipped in command.globals.items():
            try:
                if id(shipped) not in loaded:
                    pickled = (
                        wire.decode_blob(self._blob(shipped))
                        if isinstance(shipped, p.Relayed)
                        else shipped
                    )
                    loaded[id(shipped)] = pickled.load()
            except Exception as exc:
                raise RuntimeError(
                    f"global {name!r} could not be unpickled on this rank: {exc}"
                ) from exc
            value = loaded[id(shipped)]
            group = groups.setdefault(id(shipped), {})
            group[name] = value.values[name] if isinstance(value, p.Together) else value
        return list(groups.values())

    def _blob(self, ref: p.Relayed) -> memoryview:
        """The node's copy of a relayed value (waiting for it while it travels)."""
        if self.node_blobs is None:
            raise RuntimeError("a relayed value arrived, but this node cannot keep one")
        view, spilled = self.node_blobs.wait(ref.digest, ref.nbytes, WAIT)
        if spilled and self._first and not self._spill_said:  # once for the node and pool
            self._spill_said = True
            self._note(
                f"node {self._node}: a value of {view.nbytes / 2**20:.1f} MiB did not fit in "
                f"{self.node_blobs.memory} (a quarter of it is kept free): the node "
                f"keeps such values in {self.node_blobs.spill} instead, shared all the same; "
                "give the machine a larger /dev/shm (in a container: docker run --shm-size) to "
                "keep them in memory"
            )
        return view

    def leaving(self) -> list[Path]:
        """As the rank ends: what goes with it (the node's store, with its first rank)."""
        if not self._first or self.node_blobs is None:
            return []
        return [self.node_blobs.dir, self.node_blobs.spill]

"""What reaches a rank besides code: large values through the head's relay, the node's files.

The head (rank 0) keeps what the notebook stashed with it and serves it (:mod:`.relay`); every
rank loads a cell's globals from the command itself or, for a relayed one, from the head; one
rank per node keeps the notebook's directories in step (:mod:`.node_files`) and every rank enters
them before the cell.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any

from .. import protocol as p
from .node_files import NodeFiles
from .relay import BlobStore, RelayKeys, RelayServer, fetch


class Arrivals:
    def __init__(
        self,
        rank: int,
        node: int,
        address: str,
        keys: RelayKeys | None,
        say: Callable[[str], None],
    ) -> None:
        self.blobs = BlobStore()
        self.files = NodeFiles(node)
        self._keys = keys
        self._relay: tuple[str, int] | None = None
        self.relay_port: int | None = None
        if rank == 0 and keys is not None:
            try:
                self.relay_port = RelayServer(self.blobs, address, keys, say).port
            except OSError as exc:  # the notebook then sends every rank its own copy
                say(f"the relay cannot listen on {address}: {exc}")

    def on_wire(self, message: object) -> bool:
        """Handle what the reader thread must not queue behind a running cell (the head keeps
        a stash while it runs one); True when ``message`` was one of those.
        """
        if isinstance(message, p.Stash):
            self.blobs.put(message.digest, message.blob.data)  # type: ignore[arg-type]
            return True
        if isinstance(message, p.Drop):
            self.blobs.drop(message.digests)
            return True
        return False

    def sync(self, command: p.SyncFiles) -> p.Synced:
        self._relay = command.relay or self._relay
        return self.files.sync(command, self._blob)

    def prepare(self, command: p.RunCell) -> dict[str, Any]:
        """Enter the cell's directory, then load its globals (a module a global refers to may
        be one of the directory's). Raises with the global's name when one cannot load.
        """
        self.files.enter(command.workdir)
        self._relay = command.relay or self._relay
        values = {}
        for name, shipped in command.globals.items():
            try:
                pickled = (
                    pickle.loads(self._blob(shipped)) if isinstance(shipped, p.Relayed) else shipped
                )
                values[name] = pickled.load()
            except Exception as exc:
                raise RuntimeError(
                    f"global {name!r} could not be unpickled on this rank: {exc}"
                ) from exc
        return values

    def _blob(self, ref: p.Relayed) -> bytes | bytearray | memoryview:
        here = self.blobs.get(ref.digest)
        if here is not None:
            return here
        if self._relay is None or self._keys is None:
            raise RuntimeError("a relayed value arrived, but no relay was named")
        return fetch(self._relay, self._keys, ref.digest, ref.nbytes)

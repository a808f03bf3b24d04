"""The notebook's directories on this node: kept in step, entered before each cell.

One rank per node answers :class:`~skyward_jupyter.protocol.SyncFiles`: if the node sees the
notebook's directory itself (a shared filesystem: every file the notebook lists is there, with
the same content), the cells run there; otherwise the node keeps a copy
(:class:`.workdir.WorkdirCopy`), asks for the contents it lacks and switches the copy to the new
state in one step. Every rank then enters the directory the notebook names for its node before a
cell: its working directory, on ``sys.path``, and the modules whose files changed reloaded (as
``%autoreload`` does in the notebook), so ``import mymod`` and ``open("data.csv")`` behave as
on the local provider.

Standard library only: this runs on the nodes.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import sys
from collections.abc import Callable
from pathlib import Path

from .. import protocol as p
from .workdir import WorkdirCopy

BASE = "~/.cache/skyward_jupyter/sync"
Blob = bytes | bytearray | memoryview
_CHUNK = 1 << 20


class NodeFiles:
    def __init__(self, node: int, base: str = BASE) -> None:
        self.node = node
        self.base = Path(os.path.expanduser(base))
        self._seen: dict[str, set[tuple[str, str]]] = {}
        """Per key: (path, digest) pairs found in the notebook's own directory on this node."""
        self._entered: tuple[str, ...] = ()
        self._roots: list[tuple[str, str]] = []

    # -- one rank per node: keep the copy in step --------------------------------------------

    def sync(self, command: p.SyncFiles, blob: Callable[[p.Relayed], Blob]) -> p.Synced:
        """Answer ``command``: the contents this node lacks, or where the directory now is."""
        try:
            if self._sees(command):
                return p.Synced(command.key, path=command.root)
            copy = WorkdirCopy(self.base, command.key)
            if command.bundle is not None:
                copy.add_objects(bytes(blob(command.bundle)))
            missing = copy.missing(d for _, _, d in command.entries)
            if missing:
                return p.Synced(command.key, missing=tuple(sorted(missing)))
            return p.Synced(command.key, path=str(copy.switch(command.entries)))
        except OSError as exc:
            return p.Synced(
                command.key,
                error=f"cannot keep the copy of {command.root} under {self.base}: {exc}",
            )
        except ValueError as exc:
            return p.Synced(command.key, error=f"the files of {command.root} were refused: {exc}")

    def _sees(self, command: p.SyncFiles) -> bool:
        """Whether the notebook's directory is here, at its own path, with the listed contents.

        Only files not yet found here are hashed: after the first time, a cell checks what
        changed."""
        root = Path(command.root)
        if not root.is_dir():
            return False
        seen = self._seen.setdefault(command.key, set())
        for path, _, digest in command.entries:
            if (path, digest) in seen:
                continue
            if _sha256(root / path) != digest:
                self._seen[command.key] = set()
                return False
            seen.add((path, digest))
        return True

    # -- every rank: enter the directory before a cell ---------------------------------------

    def enter(self, workdir: p.Workdir) -> None:
        """Run in this node's directories; reload the modules whose files changed."""
        paths = workdir.paths.get(self.node, ())
        if not paths:
            return
        os.chdir(paths[0])
        for old in self._entered:
            if old not in paths and old in sys.path:
                sys.path.remove(old)
        for path in reversed(paths):
            if path not in sys.path:
                sys.path.insert(0, path)
        self._entered = paths
        self._roots = list(zip(workdir.roots, paths, strict=False))
        importlib.invalidate_caches()
        if workdir.changed:
            _reload_changed(paths, set(workdir.changed))

    def here(self, path: str) -> str:
        """``path`` (the notebook's) as this node has it: inside a synced directory, the same
        file in the node's copy."""
        for root, copy in self._roots:
            if path.startswith(root + os.sep):
                return copy + path[len(root) :]
        return path


def _reload_changed(paths: tuple[str, ...], changed: set[str]) -> None:
    for module in list(sys.modules.values()):
        file = getattr(module, "__file__", None)
        if not file:
            continue
        for root in paths:
            if file.startswith(root + os.sep) and file[len(root) + 1 :] in changed:
                importlib.reload(module)
                break


def _sha256(path: Path) -> str | None:
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
    except OSError:
        return None
    return h.hexdigest()

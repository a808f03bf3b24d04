"""The notebook's directories on this node: kept in step, entered before each cell.

One rank per node answers :class:`~skyward_jupyter.protocol.SyncFiles`: if the node sees the
notebook's directory itself (a shared filesystem: every file the notebook lists is there, with
the same content), the cells run there; otherwise the node keeps a copy
(:class:`.workdir.WorkdirCopy`), asks for the contents it lacks and switches the copy to the new
state in one step. Every rank then enters the directory the notebook names for its node before a
cell: its working directory, on ``sys.path``, and the modules whose files changed since the last
cell reloaded (as ``%autoreload`` does in the notebook; also on the local provider, where the
ranks run in the notebook's directory), so ``import mymod`` and ``open("data.csv")`` behave the
same everywhere.

Every rank working in a copy holds it (:meth:`.workdir.WorkdirCopy.hold`); when a rank ends
(the pool shut down, or the notebook gone) it lets go, and the last one removes the copy unless
the pool was shut down with ``keep_files`` (see :meth:`NodeFiles.leave`).

Standard library only: this runs on the nodes.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

from .. import protocol as p
from .relay import RelayError
from .stacks import users_file
from .workdir import WorkdirCopy, removal_leftovers

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
        self._stamps: tuple[int, ...] = ()
        """The entered directories' modification times: a changed one has files added or gone."""
        self._roots: list[tuple[str, str]] = []
        self._mtimes: dict[str, int] = {}
        self._known: tuple[object, ...] = ()
        """What ``sys.modules`` and the roots were when ``_candidates`` was made."""
        self._candidates: list[tuple[str, ModuleType, str]] = []
        self._held: dict[str, int] = {}
        """Per key of a copy this rank uses: the descriptor that holds it."""

    # -- one rank per node: keep the copy in step --------------------------------------------

    def sync(self, command: p.SyncFiles, blob: Callable[[p.Relayed], Blob]) -> p.Synced:
        """Answer ``command``: the contents this node lacks, or where the directory now is."""
        try:
            if self._sees(command):
                return p.Synced(command.key, path=command.root)
            copy = WorkdirCopy(self.base, command.key)
            self._hold(command.key)
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
        except (RelayError, RuntimeError) as exc:
            return p.Synced(command.key, error=f"the files of {command.root} did not arrive: {exc}")

    def _sees(self, command: p.SyncFiles) -> bool:
        """Whether the notebook's directory is here, at its own path, with the listed contents.

        Only files not yet found here are hashed: after the first time, a cell checks what
        changed.
        """
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

    def enter(self, workdir: p.Workdir | None) -> None:
        """Run in this node's directories (the current one when the node shares the notebook's
        files); reload the modules from them whose files changed since the last cell.
        """
        paths = workdir.paths.get(self.node, ()) if workdir is not None else ()
        if paths != self._entered:  # the copies of directories entered before are held already
            for path in paths:
                inside = os.path.relpath(path, self.base)
                if not inside.startswith(".."):
                    self._hold(inside.split(os.sep)[0])
        if paths:
            os.chdir(paths[0])
            for old in self._entered:
                if old not in paths and old in sys.path:
                    sys.path.remove(old)
            for path in reversed(paths):
                if path not in sys.path:
                    sys.path.insert(0, path)
            self._roots = list(zip(workdir.roots, paths, strict=False))  # type: ignore[union-attr]
            stamps = tuple(map(_mtime_ns, paths))
            if (paths, stamps) != (self._entered, self._stamps):
                # New directories, or files added or removed in them: forget what the import
                # system listed (it walks every cached finder, so not for a cell that changed
                # nothing).
                importlib.invalidate_caches()
            self._entered, self._stamps = paths, stamps
        for name, module, mtime in self._user_modules():
            if self._mtimes.get(name, mtime) != mtime:
                importlib.reload(module)

    def note_modules(self) -> None:
        """After a cell: the files of the modules it imported, to compare before the next."""
        self._mtimes = {name: mtime for name, _, mtime in self._user_modules()}

    def _user_modules(self) -> Iterator[tuple[str, ModuleType, int]]:
        """The modules loaded from the directories the cells run in, with their files' times
        (a node's copy gives a changed file a new time: its content's).
        """
        for name, module, file in self._find_user_modules():
            try:
                yield name, module, os.stat(file).st_mtime_ns
            except OSError:
                continue

    def _find_user_modules(self) -> list[tuple[str, ModuleType, str]]:
        """Walking ``sys.modules`` (a thousand entries once torch is in) costs most of a trivial
        cell, twice: it is walked again only when an import or a removal changed it (its size
        or its newest entry) or the directories changed.
        """
        directories = self._entered or (os.getcwd(),)
        modules = sys.modules
        known = (len(modules), next(reversed(modules), None), directories)
        if known != self._known or any(modules.get(n) is not m for n, m, _ in self._candidates):
            self._known = known
            roots = tuple(os.path.join(d, "") for d in directories)
            self._candidates = [
                (name, module, file)
                for name, module in list(modules.items())
                if (file := _file_of(module)) and file.startswith(roots) and users_file(file)
            ]
        return self._candidates

    def _hold(self, key: str) -> None:
        if key not in self._held:
            self._held[key] = WorkdirCopy(self.base, key).hold()

    def leave(self, keep: bool) -> tuple[list[Path], list[str]]:
        """Let go of the copies this rank used; unless ``keep``, take away those no other rank
        holds (a rename: quick). The directories to delete (those, and what removals cut short
        left), and what could not be let go, in words (the rank is ending: it only says so).
        Called once, as the rank ends.
        """
        taken: list[Path] = []
        problems: list[str] = []
        held, self._held = self._held, {}
        for key, fd in held.items():
            try:
                gone = WorkdirCopy(self.base, key).release(fd, remove=not keep)
            except OSError as exc:
                problems.append(f"could not remove the copy {self.base / key}: {exc}")
            else:
                taken += [gone] if gone is not None else []
        return taken + removal_leftovers(self.base), problems

    def here(self, path: str) -> str:
        """``path`` (the notebook's) as this node has it: inside a synced directory, the same
        file in the node's copy.
        """
        for root, copy in self._roots:
            if path.startswith(root + os.sep):
                return copy + path[len(root) :]
        return path


def _file_of(module: object) -> str | None:
    """A module's file, read without asking the module: an attribute access would load a module
    imported lazily (importlib's LazyLoader), only to learn that it is not the user's.
    """
    try:
        file = object.__getattribute__(module, "__dict__").get("__file__")
    except AttributeError:
        return None
    return file if isinstance(file, str) else None


def _mtime_ns(path: str) -> int:
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return -1


def _sha256(path: Path) -> str | None:
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
    except OSError:
        return None
    return h.hexdigest()

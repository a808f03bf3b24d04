"""A node's copy of the notebook's working directory, kept in step cell by cell.

Nodes that do not share the notebook's filesystem get its directory as content-addressed
objects: only files the node lacks travel, and a state of the directory is a tree of hard links
to them. Under ``<base>/<key>/``:

- ``objects/<digest>``: one read-only file per content (named by its sha256), and
  ``objects/<digest>.<mode>`` for the same content with other read/execute bits (see below);
- ``trees/<id>/``: a state of the directory, ``<id>`` being :func:`manifest_digest` of its
  entries, and ``trees/<id>.json`` beside it: those entries, so the next switch knows which files
  were synced ones and which the user's code on the ranks made;
- ``current``: a symlink to the tree in use, replaced atomically (ranks chdir to it and put it
  on ``sys.path``);
- ``.users``: every rank working in the copy holds a shared ``flock`` on it (:meth:`hold`), so
  the copy is removed (:meth:`remove_if_unused`) only once no rank of any pool uses it.

Removing a copy is one rename under its lock (to ``<base>/.removing-<key>-<pid>``), the deletion
after it: a process that comes for the copy meanwhile finds it whole or absent, never half
deleted, and a deletion cut short (the process killed) leaves a ``.removing-*`` directory that
the next removal on the node (:func:`removal_leftovers`) or ``%sky clean`` deletes.

Modes: a hard link shares its inode, mode included, so an object is stored once per mode it is
used with. A file on a node keeps the read and execute bits of the notebook's file, never write
bits: the content is shared by every tree, and a write into it would change them all (the owner
always keeps read). The store's directory is private (0o700).

Objects carry a modification time derived from their digest. A write into a synced file (root
ignores the read-only bits) changes it, so :meth:`WorkdirCopy.missing` sees the damaged object
and asks for it again, and tools that compare times (Python's bytecode cache, ``linecache``) see
different contents as different files.

Standard library only: this runs on the nodes.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import io
import json
import os
import re
import shutil
import stat
import sys
import tarfile
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import IO

Entry = tuple[str, int, str]
"""(path relative to the root in POSIX form, permission bits, sha256 of the content)."""

_HEX64 = re.compile(r"[0-9a-f]{64}")
_KEY = re.compile(r"[A-Za-z0-9._-]+")
REMOVING = ".removing-"
"""The prefix of a copy taken away, being deleted (see the module's docstring)."""
_CHUNK = 1 << 20
# Errors of os.link after which a copy does the job: another filesystem, too many links to one
# inode (many empty __init__.py), a filesystem without hard links.
_NO_LINK = {errno.EXDEV, errno.EMLINK, errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP}


def manifest_digest(entries: Iterable[Entry]) -> str:
    """The id of one state of the directory: the notebook's ``Manifest.digest`` and the name of
    a node's tree are this value, so both sides agree on what "in step" means.
    """
    h = hashlib.sha256()
    for path, mode, digest in sorted(entries):
        h.update(path.encode("utf-8", "surrogateescape"))
        h.update(f"\0{mode:o}\0{digest}\0".encode())
    return h.hexdigest()


def _stamp(digest: str) -> int:
    """The modification time (ns) of an object: from its digest, in 2001-2009, never "now"."""
    seconds = 1_000_000_000 + int(digest[:7], 16)
    return seconds * 1_000_000_000 + int(digest[7:15], 16) % 1_000_000_000


@contextlib.contextmanager
def _naming(path: Path | str) -> Iterator[None]:
    """An OSError without a file name (a write on a full disk) gets ``path`` as its name."""
    try:
        yield
    except OSError as e:
        if e.filename is not None:
            raise
        raise OSError(e.errno, e.strerror or str(e), str(path)) from e


def remove_tree(path: Path) -> None:
    """Remove a directory the user's code may have left read-only inside."""

    def retry(func: Callable[..., object], name: str, exc: object) -> None:
        error = exc[1] if isinstance(exc, tuple) else exc  # onerror gives sys.exc_info()
        if isinstance(error, FileNotFoundError):
            return  # another process removes the same tree (leftovers are swept by every rank)
        os.chmod(os.path.dirname(name), 0o700)
        func(name)

    with contextlib.suppress(FileNotFoundError):
        if sys.version_info >= (3, 12):
            shutil.rmtree(path, onexc=retry)
        else:
            shutil.rmtree(path, onerror=retry)


class WorkdirCopy:
    """The copy, on this node, of one notebook's working directory (``key`` names it)."""

    def __init__(self, base: str | Path, key: str) -> None:
        if not _KEY.fullmatch(key) or key in {".", ".."} or key.startswith(REMOVING):
            raise ValueError(f"a working-directory key is letters, digits, '.', '_', '-': {key!r}")
        self.dir = Path(base) / key
        self.objects = self.dir / "objects"
        self.trees = self.dir / "trees"
        self.current = self.dir / "current"

    def missing(self, digests: Iterable[str]) -> set[str]:
        """The digests of the contents this copy lacks (or holds damaged): what to send."""
        wanted = set(digests)
        for digest in wanted:
            _check_digest(digest)
        with self._locked():
            return {d for d in wanted if not self._valid(self.objects / d, d)}

    def add_objects(self, tar_bytes: bytes) -> None:
        """Store the contents of a bundle: an uncompressed tar whose members are named by the
        sha256 of what they hold. A member whose name is not a digest, or whose content does not
        match its name, raises ValueError (nothing is written outside ``objects/``).
        """
        with self._locked(), _reading(tar_bytes) as tar:
            for member in tar:
                if not (_HEX64.fullmatch(member.name) and member.isfile()):
                    raise ValueError(
                        f"bundle member {member.name!r} is not a file named by a sha256 digest "
                        "(64 lowercase hex digits); the bundle is refused"
                    )
                source = tar.extractfile(member)
                assert source is not None  # a regular file always has content
                self._store(member.name, source)

    def switch(self, entries: Sequence[Entry]) -> Path:
        """Make ``current`` the tree of ``entries`` and return ``current``.

        Every entry's object must be here (:meth:`missing`, :meth:`add_objects`). Files in the
        previous tree that were not synced ones (what the user's code made there: checkpoints,
        logs) move into the new tree, unless the notebook now has a file at that path (the
        notebook wins). The previous tree is kept, for processes whose cwd it still is; older
        trees and the objects neither of the two uses are removed. Switching to the state
        already current does nothing.
        """
        entries = _checked(entries)
        tree_id = manifest_digest(entries)
        with self._locked():
            previous = self._current_id()
            if previous == tree_id:
                return self.current
            self._remove_trees(keep=previous)
            new = self.trees / tree_id
            self._build(new, entries)
            if previous is not None:
                synced = {path for path, _, _ in self._entries(previous)}
                _carry_over(self.trees / previous, new, synced, {p for p, _, _ in entries})
            record = self.trees / f"{tree_id}.json"
            with _naming(record):
                record.write_text(json.dumps([list(e) for e in entries]))
            link = self.dir / f".current-{os.getpid()}"
            with contextlib.suppress(FileNotFoundError):
                os.unlink(link)
            os.symlink(f"trees/{tree_id}", link)
            os.replace(link, self.current)
            kept = {d for _, _, d in entries}
            if previous is not None:
                kept.update(d for _, _, d in self._entries(previous))
            self._collect(kept)
        return self.current

    # -- the store ---------------------------------------------------------------------------

    def hold(self) -> int:
        """Mark the copy as in use by this process until the descriptor returned is closed."""
        with self._locked():
            fd = os.open(self.dir / ".users", os.O_RDONLY | os.O_CREAT, 0o600)
            fcntl.flock(fd, fcntl.LOCK_SH)
            return fd

    def release(self, fd: int, remove: bool) -> Path | None:
        """Close a :meth:`hold`; with ``remove``, take the copy away if no one else holds it:
        where it was moved, for the caller to delete (:func:`remove_tree`) when it chooses.
        """
        with self._locked(create=False) as present:
            os.close(fd)
            if remove and present:
                return self._take_unused()
        return None

    def remove_if_unused(self) -> int | None:
        """Remove the copy unless a process holds it; the bytes removed (None: kept, or gone)."""
        with self._locked(create=False) as present:
            taken = self._take_unused() if present else None
        if taken is None:
            return None
        size = tree_bytes(taken)
        remove_tree(taken)
        return size

    def _take_unused(self) -> Path | None:
        """Under the lock: move the copy out of the way, unless a process holds it."""
        try:
            fd = os.open(self.dir / ".users", os.O_RDONLY)
        except FileNotFoundError:
            fd = None  # never held: a copy from before holds were taken
        try:
            if fd is not None:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return None
        finally:
            if fd is not None:
                os.close(fd)
        taken = self.dir.parent / f"{REMOVING}{self.dir.name}-{os.getpid()}"
        if taken.exists():
            remove_tree(taken)  # a leftover of a process that had this pid
        os.rename(self.dir, taken)
        return taken

    @contextlib.contextmanager
    def _locked(self, create: bool = True) -> Iterator[bool]:
        """Ranks of one node (and pools sharing a base) take turns: one flock per copy. Yields
        whether the copy exists (without ``create``, a missing one is not made). A lock taken
        on a copy that was removed meanwhile is taken again on the new one.
        """
        lock = self.dir / ".lock"
        while True:
            if create:
                self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            try:
                fd = os.open(lock, os.O_RDWR | (os.O_CREAT if create else 0), 0o600)
            except FileNotFoundError:
                if create:
                    continue
                yield False
                return
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                try:
                    current = os.stat(lock).st_ino == os.fstat(fd).st_ino
                except FileNotFoundError:
                    current = False
                if current:
                    if create:
                        self.objects.mkdir(exist_ok=True)
                        self.trees.mkdir(exist_ok=True)
                    yield True
                    return
            finally:
                os.close(fd)

    def _valid(self, path: Path, digest: str) -> bool:
        """Whether ``path`` holds the object unchanged; a damaged one is removed."""
        try:
            st = path.lstat()
        except FileNotFoundError:
            return False
        # whole seconds: a filesystem may keep coarser times than it is given
        if st.st_mtime_ns // 10**9 == _stamp(digest) // 10**9 and stat.S_ISREG(st.st_mode):
            return True
        path.unlink()
        return False

    def _store(self, digest: str, source: IO[bytes]) -> None:
        final = self.objects / digest
        if self._valid(final, digest):
            return
        fd, name = tempfile.mkstemp(dir=self.objects, prefix=".incoming-")
        try:
            h = hashlib.sha256()
            with _naming(name), os.fdopen(fd, "wb") as out:
                while chunk := source.read(_CHUNK):
                    h.update(chunk)
                    out.write(chunk)
            if h.hexdigest() != digest:
                raise ValueError(
                    f"bundle member {digest} holds content whose sha256 is {h.hexdigest()}: "
                    "it was damaged on the way; the bundle is refused"
                )
            self._seal(name, digest, 0o444, final)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name)

    def _seal(self, name: str, digest: str, mode: int, final: Path) -> None:
        os.chmod(name, mode)
        os.utime(name, ns=(_stamp(digest), _stamp(digest)))
        os.replace(name, final)

    def _object(self, path: str, mode: int, digest: str) -> Path:
        """The object for ``digest`` with the read/execute bits of ``mode``."""
        base = self.objects / digest
        if not self._valid(base, digest):
            raise FileNotFoundError(
                errno.ENOENT,
                f"the content of {path!r} ({digest}) is not in this node's copy; "
                "send it first (missing(), then add_objects())",
                str(base),
            )
        bits = (mode & 0o555) | 0o400
        if bits == 0o444:
            return base
        variant = self.objects / f"{digest}.{bits:03o}"
        if not self._valid(variant, digest):
            fd, name = tempfile.mkstemp(dir=self.objects, prefix=".incoming-")
            os.close(fd)
            try:
                with _naming(name):
                    shutil.copyfile(base, name)
                self._seal(name, digest, bits, variant)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(name)
        return variant

    def _build(self, tree: Path, entries: list[Entry]) -> None:
        tree.mkdir()
        made: set[str] = set()
        for path, mode, digest in entries:
            source = self._object(path, mode, digest)
            target = tree / path
            parent = os.path.dirname(path)
            if parent and parent not in made:
                target.parent.mkdir(parents=True, exist_ok=True)
                made.add(parent)
            try:
                os.link(source, target)
            except OSError as e:
                if e.errno not in _NO_LINK:
                    raise
                with _naming(target):
                    shutil.copy2(source, target)

    # -- trees -------------------------------------------------------------------------------

    def _current_id(self) -> str | None:
        try:
            target = os.readlink(self.current)
        except FileNotFoundError:
            return None
        name = os.path.basename(target)
        return name if (self.trees / name).is_dir() else None

    def _entries(self, tree_id: str) -> list[Entry]:
        """The manifest a tree was built from; none (so everything is carried) if it is lost."""
        try:
            raw = json.loads((self.trees / f"{tree_id}.json").read_text())
        except (FileNotFoundError, ValueError):
            return []
        return [(str(p), int(m), str(d)) for p, m, d in raw]

    def _remove_trees(self, keep: str | None) -> None:
        for item in self.trees.iterdir():
            if keep is not None and item.name in {keep, f"{keep}.json"}:
                continue
            if item.is_dir() and not item.is_symlink():
                remove_tree(item)
            else:
                item.unlink()

    def _collect(self, kept: set[str]) -> None:
        """Remove the objects no kept tree uses (and leftovers of interrupted writes)."""
        for item in self.objects.iterdir():
            name = item.name
            if name[:64] in kept and (len(name) == 64 or name[64] == "."):
                continue
            item.unlink()


def removal_leftovers(base: Path) -> list[Path]:
    """The copies under ``base`` taken away by processes that ended before deleting them."""
    found = []
    with contextlib.suppress(FileNotFoundError):
        for item in base.iterdir():
            if not item.name.startswith(REMOVING) or not item.is_dir() or item.is_symlink():
                continue
            pid = item.name.rsplit("-", 1)[1]
            if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
                found.append(item)
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process has that pid now: it is not deleting our copy
    return True


def tree_bytes(path: Path) -> int:
    """What the files under ``path`` hold (each inode once: trees are hard links)."""
    seen: set[int] = set()
    total = 0
    for directory, _, files in os.walk(path):
        for name in files:
            try:
                st = os.lstat(os.path.join(directory, name))
            except FileNotFoundError:
                continue
            if st.st_ino not in seen:
                seen.add(st.st_ino)
                total += st.st_size
    return total


@contextlib.contextmanager
def _reading(tar_bytes: bytes) -> Iterator[tarfile.TarFile]:
    try:
        with tarfile.open(fileobj=io.BytesIO(tar_bytes), mode="r:") as tar:
            yield tar
    except tarfile.TarError as e:
        raise ValueError(f"a bundle must be an uncompressed tar: {e}") from e


def _check_digest(digest: str) -> None:
    if not _HEX64.fullmatch(digest):
        raise ValueError(f"not a sha256 digest (64 lowercase hex digits): {digest!r}")


def _checked(entries: Sequence[Entry]) -> list[Entry]:
    """Entries sorted by path; one whose path could leave the tree raises ValueError."""
    out: list[Entry] = []
    for path, mode, digest in entries:
        parts = path.split("/")
        if path.startswith("/") or "\0" in path or any(p in {"", ".", ".."} for p in parts):
            raise ValueError(f"a synced path must be relative, without '.' or '..': {path!r}")
        _check_digest(digest)
        out.append((path, int(mode), digest))
    out.sort()
    paths = {p for p, _, _ in out}
    for path, _, _ in out:
        head = path
        while "/" in head:
            head = head.rsplit("/", 1)[0]
            if head in paths:
                raise ValueError(f"{head!r} is both a file and the directory of {path!r}")
    if len(paths) != len(out):
        raise ValueError("the same path appears twice in the entries")
    return out


def _carry_over(old: Path, new: Path, synced: set[str], incoming: set[str]) -> None:
    """Move what the ranks made in ``old`` (not in ``synced``) into ``new``; a path the notebook
    sends (``incoming``, or a directory of it) keeps the notebook's file.
    """
    synced_dirs = {p.rsplit("/", i)[0] for p in synced for i in range(1, p.count("/") + 1)}
    incoming_dirs = {p.rsplit("/", i)[0] for p in incoming for i in range(1, p.count("/") + 1)}

    def place(rel: str) -> None:
        parts = rel.split("/")
        if any("/".join(parts[:i]) in incoming for i in range(1, len(parts))):
            return  # a file of the notebook's stands where a directory would be
        target = new / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        os.rename(old / rel, target)

    def visit(rel_dir: str) -> None:
        with os.scandir(old / rel_dir if rel_dir else old) as it:
            items = sorted(it, key=lambda e: e.name)
        for item in items:
            rel = f"{rel_dir}/{item.name}" if rel_dir else item.name
            if item.is_dir(follow_symlinks=False):
                if rel in synced_dirs or rel in incoming_dirs:
                    visit(rel)  # holds synced files, or will: look inside
                elif rel not in incoming:
                    place(rel)  # made by the ranks: moves in one piece
            elif rel not in synced and rel not in incoming and rel not in incoming_dirs:
                place(rel)

    visit("")

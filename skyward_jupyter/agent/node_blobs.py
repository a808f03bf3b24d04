"""A node's large values, one file each in its memory (``/dev/shm``), shared by its ranks.

A large value crosses a node's link once: the node's first rank fetches it (:mod:`.arrivals`)
and writes it here; every rank of the node, that one included, maps the file (copy on write:
the pages stay shared until a rank writes to its value) instead of fetching its own copy. A
rank waiting for a value that is not here yet polls for its file, or for the reason it will
not come (``<digest>.failed``, written by the rank that tried).

A value for which the memory filesystem has no room (a container's ``/dev/shm`` is 64 MiB unless
it is given more) is kept in the same way in a directory of the machine's temporary folder
instead, and the pool says so: its pages are still shared through the page cache. A value is
kept in memory only while it leaves a quarter of that filesystem free, which NCCL and
DataLoader workers use too.

Who may read: the directory is the user's (0700, checked), one per pool and node, straight in
``/dev/shm`` (and the temporary folder), named by the user's id and a digest of the pool's relay
token (not the token): another user can neither read it nor make it first, since its name cannot
be known before the pool makes it (a folder shared by the user's pools, at a name anyone knows,
could be made first by anyone, and the user's nodes would keep no values). The files are
written under a temporary name and renamed whole, so a rank never maps half a value. The
node's first rank removes the directory as it ends; a directory whose pool is gone (no rank
holds its lock: a killed pool) is swept by the next pool's first rank on that machine.

Standard library only: this runs on the nodes.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import itertools
import mmap
import os
import re
import shutil
import stat
import tempfile
import time
from pathlib import Path

from .relay import RelayError

_SHM = Path("/dev/shm")
_LOCK = ".lock"
_FAILED = ".failed"
SWEEP_AFTER = 600.0
"""Seconds a directory no rank holds is left alone (the ranks of a new pool may be starting)."""
_POLL_FIRST, _POLL_MOST = 0.002, 0.05
"""Seconds between two looks for a value's file: short at first, longer while it travels."""


KEEP_FREE = 0.25
"""The share of the memory filesystem a value kept there must leave free."""


def _base() -> Path:
    """Where the machine keeps memory-backed files (``/dev/shm``), else its temporary folder."""
    if _SHM.is_dir() and os.access(_SHM, os.W_OK):
        return _SHM
    return _spill_base()


def _spill_base() -> Path:
    """Where values go that the memory filesystem has no room for: the temporary folder."""
    return Path(tempfile.gettempdir())


def _prefix() -> str:
    """What the names of this user's pools' directories start with (and no one else's)."""
    return f"skyward-values-{os.getuid()}-"


def _room_for(directory: Path, nbytes: int) -> bool:
    """``nbytes`` fit in ``directory``'s filesystem and leave :data:`KEEP_FREE` of it free (a
    filesystem that gives no size, a tmpfs without one, is taken at its word: the write says).
    """
    fs = os.statvfs(directory)
    if not fs.f_blocks:
        return True
    return nbytes <= fs.f_bavail * fs.f_frsize - KEEP_FREE * fs.f_blocks * fs.f_frsize


_MEMORY_FILESYSTEMS = ("tmpfs",)
"""Filesystems kept in memory that say their size (a ramfs says none: it is taken at its word)."""


def _in_memory(directory: Path) -> bool:
    """Whether ``directory`` lies on a filesystem kept in memory (where the temporary folder is
    a tmpfs): a value spilled there would take the memory the spill was to spare.
    """
    path = os.path.realpath(directory)
    point, kind = "", ""
    try:
        with open("/proc/self/mounts", encoding="utf-8", errors="surrogateescape") as mounts:
            for line in mounts:
                fields = line.split()
                if len(fields) < 3:
                    continue
                # the table writes a space in a mount point as \040
                mounted = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), fields[1])
                inside = path == mounted or path.startswith(mounted.rstrip("/") + "/")
                if inside and len(mounted) >= len(point):  # the deepest, the last mounted
                    point, kind = mounted, fields[2]
    except OSError:
        return False  # no mount table (not Linux): taken for a disk
    return kind in _MEMORY_FILESYSTEMS


def _is_private(path: Path) -> bool:
    """``path`` is a directory (not a link to one) of this user's alone."""
    try:
        info = path.lstat()
    except FileNotFoundError:
        return False
    return stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid() and not info.st_mode & 0o077


def _private_dir(path: Path) -> Path:
    """``path``, made 0700 if missing; refused unless it is this user's own and no one else's."""
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
    if not _is_private(path):
        raise OSError(
            f"{path} is not a private directory of this user (another user may have made it); "
            "not used"
        )
    return path


class NodeBlobs:
    """The values of one pool on this node (its ranks share the directory)."""

    def __init__(
        self, token: str, node: int, base: Path | None = None, spill_base: Path | None = None
    ) -> None:
        pool = hashlib.sha256(f"skyward node blobs {token}".encode()).hexdigest()[:20]
        self._base = base or _base()
        self.dir = self._base / f"{_prefix()}{pool}-n{node}"
        self._spill_base = spill_base or _spill_base()
        self.spill = self._spill_base / self.dir.name
        """Where values go that do not fit in :attr:`dir` (made when one first does not)."""
        self.memory = self._base
        """The filesystem :attr:`dir` lies in (``/dev/shm``), as the user knows it."""
        self._lock: int | None = None

    def open(self) -> None:
        """Make the directory (if missing) and hold it while this rank lives."""
        _private_dir(self.dir)
        self._lock = os.open(self.dir / _LOCK, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self._lock, fcntl.LOCK_SH)

    def sweep(self) -> list[Path]:
        """Remove the directories of this user's pools that no rank holds any longer (a
        directory younger than ``SWEEP_AFTER`` may be one whose ranks are starting); a spill
        directory goes with its pool's directory in memory, or alone when that one is gone.
        """
        gone = []
        now = time.time()
        # The per-user folder earlier versions kept the pools' folders in (if this user's).
        legacy = self._base / f"skyward-{os.getuid()}"
        ours = _is_private(legacy)
        earlier = sorted(legacy.iterdir()) if ours else []
        for other in self._ours(self._base) + earlier:
            if other == self.dir:
                continue
            try:
                if now - other.stat().st_mtime < SWEEP_AFTER:
                    continue
                lock = os.open(other / _LOCK, os.O_RDWR)
            except OSError:
                continue  # gone meanwhile, or not ours: left alone
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a live pool's
            else:
                shutil.rmtree(other, ignore_errors=True)
                gone.append(other)
            finally:
                os.close(lock)
        if ours:
            with contextlib.suppress(OSError):  # still holding a live pool's: kept
                legacy.rmdir()
        if self._spill_base != self._base:
            for other in self._ours(self._spill_base):
                try:
                    stale = now - other.stat().st_mtime >= SWEEP_AFTER
                except OSError:
                    continue
                if stale and other != self.spill and not (self._base / other.name).exists():
                    shutil.rmtree(other, ignore_errors=True)
                    gone.append(other)
        return gone

    @staticmethod
    def _ours(base: Path) -> list[Path]:
        """This user's pools' directories in ``base``: by their names, and theirs alone (0700,
        not a link): another user's, or a link they planted, would have a sweep remove what it
        holds or points to.
        """
        try:
            names = [name for name in os.listdir(base) if name.startswith(_prefix())]
        except OSError:
            return []
        return [base / name for name in sorted(names) if _is_private(base / name)]

    def publish(self, digest: str, blob: memoryview | bytes | bytearray) -> memoryview:
        """Keep ``blob`` as the node's copy of ``digest`` (in memory, or in the spill directory
        when memory has no room for it); a read-only mapping of it.
        """
        self._keep(digest, blob)
        return self._map(digest, mmap.ACCESS_READ)[0]

    def _keep(self, name: str, data: memoryview | bytes | bytearray, reserve: bool = True) -> None:
        """``data`` as the file ``name``: in memory while it leaves room there, else (or when
        memory filled meanwhile, another process writing too) in the spill directory.
        ``reserve``: a memory filesystem keeps its free share (a short note need not).
        """
        nbytes = memoryview(data).nbytes
        if not reserve or _room_for(self.dir, nbytes):
            try:
                self._write(self.dir, name, data)
                return
            except OSError as exc:
                if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise
        spill = _private_dir(self.spill)
        if reserve and _in_memory(spill) and not _room_for(spill, nbytes):
            raise OSError(
                errno.ENOSPC,
                f"{nbytes / 2**20:.0f} MiB fit neither in {self.memory} nor in "
                f"{self._spill_base}, which is kept in memory too, while leaving "
                f"{KEEP_FREE:.0%} of each free: give the node more memory (a container's "
                "--shm-size) or point TMPDIR at a disk",
            )
        self._write(spill, name, data)

    @staticmethod
    def _write(directory: Path, name: str, data: memoryview | bytes | bytearray) -> None:
        """``data`` as ``directory/name``, whole or not at all; an error names the directory."""
        try:
            fd, temporary = tempfile.mkstemp(dir=directory, prefix=f".{name[:12]}-")
        except OSError as exc:
            raise OSError(exc.errno, f"{directory}: {exc.strerror or exc}") from None
        try:
            with os.fdopen(fd, "wb") as file:
                file.write(data)
            os.replace(temporary, directory / name)
        except BaseException as exc:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            if isinstance(exc, OSError):
                raise OSError(exc.errno, f"{directory}: {exc.strerror or exc}") from None
            raise

    def fail(self, digest: str, why: str) -> None:
        """Tell the node's ranks waiting for ``digest`` that it will not come, and why (in the
        spill directory when memory has no room even for that).
        """
        self._keep(digest + _FAILED, why.encode(), reserve=False)

    def wait(self, digest: str, nbytes: int, timeout: float) -> tuple[memoryview, bool]:
        """The node's copy of ``digest``, mapped copy-on-write (a rank may write to its value),
        and whether it lies in the spill directory; waits for it up to ``timeout`` seconds.
        Raises :class:`RelayError` with the reason the node's first rank gave, or that nothing
        came.
        """
        deadline = time.monotonic() + timeout
        pause = _POLL_FIRST
        while True:
            try:
                view, spilled = self._map(digest, mmap.ACCESS_COPY)
                break
            except FileNotFoundError:
                pass
            for directory in (self.dir, self.spill):
                with contextlib.suppress(FileNotFoundError):
                    raise RelayError((directory / (digest + _FAILED)).read_text())
            if time.monotonic() >= deadline:
                raise RelayError(
                    f"a value ({digest[:12]}) did not reach this node in {timeout:.0f} s: "
                    "its first rank did not fetch it"
                )
            time.sleep(pause)
            pause = min(pause * 2, _POLL_MOST)
        if view.nbytes != nbytes:
            raise RelayError(
                f"the node's copy of {digest[:12]} holds {view.nbytes} bytes, not {nbytes}"
            )
        return view, spilled

    def drop(self, digests: tuple[str, ...]) -> None:
        """The node's ranks loaded these: their files go (a mapping keeps its pages)."""
        for digest, directory in itertools.product(digests, (self.dir, self.spill)):
            for name in (digest, digest + _FAILED):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(directory / name)

    def _map(self, digest: str, access: int) -> tuple[memoryview, bool]:
        """The file of ``digest`` mapped, from memory or else from the spill directory (then
        True).
        """
        path = self.dir / digest
        if not path.exists():
            path = self.spill / digest  # not there either: FileNotFoundError, as for memory
        with open(path, "rb" if access == mmap.ACCESS_READ else "r+b") as file:
            size = os.fstat(file.fileno()).st_size
            view = memoryview(mmap.mmap(file.fileno(), size, access=access) if size else b"")
        return view, path.parent == self.spill and self.spill != self.dir

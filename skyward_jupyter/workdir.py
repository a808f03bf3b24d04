"""Which files of the notebook's working directory travel to nodes that do not share it.

A :class:`Scanner` lists the directory as git would see it (every ``.gitignore`` in the tree,
plus a ``.skyignore`` at the root that has the last word), with each file's sha256. It runs
before every cell, so it keeps a stat cache: a second scan hashes only the files whose stat
changed, and "nothing changed" costs a walk. :func:`bundle` packs the contents a node lacks;
``skyward_jupyter.agent.workdir`` keeps the node's copy in step.

Keys and credentials (:data:`SECRETS`) stay behind unless the user names them: a ``.skyignore``
line ``!PATTERN`` whose pattern is the last to match the file, or a ``--sync`` of a directory
that is itself one of them (``--sync ~/.aws``). Symlinks are followed only to files inside the
directory. A home directory travels only when ``--sync`` names it.
"""

from __future__ import annotations

import hashlib
import heapq
import io
import os
import stat
import tarfile
import time
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

from pathspec import GitIgnoreSpec

from .agent.workdir import Entry, manifest_digest

IGNORE_FILE = ".skyignore"
SKIPPED_DIRS = frozenset({".git", "__pycache__", ".ipynb_checkpoints"})
"""Directories never synced, wherever they are (``*.pyc`` files neither)."""
SECRETS: tuple[str, ...] = (
    # private keys: ssh's by their names (a module called id_utils.py travels), the public
    # halves excepted, and key stores by their extensions
    "id_rsa*",
    "id_dsa*",
    "id_ecdsa*",
    "id_ed25519*",
    "id_ed448*",
    "!id_*.pub",
    "*.pem",
    "*.key",
    "*.p12",
    "*.pfx",
    # credentials and the directories that hold them
    ".ssh/",
    ".gnupg/",
    ".aws/",
    ".azure/",
    ".kaggle/",
    ".jupyter/",
    # Jupyter's runtime directory (Linux, macOS): servers' tokens, kernels' HMAC keys, the
    # registry of pools
    "**/jupyter/runtime/",
    "**/.config/gcloud/",
    "**/.config/gh/",
    "**/.kube/config",
    "**/.docker/config.json",
    "**/huggingface/token",
    "**/huggingface/stored_tokens",
    ".netrc",
    ".git-credentials",
    ".pypirc",
    ".npmrc",
    ".pgpass",
    ".vault-token",
    ".env*",
    # shell and IPython history
    ".bash_history",
    ".zsh_history",
    ".python_history",
    "history.sqlite",
    ".ipython/",
)
"""What never travels unless named (gitignore syntax, matched from the synced directory's root,
whatever the case of its letters: ``ID_RSA`` or ``.ENV`` is the same file where names ignore
case, macOS's and Windows's disks)."""
_SECRET_SPEC = GitIgnoreSpec.from_lines(SECRETS)
_SECRET_DIRS = GitIgnoreSpec.from_lines(p for p in SECRETS if p.endswith("/"))
RACY_NS = 2_000_000_000
"""A file modified this recently before a scan is hashed again on the next one: a write in the
same clock tick as the scan would otherwise leave its stat unchanged (git's "racy" files)."""
_CHUNK = 1 << 20


@dataclass(frozen=True, slots=True)
class FileEntry:
    path: str
    """Relative to the root, POSIX separators."""
    size: int
    mode: int
    """Permission bits."""
    digest: str
    """sha256 of the content, hex."""


@dataclass(frozen=True, slots=True)
class Manifest:
    """One state of the directory: what a node's copy must hold to be in step."""

    root: str
    files: tuple[FileEntry, ...]
    """Sorted by path."""

    secrets: tuple[str, ...] = ()
    """Files left out for being keys or credentials (see :data:`SECRETS`)."""
    outside: tuple[str, ...] = ()
    """Symlinks not followed because they lead out of the directory: ``link -> target``."""

    @property
    def digest(self) -> str:
        """Identifies this state (paths, modes, contents); a node names its tree by it."""
        return manifest_digest(self.entries)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def entries(self) -> tuple[Entry, ...]:
        """(path, mode, digest) per file: what ``WorkdirCopy.switch`` takes."""
        return tuple((f.path, f.mode, f.digest) for f in self.files)


class SyncError(Exception):
    """The directory cannot be synced as it is; the message says why and what to do."""


_Spec = tuple[str, GitIgnoreSpec]
"""A .gitignore: the directory it lives in (relative to the root, "" for the root) and its
patterns."""


class Scanner:
    """Lists the files of ``root`` that travel, refusing more than ``cap_bytes`` in all.

    Symlinks to files inside ``root`` travel as the file's content; symlinks that lead out of
    it, symlinks to directories, FIFOs, sockets and devices are left out (a FIFO would block the
    scan; a link to a directory may lead anywhere). ``chosen``: the user named ``root``
    (``--sync``), rather than it being the notebook's working directory by default.
    """

    def __init__(self, root: str | Path, cap_bytes: int, chosen: bool = True) -> None:
        self.root = Path(os.path.abspath(os.path.expanduser(root)))
        self.cap_bytes = cap_bytes
        self.chosen = chosen
        self._real = os.path.realpath(self.root)
        parts = self.root.parts[1:]
        # A --sync of a secret directory itself (--sync ~/.aws) sends what it holds.
        self._secrets_named = chosen and any(
            _SECRET_DIRS.match_file("/".join(parts[i:]).lower() + "/") for i in range(len(parts))
        )
        self._left: tuple[list[str], list[str]] = ([], [])
        self.hashed = 0
        """How many files the last scan read and hashed (the others came from the cache)."""
        self._cache: dict[str, tuple[int, int, int, int, str]] = {}

    def scan(self) -> Manifest:
        """The files that travel now, with their digests; SyncError if they cannot."""
        started = time.time_ns()
        found = self._walk()
        total = sum(st.st_size for _, st in found)
        if total > self.cap_bytes:
            raise SyncError(self._over_cap(found, total))
        cache: dict[str, tuple[int, int, int, int, str]] = {}
        files = []
        self.hashed = 0
        for rel, st in found:
            key = (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)
            known = self._cache.get(rel)
            if known is not None and known[:4] == key:
                digest = known[4]
            else:
                hashed = self._hash(rel)
                if hashed is None:
                    continue  # gone since the walk: as if the walk had not seen it
                digest = hashed
                self.hashed += 1
            if st.st_mtime_ns < started - RACY_NS:
                cache[rel] = (*key, digest)
            files.append(FileEntry(rel, st.st_size, stat.S_IMODE(st.st_mode), digest))
        self._cache = cache
        secrets, outside = self._left
        return Manifest(str(self.root), tuple(files), tuple(secrets), tuple(outside))

    def _walk(self) -> list[tuple[str, os.stat_result]]:
        """(relative path, stat) of every file that travels, sorted by path."""
        try:
            st = self.root.stat()
        except FileNotFoundError:
            raise SyncError(
                f"The notebook's working directory {self.root} does not exist, so it cannot be "
                "synced to the nodes. Change to an existing directory (%cd) first."
            ) from None
        except OSError as e:
            raise SyncError(f"Cannot read the working directory {self.root}: {e}") from e
        if not stat.S_ISDIR(st.st_mode):
            raise SyncError(f"The working directory {self.root} is not a directory.")
        if not self.chosen and self._real == os.path.realpath(Path.home()):
            raise SyncError(
                f"The notebook's working directory is the home directory {self.root}: say "
                f"what the nodes get with --sync DIR (e.g. %%sky --sync {self.root}/project), "
                f"--sync {self.root} for all of it (keys and credentials stay behind), or "
                "--no-sync."
            )
        sky = self._spec(self.root / IGNORE_FILE)
        found: list[tuple[str, os.stat_result]] = []
        self._left = ([], [])
        self._visit("", [], sky, found)
        found.sort(key=lambda item: item[0])
        for names in self._left:
            names.sort()
        return found

    def _visit(
        self,
        rel_dir: str,
        specs: list[_Spec],
        sky: GitIgnoreSpec | None,
        found: list[tuple[str, os.stat_result]],
    ) -> None:
        directory = self.root / rel_dir
        own = self._spec(directory / ".gitignore")
        if own is not None:
            specs = [*specs, (rel_dir, own)]
        try:
            with os.scandir(directory) as it:
                items = list(it)
        except OSError as e:
            if not rel_dir:
                raise SyncError(f"Cannot list the working directory {self.root}: {e}") from e
            raise SyncError(self._unreadable(rel_dir + "/", e)) from e
        for item in items:
            rel = f"{rel_dir}/{item.name}" if rel_dir else item.name
            if item.is_dir(follow_symlinks=False):
                if item.name not in SKIPPED_DIRS and not _ignored(rel + "/", specs, sky):
                    self._visit(rel, specs, sky, found)
                continue
            if item.name.endswith(".pyc") or _ignored(rel, specs, sky):
                continue
            target = rel
            if item.is_symlink():
                real = os.path.realpath(item.path)
                if not real.startswith(os.path.join(self._real, "")):
                    if os.path.exists(real):
                        self._left[1].append(f"{rel} -> {real}")
                    continue
                target = os.path.relpath(real, self._real)
            if self._secret(rel, sky) or (target != rel and self._secret(target, sky)):
                self._left[0].append(rel)
                continue
            try:
                st = item.stat()  # through a symlink: its target's size, mode, content
            except (FileNotFoundError, NotADirectoryError):
                continue  # a dangling symlink, or gone since the listing
            except OSError as e:
                raise SyncError(self._unreadable(rel, e)) from e
            if stat.S_ISREG(st.st_mode):
                found.append((rel, st))

    def _secret(self, rel: str, sky: GitIgnoreSpec | None) -> bool:
        """Whether ``rel`` is a key or credential the user did not name (a ``.skyignore``
        negation that is the last pattern to match it, or a --sync of a secret directory).
        """
        if self._secrets_named or not _SECRET_SPEC.match_file(rel.lower()):
            return False
        return sky is None or sky.check_file(rel).include is not False

    def _spec(self, path: Path) -> GitIgnoreSpec | None:
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            return None
        except OSError as e:
            raise SyncError(self._unreadable(path.relative_to(self.root).as_posix(), e)) from e
        spec = GitIgnoreSpec.from_lines(text.splitlines())
        return spec if len(spec) else None

    def _hash(self, rel: str) -> str | None:
        """sha256 of the file's content; None if it no longer exists."""
        h = hashlib.sha256()
        try:
            with open(self.root / rel, "rb") as f:
                while chunk := f.read(_CHUNK):
                    h.update(chunk)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise SyncError(self._unreadable(rel, e)) from e
        return h.hexdigest()

    def _unreadable(self, rel: str, e: OSError) -> str:
        return (
            f"Cannot read {self.root / rel} ({e.strerror or e}), so the working directory "
            f"cannot be synced to the nodes. If the nodes do not need it, add a line `{rel}` "
            f"to {self.root / IGNORE_FILE}; otherwise make it readable."
        )

    def _over_cap(self, found: list[tuple[str, os.stat_result]], total: int) -> str:
        largest = heapq.nlargest(5, found, key=lambda item: item[1].st_size)
        lines = "\n".join(f"  {human_bytes(st.st_size):>10}  {rel}" for rel, st in largest)
        return (
            f"The working directory {self.root} holds {human_bytes(total)} to sync to the "
            f"nodes, over the cap of {human_bytes(self.cap_bytes)}. The largest files:\n"
            f"{lines}\n"
            f"Add what the nodes do not need to {self.root / IGNORE_FILE} (gitignore syntax, "
            "e.g. `data/` or `*.ckpt`), or raise the cap with --sync-cap."
        )


def _ignored(rel: str, specs: list[_Spec], sky: GitIgnoreSpec | None) -> bool:
    """Git's rule: the last matching pattern decides, deeper .gitignore files after shallower
    ones, each matched relative to its own directory; then the root's .skyignore. ``rel`` ends
    with "/" for a directory.
    """
    verdict: bool | None = None
    for base, spec in specs:
        include = spec.check_file(rel[len(base) + 1 :] if base else rel).include
        if include is not None:
            verdict = include
    if sky is not None:
        include = sky.check_file(rel).include
        if include is not None:
            verdict = include
    return bool(verdict)


def bundle(manifest: Manifest, digests: Collection[str]) -> bytes:
    """An uncompressed tar of the contents named by ``digests``, each member named by its
    digest, for ``WorkdirCopy.add_objects``. Contents are read from disk now: a file that
    changed since the scan raises SyncError (scan again).
    """
    by_digest: dict[str, FileEntry] = {}
    for file in manifest.files:
        by_digest.setdefault(file.digest, file)
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for digest in sorted(set(digests)):
            entry = by_digest.get(digest)
            if entry is None:
                raise ValueError(f"no file of the manifest of {manifest.root} has digest {digest}")
            path = Path(manifest.root) / entry.path
            try:
                data = path.read_bytes()
            except FileNotFoundError:
                data = None
            except OSError as e:
                raise SyncError(f"Cannot read {path} ({e.strerror or e}) to send it.") from e
            if data is None or hashlib.sha256(data).hexdigest() != digest:
                raise SyncError(f"{path} changed since the directory was scanned; scan again.")
            info = tarfile.TarInfo(digest)
            info.size = len(data)
            info.mode = 0o444
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def human_bytes(n: int) -> str:
    """``1536`` -> ``1.5 KiB``: sizes in messages for people."""
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if value < 1024 or unit == "TiB":
            break
    return f"{value:.1f} {unit}"

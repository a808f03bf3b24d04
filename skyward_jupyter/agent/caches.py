"""``%sky clean`` on a node: remove what this package left in the user's cache and no live
process uses.

Two kinds of things live under ``~/.cache/skyward_jupyter/``: the package itself, shipped by the
SSH provider once per content hash (``<hash>/``, and ``<hash>.<tag>/`` left by an interrupted
unpack), and the copies of notebook directories (``sync/<key>/``, see :mod:`.workdir`). A copy
goes only when no rank holds it; a package version only when no process of this user runs
from it (its path in the process's environment or command line: templates and ranks have it in
``PYTHONPATH``). The packages' environments (``envs/``) and what was sent for them (the wheels
in ``wheels/``, uv in ``uv/``, beside the package versions) go as
:func:`.environments.clean` says. Run as ``python -m skyward_jupyter.agent.caches [PACKAGES]``
(the directory the package versions are in, if not that one); it prints one JSON line:
``{"removed": [[path, bytes], ...], "kept": [path, ...]}``.

Standard library only: this runs on the nodes.
"""

from __future__ import annotations

import json
import os
import re
import stat
import sys
from pathlib import Path

from . import environments
from .workdir import REMOVING, WorkdirCopy, removal_leftovers, remove_tree, tree_bytes

CACHE = "~/.cache/skyward_jupyter"
_PACKAGE = re.compile(r"[0-9a-f]{16,64}(\.[0-9a-f]+)?")


def clean(cache: str = CACHE) -> tuple[list[tuple[str, int]], list[str]]:
    """(path, bytes) of what was removed, and the paths kept because they are in use.

    ``cache``: where the package versions are (the SSH provider's ``cache_dir``); the sync
    copies are always in ``sync/`` of :data:`CACHE`.
    """
    base = Path(os.path.expanduser(cache))
    removed: list[tuple[str, int]] = []
    kept: list[str] = []
    copies = Path(os.path.expanduser(CACHE)) / "sync"
    if copies.is_dir():
        for item in removal_leftovers(copies):
            _remove(item, removed, kept)
        for item in sorted(copies.iterdir()):
            if not item.is_dir() or item.is_symlink() or item.name.startswith(REMOVING):
                continue
            try:
                size = WorkdirCopy(copies, item.name).remove_if_unused()
            except OSError as exc:
                kept.append(f"{item} ({exc.strerror or exc})")
                continue
            if size is None:
                kept.append(str(item))
            else:
                removed.append((str(item), size))
    gone, in_use = environments.clean([base / "wheels", base / "uv"])
    removed += [(str(path), size) for path, size in gone]
    kept += in_use
    if base.is_dir():
        running = _running_paths()
        for item in sorted(base.iterdir()):
            if not _is_package_copy(item):
                continue
            if str(item).encode() in running:
                kept.append(str(item))
                continue
            _remove(item, removed, kept)
    return removed, kept


def _is_package_copy(item: Path) -> bool:
    """A version of this package the SSH provider unpacked (its hash as the name, the package
    inside, this user's): nothing else in a cache directory the user chose is touched.
    """
    if not _PACKAGE.fullmatch(item.name):
        return False
    try:
        st = item.lstat()
    except OSError:
        return False  # gone meanwhile
    return (
        stat.S_ISDIR(st.st_mode)
        and st.st_uid == os.getuid()
        and (item / "skyward_jupyter" / "__init__.py").is_file()
    )


def _remove(item: Path, removed: list[tuple[str, int]], kept: list[str]) -> None:
    """Remove ``item``, saying how much went, or why it stayed (one item's failure is its own)."""
    size = tree_bytes(item)
    try:
        remove_tree(item)
    except OSError as exc:
        kept.append(f"{item} ({exc.strerror or exc})")
    else:
        removed.append((str(item), size))


def _running_paths() -> bytes:
    """The environments and command lines of this user's other processes that see this
    filesystem, joined (a path found in them, even as the start of a longer one, is taken as in
    use: kept rather than lost). A process in another mount namespace (a container) names
    other files by the same paths: it holds none of these.
    """
    seen = []
    ours = _mounts("self")
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        if ours is not None and _mounts(pid) not in (ours, None):
            continue
        for name in ("environ", "cmdline"):
            try:
                with open(f"/proc/{pid}/{name}", "rb") as f:
                    seen.append(f.read())
            except OSError:
                continue  # another user's, or gone
    return b"\0".join(seen)


def _mounts(pid: str) -> str | None:
    """The mount namespace of process ``pid`` (None where it cannot be read)."""
    try:
        return os.readlink(f"/proc/{pid}/ns/mnt")
    except OSError:
        return None


def main() -> None:
    removed, kept = clean(sys.argv[1] if len(sys.argv) > 1 else CACHE)
    print(json.dumps({"removed": removed, "kept": kept}))


if __name__ == "__main__":
    main()

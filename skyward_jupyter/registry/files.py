"""The registry's files: where the pool records live, each written whole and read back safely.

One JSON file per pool, ``<id>.json``, in a per-user directory (``$SKYWARD_REGISTRY_DIR``, else
``jupyter_runtime_dir()/skyward``; the directory is 0700, the files 0600, and a file is always
replaced whole, by rename, so a reader never sees half of one). ``<id>.down`` beside a record is
the server's request that the pool's owner shut it down.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import tempfile
import time
from pathlib import Path
from typing import Any

from ..procs import process_alive

FORMAT = 1
"""The record format's version; readers skip records of other versions."""
RECORD_SUFFIX = ".json"
DOWN_SUFFIX = ".down"
POOL_ID = re.compile(r"[0-9a-f]{12}")


class RegistryError(Exception):
    """The registry directory cannot be used safely (not ours, or open to others)."""


def registry_dir() -> Path:
    """The per-user directory of pool records (``$SKYWARD_REGISTRY_DIR`` overrides)."""
    override = os.environ.get("SKYWARD_REGISTRY_DIR")
    if override:
        return Path(override)
    from jupyter_core.paths import jupyter_runtime_dir

    return Path(jupyter_runtime_dir()) / "skyward"


def ensure_dir(directory: Path) -> Path:
    """Create ``directory`` (0700) if needed; refuse one that is not ours or that others can use."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    check_dir(directory)
    return directory


def check_dir(directory: Path) -> None:
    info = directory.stat()
    if hasattr(os, "getuid") and info.st_uid != os.getuid():
        raise RegistryError(f"{directory} belongs to another user")
    if info.st_mode & 0o077:
        raise RegistryError(f"{directory} is open to other users (mode {info.st_mode & 0o777:o})")


def record_path(directory: Path, pool_id: str) -> Path:
    _check_id(pool_id)
    return directory / f"{pool_id}{RECORD_SUFFIX}"


def down_path(directory: Path, pool_id: str) -> Path:
    _check_id(pool_id)
    return directory / f"{pool_id}{DOWN_SUFFIX}"


def _check_id(pool_id: str) -> None:
    if not POOL_ID.fullmatch(pool_id):
        raise ValueError(f"not a pool id: {pool_id!r}")


def new_pool_id() -> str:
    return secrets.token_hex(6)


def write_record(directory: Path, record: dict[str, Any]) -> Path:
    """Replace ``<id>.json`` with ``record`` at once (a temporary file renamed over it), 0600."""
    path = record_path(directory, str(record["id"]))
    data = json.dumps(record, separators=(",", ":"), sort_keys=True).encode()
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{path.stem}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:  # mkstemp made it 0600
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


def read_record(directory: Path, pool_id: str) -> dict[str, Any] | None:
    """The record of ``pool_id``; None when there is none (or it is of another format)."""
    try:
        data = json.loads(record_path(directory, pool_id).read_bytes())
    except (FileNotFoundError, ValueError):
        return None
    return data if _valid(data) and data["id"] == pool_id else None


def read_records(directory: Path) -> list[dict[str, Any]]:
    """Every record in ``directory``, oldest first; files that are not records are skipped."""
    records = []
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    for name in names:
        stem, suffix = os.path.splitext(name)
        if suffix != RECORD_SUFFIX or not POOL_ID.fullmatch(stem):
            continue  # temporary files (".<id>.*.tmp"), control files, strangers
        record = read_record(directory, stem)
        if record is not None:
            records.append(record)
    records.sort(key=lambda r: (r.get("created_at") or 0, r["id"]))
    return records


def _valid(data: object) -> bool:
    return (
        isinstance(data, dict)
        and data.get("format") == FORMAT
        and isinstance(data.get("id"), str)
        and isinstance(data.get("owner"), dict)
    )


def remove_record(directory: Path, pool_id: str) -> None:
    """Remove a pool's record and its shutdown request, if there are any."""
    for path in (record_path(directory, pool_id), down_path(directory, pool_id)):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def request_shutdown(directory: Path, pool_id: str) -> None:
    """Ask the pool's owner to shut it down (``<id>.down``; the owner removes it with the pool)."""
    path = down_path(directory, pool_id)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps({"requested_at": time.time()}))


def shutdown_requested(directory: Path, pool_id: str) -> bool:
    return down_path(directory, pool_id).exists()


def live_teardowns(directory: Path | None = None) -> list[dict[str, Any]]:
    """The ``teardown`` of every recorded pool whose owner process is alive: what a sweep
    must spare, whichever kernel of this machine owns it.
    """
    live = []
    for record in read_records(directory or registry_dir()):
        owner = record.get("owner") or {}
        if process_alive(int(owner.get("pid") or 0), owner.get("start")):
            live.append(dict(record.get("teardown") or {}))
    return live

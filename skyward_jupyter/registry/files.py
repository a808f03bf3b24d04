"""The registry's files: where the pool records live, each written whole and read back safely.

One JSON file per pool, ``<id>.json``, in a per-user directory (``$SKYWARD_REGISTRY_DIR``, else
``jupyter_runtime_dir()/skyward``; the directory is 0700, the files 0600, and a file is always
replaced whole, by rename, so a reader never sees half of one). ``<id>.down`` beside a record is
the server's request that the pool's owner shut it down.

A reader takes nothing on trust: the directory may be a home shared with other versions of this
package, or hold what a crash or a hand left. It reads only regular files of a record's size,
without following a link or waiting on a pipe, and skips a record whose fields are not of the
shape this version writes (one such file must not take the server's listing down).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import secrets
import stat
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
MAX_RECORD_BYTES = 4 << 20
"""The largest record read (one of 1024 ranks takes about a tenth of it)."""


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
    _replace(path, json.dumps(record, separators=(",", ":"), sort_keys=True).encode())
    return path


def _replace(path: Path, data: bytes) -> None:
    """``path`` made ``data`` whole (a temporary file renamed over it: never written through a
    link found there), 0600.
    """
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:  # mkstemp made it 0600
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def read_record(directory: Path, pool_id: str) -> dict[str, Any] | None:
    """The record of ``pool_id``; None when there is none (or it is not one this version reads)."""
    raw = _read_file(record_path(directory, pool_id))
    if raw is None:
        return None
    try:
        data = json.loads(raw, parse_constant=_no_constant)
    except (ValueError, RecursionError):
        return None
    return data if _valid(data) and data["id"] == pool_id else None


def _read_file(path: Path) -> bytes | None:
    """A regular file's bytes, up to :data:`MAX_RECORD_BYTES`; None for anything else (a link,
    a pipe that would block the reader, a directory, a file too large, one that is gone).
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_RECORD_BYTES:
            return None
        with os.fdopen(fd, "rb", closefd=False) as file:
            data = file.read(MAX_RECORD_BYTES + 1)
        return data if len(data) <= MAX_RECORD_BYTES else None
    except OSError:
        return None
    finally:
        os.close(fd)


def _no_constant(name: str) -> float:
    """JSON's ``NaN`` and ``Infinity`` (Python writes them; browsers cannot read them)."""
    raise ValueError(f"{name} in a record")


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
    """A record of this version's shape, in every field its readers use."""
    if not (isinstance(data, dict) and data.get("format") == FORMAT):
        return False
    owner, nodes = data.get("owner"), data.get("nodes", [])
    return (
        isinstance(data.get("id"), str)
        and _text(data.get("name"))
        and isinstance(owner, dict)
        and _whole(owner.get("pid"))
        and all(_text(owner.get(key)) for key in ("host", "kernel_id", "start"))
        and all(_number(data.get(key)) for key in ("created_at", "started_at", "price_per_hour"))
        and isinstance(data.get("teardown", {}), dict)
        and isinstance(nodes, list)
        and all(isinstance(node, dict) and _ranks(node.get("ranks", [])) for node in nodes)
    )


def _ranks(ranks: object) -> bool:
    return isinstance(ranks, list) and all(
        isinstance(r, dict) and _whole(r.get("pid")) and _text(r.get("hostname")) for r in ranks
    )


def _whole(value: object) -> bool:
    """None, or a whole number (not a bool)."""
    return value is None or (isinstance(value, int) and not isinstance(value, bool))


def _number(value: object) -> bool:
    """None, or a finite number (not a bool)."""
    return value is None or (
        isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    )


def _text(value: object) -> bool:
    return value is None or isinstance(value, str)


def remove_record(directory: Path, pool_id: str) -> None:
    """Remove a pool's record and its shutdown request, if there are any."""
    for path in (record_path(directory, pool_id), down_path(directory, pool_id)):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def request_shutdown(directory: Path, pool_id: str) -> None:
    """Ask the pool's owner to shut it down (``<id>.down``; the owner removes it with the pool)."""
    _replace(down_path(directory, pool_id), json.dumps({"requested_at": time.time()}).encode())


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

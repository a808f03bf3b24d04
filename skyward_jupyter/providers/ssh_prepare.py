"""Making a host ready for ranks: its Python checked against the notebook's, this package on it.

A rank unpickles what the notebook pickled, so the host's Python, torch and cloudpickle must
match closely enough: a mismatch that breaks pickling is an error naming both versions, a
harmless one a warning. The package is pure Python and is shipped once per content hash to
``~/.cache/skyward_jupyter/<hash>`` rather than needing it installed there.

Remote commands are argument lists quoted with :func:`shlex.join`, never shell text built from
user input.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import platform
import secrets
import shlex
import tarfile
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import asyncssh
import cloudpickle

from .base import ProviderError

if TYPE_CHECKING:
    from .ssh import Host

_PACKAGE = Path(__file__).resolve().parents[1]
# Versions come from the installed metadata: importing torch only to read its version would
# cost the host a second or more on every pool start.
_PROBE = """
import importlib.metadata as md, json, os, platform, shutil, subprocess, sys
out = {"python": platform.python_version(), "executable": sys.executable,
       "home": os.path.expanduser("~")}
for name in ("torch", "cloudpickle"):
    try:
        out[name] = md.version(name)
    except md.PackageNotFoundError:
        out[name] = None
gpus, model = 0, None
if shutil.which("nvidia-smi"):
    rows = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                          capture_output=True, text=True).stdout.split("\\n")
    rows = [r.strip() for r in rows if r.strip()]
    gpus, model = len(rows), (rows[0] if rows else None)
out["gpus"], out["gpu_model"] = gpus, model
print(json.dumps(out))
"""


async def probe(host: Host, conn: asyncssh.SSHClientConnection, python: str) -> dict[str, Any]:
    """What the host's ``python`` has: versions, its executable and home, its GPUs."""
    result = await asyncio.wait_for(conn.run(shlex.join([python, "-c", _PROBE]), check=False), 60)
    if result.exit_status == 127:
        raise ProviderError(f"{host}: no Python at {python!r}; pass --python PATH")
    if result.exit_status != 0:
        raise ProviderError(f"{host}: probing Python failed: {result.stderr!s:.500}")
    found: dict[str, Any] = json.loads(str(result.stdout).strip().splitlines()[-1])
    return found


def check_versions(host: Host, found: Mapping[str, Any], brings_torch: bool = False) -> list[str]:
    """Errors raise; harmless differences come back as warnings. ``brings_torch``: the pool's
    packages (``--pip``) give a host without torch the notebook's.
    """
    local_py = platform.python_version_tuple()[:2]
    remote_py = str(found["python"]).split(".")[:2]
    if list(local_py) != remote_py:
        raise ProviderError(
            f"{host}: Python {found['python']} there, {platform.python_version()} in the "
            "notebook: code shipped by value cannot load across Python versions; use --python "
            "with a matching interpreter on the host"
        )
    if found.get("torch") is None and not brings_torch:
        raise ProviderError(
            f"{host}: torch is not installed for {found['executable']}; install it there "
            f"(pip install torch=={_local_torch() or '<version>'}) or pass --python"
        )
    if found.get("cloudpickle") is None:
        raise ProviderError(
            f"{host}: cloudpickle is not installed for {found['executable']}; "
            f"pip install cloudpickle=={cloudpickle.__version__} there"
        )
    warnings = []
    if str(found["cloudpickle"]).split(".")[0] != cloudpickle.__version__.split(".")[0]:
        raise ProviderError(
            f"{host}: cloudpickle {found['cloudpickle']} there, {cloudpickle.__version__} in the "
            "notebook: its pickles do not load across major versions"
        )
    if found["cloudpickle"] != cloudpickle.__version__:
        warnings.append(
            f"{host}: cloudpickle {found['cloudpickle']} there, {cloudpickle.__version__} here"
        )
    local_torch = _local_torch()
    if local_torch and found.get("torch") not in (local_torch, None):
        warnings.append(f"{host}: torch {found['torch']} there, {local_torch} in the notebook")
    return warnings


def _local_torch() -> str | None:
    try:
        import importlib.metadata

        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


def package_digest() -> str:
    """A hash of this package's files: a host holds one copy per distinct content."""
    h = hashlib.sha256()
    for path in sorted(_PACKAGE.rglob("*.py")):
        h.update(str(path.relative_to(_PACKAGE)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def package_tarball() -> bytes:
    """This package's Python files as a gzipped tar, rooted at ``skyward_jupyter/``."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for path in sorted(_PACKAGE.rglob("*.py")):
            tar.add(path, arcname=str(Path("skyward_jupyter") / path.relative_to(_PACKAGE)))
    return buffer.getvalue()


async def ship(
    host: Host, conn: asyncssh.SSHClientConnection, cache_dir: str, home: str
) -> tuple[str, bool]:
    """Make sure the host has this package's content; ship it when it does not.

    Returns where the package is, and whether this call shipped it. The copy is unpacked in a
    fresh directory and renamed into place, so two pools (or two hosts sharing a home) never
    see a half-written package.
    """
    base = cache_dir if cache_dir.startswith("/") else f"{home}/{cache_dir}"
    target = f"{base}/{package_digest()}"
    present = await conn.run(shlex.join(["test", "-d", target]), check=False)
    if present.exit_status == 0:
        return target, False
    return target, await unpack(host, conn, target, package_tarball())


async def unpack(
    host: Host, conn: asyncssh.SSHClientConnection, target: str, tarball: bytes
) -> bool:
    """Unpack ``tarball`` (gzipped tar) into ``target`` on the host: in a fresh directory,
    renamed into place, so that no reader sees it half-written. False when another pool put it
    there first.
    """
    staging = f"{target}.{secrets.token_hex(4)}"
    steps = " && ".join(
        [
            shlex.join(["mkdir", "-p", staging]),
            shlex.join(["tar", "-xzf", "-", "-C", staging]),
            shlex.join(["mv", "-T", staging, target]),
        ]
    )
    result = await conn.run(steps, input=tarball, encoding=None, check=False)
    if result.exit_status == 0:
        return True
    await conn.run(shlex.join(["rm", "-rf", staging]), check=False)
    lost_race = await conn.run(shlex.join(["test", "-d", target]), check=False)
    if lost_race.exit_status != 0:
        raise ProviderError(f"{host}: could not unpack into {target}")
    return False

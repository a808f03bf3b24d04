"""``%sky clean`` over SSH: what this package left on a host, removed where nothing uses it.

The host gets the package as a pool would (:func:`.ssh_prepare.ship`) and runs
:mod:`skyward_jupyter.agent.caches` from it, which removes the sync copies no rank holds and the
package versions no process runs from (the one it runs from included, unless a pool uses it).
"""

from __future__ import annotations

import asyncio
import json
import posixpath
import shlex
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import asyncssh

from ..workdir import human_bytes
from .base import ProviderError
from .ssh_prepare import probe, ship

if TYPE_CHECKING:
    from .ssh import Host

Connect = Callable[["Host"], Awaitable[asyncssh.SSHClientConnection]]


async def clean_host(host: Host, connect: Connect, python: str, cache_dir: str) -> str:
    """One line for ``host``: what was removed (and how much), what was kept as in use, or why
    nothing could be done there.
    """
    try:
        return await _clean(host, connect, python, cache_dir)
    except ProviderError as exc:
        text = str(exc)
        return text if text.startswith(f"{host}:") else f"{host}: {text}"
    except (asyncssh.Error, OSError, asyncio.TimeoutError, ValueError, KeyError) as exc:
        # one host's failure is its own line: the others' reports still come back
        return f"{host}: cleaning failed: {exc or type(exc).__name__}"


async def _clean(host: Host, connect: Connect, python: str, cache_dir: str) -> str:
    conn = await connect(host)
    try:
        found = await probe(host, conn, python)
        package, _ = await ship(host, conn, cache_dir, str(found["home"]))
        command = shlex.join(
            [
                "env",
                f"PYTHONPATH={package}",
                str(found["executable"]),
                "-m",
                "skyward_jupyter.agent.caches",
                posixpath.dirname(package),  # the cache_dir, as the host resolves it
            ]
        )
        result = await conn.run(f"exec {command}", check=False)
    finally:
        conn.close()
    if result.exit_status != 0:
        raise ProviderError(f"{host}: cleaning its cache failed: {result.stderr!s:.500}")
    try:
        report = json.loads(str(result.stdout).strip().splitlines()[-1])
        return _said(host, report["removed"], report["kept"])
    except (ValueError, KeyError, IndexError, TypeError):
        raise ProviderError(
            f"{host}: the cleaner's answer was unreadable: {result.stdout!s:.300}"
        ) from None


def _said(host: Host, removed: list[list[object]], kept: list[str]) -> str:
    kinds: dict[str, list[int]] = {"sync": [], "envs": [], "wheels": [], "uv": [], "": []}
    for path, size in removed:
        # by the folder it was in (a path's other parts, the user's home, may be any word)
        kind = posixpath.basename(posixpath.dirname(str(path)))
        kinds[kind if kind in kinds else ""].append(int(str(size)))
    copies, envs, wheels, uv, packages = kinds.values()
    parts = []
    if copies:
        parts.append(f"{len(copies)} synced director{'ies' if len(copies) != 1 else 'y'}")
    if envs:
        parts.append(f"{len(envs)} package environment{'s' * (len(envs) != 1)}")
    if wheels:
        parts.append(f"{len(wheels)} folder{'s' * (len(wheels) != 1)} of wheels")
    if uv:
        parts.append(f"{len(uv)} uv binar{'ies' if len(uv) != 1 else 'y'}")
    if packages:
        parts.append(f"{len(packages)} package version{'s' * (len(packages) != 1)}")
    total = human_bytes(sum(copies) + sum(envs) + sum(wheels) + sum(uv) + sum(packages))
    text = f"{host}: removed {' and '.join(parts)} ({total})" if parts else f"{host}: nothing"
    if kept:
        text += f"; kept {len(kept)} in use by a running pool"
    return text

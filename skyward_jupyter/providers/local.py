"""The embedded default: every node is simulated on this machine, every rank a spawned process.

Ranks are spawned (``python -m skyward_jupyter.agent``), never forked from the notebook, so the
kernel's state (CUDA included) cannot leak into them. Each rank gets its own session, so the
kernel's Ctrl-C reaches it only through the pool, which decides how to escalate.

The machine's GPUs are split evenly across the simulated nodes; each node sees only its own
through ``CUDA_VISIBLE_DEVICES``, as a real separate machine would.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from .base import Node, ProviderError

_DIAGNOSTIC_LINES = 40
_PACKAGE_PARENT = str(Path(__file__).resolve().parents[2])


def visible_gpus() -> tuple[tuple[str, ...], str | None]:
    """GPU ids this process may use, and their model, without initialising CUDA here."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    name: str | None = None
    ids: tuple[str, ...] = ()
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run(
                [smi, "--query-gpu=index,name", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=10,
                check=True,
            ).stdout
        except (subprocess.SubprocessError, OSError):
            out = ""
        rows = [line.split(",", 1) for line in out.splitlines() if "," in line]
        ids = tuple(r[0].strip() for r in rows)
        name = rows[0][1].strip() if rows else None
    if env is not None:
        ids = tuple(x.strip() for x in env.split(",") if x.strip() and x.strip() != "-1")
    return ids, name


def split_gpus(gpus: tuple[str, ...], nodes: int) -> list[tuple[str, ...]]:
    """Split ``gpus`` evenly across ``nodes``; an uneven split is an error a user can act on."""
    if not gpus:
        return [() for _ in range(nodes)]
    if len(gpus) % nodes:
        raise ProviderError(
            f"{len(gpus)} GPUs cannot be split evenly across {nodes} local nodes; "
            f"use a number of nodes that divides {len(gpus)}"
        )
    per = len(gpus) // nodes
    return [gpus[i * per : (i + 1) * per] for i in range(nodes)]


class LocalRank:
    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self._process = process
        assert process.stdout is not None and process.stdin is not None
        self.reader = process.stdout
        self.writer = process.stdin
        self._diagnostics: collections.deque[str] = collections.deque(maxlen=_DIAGNOSTIC_LINES)
        self._stderr_task = asyncio.get_running_loop().create_task(self._collect_stderr())

    @property
    def pid(self) -> int:
        return self._process.pid

    def describe(self) -> str:
        return f"local pid {self._process.pid}"

    async def _collect_stderr(self) -> None:
        assert self._process.stderr is not None
        async for line in self._process.stderr:
            self._diagnostics.append(line.decode(errors="replace").rstrip())

    def diagnostics(self) -> str:
        return "\n".join(self._diagnostics)

    async def kill(self) -> None:
        if self._process.returncode is None:
            with contextlib.suppress(ProcessLookupError):  # it ended after the check
                self._process.kill()
        await self._process.wait()

    async def wait(self) -> str:
        code = await self._process.wait()
        await asyncio.wait([self._stderr_task], timeout=1.0)
        if code < 0:
            return f"killed by {signal.Signals(-code).name}"
        return f"exited with status {code}"


class LocalProvider:
    name = "local"

    def __init__(self, gpus: tuple[str, ...] | None = None, gpu_type: str | None = None) -> None:
        self._gpus = gpus
        self._gpu_type = gpu_type
        self._ranks: list[LocalRank] = []

    async def provision(self, nodes: int) -> list[Node]:
        gpus, name = (self._gpus, self._gpu_type) if self._gpus is not None else visible_gpus()
        return [
            Node(index=i, address="127.0.0.1", gpus=share, gpu_type=name if share else None)
            for i, share in enumerate(split_gpus(gpus, nodes))
        ]

    async def start_rank(self, node: Node, env: Mapping[str, str]) -> LocalRank:
        full_env = {**os.environ, **env, "PYTHONUNBUFFERED": "1"}
        full_env["PYTHONPATH"] = os.pathsep.join(
            p for p in (_PACKAGE_PARENT, os.environ.get("PYTHONPATH", "")) if p
        )
        if node.gpus or os.environ.get("CUDA_VISIBLE_DEVICES") is not None:
            full_env["CUDA_VISIBLE_DEVICES"] = ",".join(node.gpus)
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "skyward_jupyter.agent",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=full_env,
            start_new_session=True,
        )
        rank = LocalRank(process)
        self._ranks.append(rank)
        return rank

    async def release(self) -> None:
        await asyncio.gather(*(r.kill() for r in self._ranks))
        self._ranks.clear()

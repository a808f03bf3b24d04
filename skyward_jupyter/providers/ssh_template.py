"""The warm template an SSH host keeps for a pool's life (see ``agent/node_template.py``).

Started on its own channel when the pool starts, it imports torch once; every rank after that
(the first ones, ``%sky restart``'s fresh processes, a lost rank's replacement) is forked from it
through a stdlib-only spawner, so a rank starts in a fraction of a second instead of an
interpreter's start and a torch import. A host where the template cannot start, or was lost
(killed), or a rank whose environment changes what torch reads at import, gets its ranks started
directly, as before.

The notebook writes a byte on the template's channel every second: a template that hears nothing
for ``heartbeat_timeout`` seconds (the notebook's machine gone, the network cut, where the
channel stays open on the host's side) ends, as its ranks do.
"""

from __future__ import annotations

import asyncio
import contextlib
import shlex
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import asyncssh

from .local_template import differs_at_import

if TYPE_CHECKING:
    from .ssh import Sessions

READY_TIMEOUT = 120.0
"""Seconds for the template to import torch on its host."""
BEAT_EVERY = 1.0
"""Seconds between the notebook's heartbeats on a template's channel."""


class HostTemplate:
    def __init__(self, process: Any, socket_path: str, spawner: str, python: str) -> None:
        self._process = process
        self.socket_path = socket_path
        self._spawner = spawner
        self._python = python
        self._beats = asyncio.get_running_loop().create_task(self._beat())

    @classmethod
    async def start(
        cls, sessions: Sessions, python: str, package_dir: str, heartbeat_timeout: float
    ) -> tuple[HostTemplate | None, str | None]:
        """The host's template once ready, or None and why not (the ranks start directly)."""
        command = shlex.join(
            [
                "env",
                f"PYTHONPATH={package_dir}",
                python,
                "-m",
                "skyward_jupyter.agent.node_template",
                "--heartbeat-timeout",
                str(heartbeat_timeout),
            ]
        )
        try:
            process = await sessions.process(f"exec {command}")
        except (asyncssh.Error, OSError) as exc:
            return None, f"no warm template on {sessions.host} ({exc})"
        try:
            line = await asyncio.wait_for(process.stdout.readline(), READY_TIMEOUT)
        except (asyncio.TimeoutError, asyncssh.Error, OSError) as exc:
            line, why = b"", repr(exc)
        path = line.decode(errors="replace").strip()
        if not path.startswith("/"):
            process.close()
            with contextlib.suppress(asyncio.TimeoutError, asyncssh.Error, OSError):
                why = (await asyncio.wait_for(process.stderr.read(), 5)).decode(errors="replace")
            last = why.strip().splitlines()[-1] if why.strip() else "it ended without a word"
            return None, f"no warm template on {sessions.host}: {last}"
        spawner = f"{package_dir}/skyward_jupyter/agent/node_spawn.py"
        return cls(process, path, spawner, python), None

    async def _beat(self) -> None:
        with contextlib.suppress(asyncssh.Error, OSError):  # the channel closed: nobody to tell
            while self.alive:
                self._process.stdin.write(b"\n")
                await asyncio.sleep(BEAT_EVERY)

    @property
    def alive(self) -> bool:
        """Whether the template's channel is still open (its process not ended or killed)."""
        return self._process.returncode is None and not self._process.is_closing()

    def serves(self, env: Mapping[str, str]) -> bool:
        """Whether a rank with ``env`` can be forked (nothing torch read at import changes)."""
        return not differs_at_import(env, {})

    def command(self) -> str:
        """The shell command that starts a rank from this template on a new channel."""
        return "exec " + shlex.join([self._python, "-I", "-S", self._spawner, self.socket_path])

    def close(self) -> None:
        self._beats.cancel()
        self._process.close()

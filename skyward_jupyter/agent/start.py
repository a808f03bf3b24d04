"""How a rank process starts: its environment, then the agent, then a quick exit.

Remote ranks read their environment (which may hold tokens) from the channel, not from a
command line that other users of the host could read; the exit skips the interpreter's teardown
of torch (about a second) once the user's exit hooks have run (which may end, gently, what the
user started: what is still running after them is killed with the rank).
"""

from __future__ import annotations

import atexit
import json
import os
import sys

from .environments import use
from .rank import EXIT_CHANNEL_CLOSED, Agent, AgentSettings


def _env_from_stdin() -> None:
    """Read one JSON line of environment from fd 0, byte by byte (the wire follows it)."""
    line = bytearray()
    while not line.endswith(b"\n"):
        byte = os.read(0, 1)
        if not byte:
            os._exit(EXIT_CHANNEL_CLOSED)
        line += byte
    os.environ.update(json.loads(line))


def main() -> None:
    if "--env-from-stdin" in sys.argv[1:]:
        _env_from_stdin()
    site_dir = os.environ.pop("SKYWARD_SITE", None)
    if site_dir:
        use(site_dir)  # the pool's packages (--pip), first on sys.path
    agent = Agent(AgentSettings.from_env())
    agent.serve()
    atexit._run_exitfuncs()
    agent.leave(0)

#!/usr/bin/env python3
"""The instance's dead-man's switch: it shuts the machine down when the pool's heartbeat stops.

This file is the instance's user-data script, run once by cloud-init as root at first boot; it
uses the standard library only, because it runs before anything is installed. Its settings are
data, a JSON file written beside it by the same user data (``/etc/skyward/watchdog.json``)::

    {"heartbeat_file": "/tmp/skyward-heartbeat-<pool>",  # touched by the ranks on each beat
     "timeout": 600,        # seconds of silence before the shutdown
     "grace": 1200,         # seconds after start during which it never fires (boot, first ranks)
     "poll": 15,            # seconds between checks
     "command": ["shutdown", "-h", "now"],   # an argument list, never shell text
     "log": "/var/log/skyward-watchdog.log"}

It fires at ``max(start + grace, last heartbeat + timeout)``: a pool whose ranks never came up
dies at the end of the grace period, one whose notebook died goes ``timeout`` after the last
beat. The instance is launched with shutdown behaviour "terminate", so shutting down ends its
billing for good. It forks into the background first, so cloud-init finishes booting.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

DEFAULT_CONFIG = "/etc/skyward/watchdog.json"


def _daemonize(log_path: str) -> None:
    """Detach (double fork, new session) with stdio on the log; the parent returns to cloud-init."""
    if os.fork() > 0:
        os._exit(0)
    os.setsid()
    if os.fork() > 0:
        os._exit(0)
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(null)
    os.close(log)
    os.chdir("/")


def _say(text: str) -> None:
    print(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} skyward-watchdog: {text}", flush=True)


def watch(config: dict[str, object]) -> int:
    heartbeat = str(config["heartbeat_file"])
    timeout = float(config.get("timeout", 600))  # type: ignore[arg-type]
    grace = float(config.get("grace", 1200))  # type: ignore[arg-type]
    poll = float(config.get("poll", 15))  # type: ignore[arg-type]
    command = [str(c) for c in config.get("command", ["shutdown", "-h", "now"])]  # type: ignore[attr-defined]
    started = time.time()
    _say(f"pid {os.getpid()}, watching {heartbeat} (timeout {timeout:g} s, grace {grace:g} s)")
    while True:
        now = time.time()
        try:
            beat: float | None = os.stat(heartbeat).st_mtime
        except FileNotFoundError:
            beat = None
        deadline = max(started + grace, (beat if beat is not None else started) + timeout)
        silent = now - (beat if beat is not None else started)
        _say(f"check: silent {silent:.1f} s, fires in {max(0.0, deadline - now):.1f} s")
        if now >= deadline:
            _say(
                f"heartbeat silent for {silent:.1f} s (timeout {timeout:g} s), up "
                f"{now - started:.1f} s (grace {grace:g} s): running {command}"
            )
            try:
                done = subprocess.run(command, check=False)
            except OSError as exc:
                _say(f"the shutdown command failed to start: {exc}; trying again")
            else:
                if done.returncode == 0:
                    return 0
                _say(f"the shutdown command exited {done.returncode}; trying again")
        time.sleep(poll)


def main(argv: list[str]) -> int:
    foreground = "--foreground" in argv
    paths = [a for a in argv if a != "--foreground"]
    with open(paths[0] if paths else DEFAULT_CONFIG) as f:
        config = json.load(f)
    if not foreground:
        _daemonize(str(config.get("log", "/var/log/skyward-watchdog.log")))
    pid_file = config.get("pid_file")
    if pid_file:
        with open(str(pid_file), "w") as f:
            f.write(f"{os.getpid()}\n")
    return watch(config)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The instance watchdog (the user data's script) as a real process, and the ranks' heartbeat.

The watchdog daemonizes as on an instance; the tests give it short timeouts, a heartbeat file in
a temporary directory and, instead of ``shutdown -h now``, a command that writes a marker file.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from skyward_jupyter import Pool
from skyward_jupyter.providers import aws_watchdog

from .conftest import wait_for

SCRIPT = Path(aws_watchdog.__file__)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


@pytest.fixture
def watchdog(tmp_path: Path) -> Iterator[dict[str, object]]:
    """Settings for one watchdog run; whatever it started is gone when the test ends."""
    marker = tmp_path / "shut-down"
    config: dict[str, object] = {
        "heartbeat_file": str(tmp_path / "heartbeat"),
        "timeout": 1.5,
        "grace": 1.0,
        "poll": 0.1,
        "command": [
            sys.executable,
            "-c",
            "import sys; open(sys.argv[1], 'w').write('x')",
            str(marker),
        ],
        "log": str(tmp_path / "watchdog.log"),
        "pid_file": str(tmp_path / "watchdog.pid"),
    }
    yield config
    pid_file = Path(str(config["pid_file"]))
    if pid_file.exists():
        pid = int(pid_file.read_text())
        if _alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        wait_for(lambda: not _alive(pid), 10, "the watchdog to end")


def _start(config: dict[str, object], tmp: Path) -> int:
    path = tmp / "watchdog.json"
    path.write_text(json.dumps(config))
    # As cloud-init runs it: the script returns at once, the watchdog lives on detached.
    done = subprocess.run([sys.executable, str(SCRIPT), str(path)], timeout=30, check=False)
    assert done.returncode == 0
    pid_file = Path(str(config["pid_file"]))
    wait_for(lambda: pid_file.exists() and pid_file.read_text().endswith("\n"), 10, "its pid")
    pid = int(pid_file.read_text())
    assert _alive(pid) and os.getsid(pid) != os.getsid(0)  # detached: a session of its own
    return pid


def _checks(config: dict[str, object]) -> int:
    log = Path(str(config["log"]))
    return log.read_text().count(" check: ") if log.exists() else 0


def test_fires_when_the_heartbeat_stops_and_not_before(
    watchdog: dict[str, object], tmp_path: Path
) -> None:
    heartbeat = Path(str(watchdog["heartbeat_file"]))
    marker = Path(str(watchdog["command"][-1]))  # type: ignore[index]
    beating = threading.Event()
    beating.set()

    def beat() -> None:
        while beating.is_set():
            heartbeat.touch()
            time.sleep(0.1)

    beater = threading.Thread(target=beat)
    beater.start()
    try:
        pid = _start(watchdog, tmp_path)
        # Many checks, well past the grace period and the timeout, while the heartbeat beats.
        wait_for(lambda: _checks(watchdog) >= 40, 30, "40 checks with a live heartbeat")
        assert not marker.exists(), Path(str(watchdog["log"])).read_text()
    finally:
        beating.clear()
        beater.join()
    wait_for(marker.exists, 30, "the shutdown command after the heartbeat stopped")
    wait_for(lambda: not _alive(pid), 10, "the watchdog to exit after the shutdown command")
    fired = re.search(r"heartbeat silent for ([\d.]+) s", Path(str(watchdog["log"])).read_text())
    assert fired is not None and float(fired.group(1)) >= 1.5


def test_without_any_heartbeat_it_waits_for_the_boot_grace(
    watchdog: dict[str, object], tmp_path: Path
) -> None:
    watchdog.update(timeout=0.3, grace=2.0)
    marker = Path(str(watchdog["command"][-1]))  # type: ignore[index]
    pid = _start(watchdog, tmp_path)
    wait_for(marker.exists, 30, "the shutdown command at the end of the grace period")
    wait_for(lambda: not _alive(pid), 10, "the watchdog to exit")
    fired = re.search(r"up ([\d.]+) s \(grace 2 s\)", Path(str(watchdog["log"])).read_text())
    assert fired is not None and float(fired.group(1)) >= 2.0


def test_a_failing_shutdown_command_is_retried(watchdog: dict[str, object], tmp_path: Path) -> None:
    marker = tmp_path / "second-try"
    attempt = (
        "import os, sys; p = sys.argv[1]\n"
        "if os.path.exists(p + '.1'): open(p, 'w').write('x')\n"
        "else: open(p + '.1', 'w').write('x'); sys.exit(1)\n"
    )
    watchdog.update(timeout=0.2, grace=0.2, command=[sys.executable, "-c", attempt, str(marker)])
    pid = _start(watchdog, tmp_path)
    wait_for(marker.exists, 30, "the second attempt of the shutdown command")
    wait_for(lambda: not _alive(pid), 10, "the watchdog to exit")
    assert "exited 1; trying again" in Path(str(watchdog["log"])).read_text()


def test_ranks_touch_the_heartbeat_file_while_the_notebook_beats(tmp_path: Path) -> None:
    heartbeat = tmp_path / "heartbeat"
    with Pool(nodes=1, env={"SKYWARD_HEARTBEAT_FILE": str(heartbeat)}) as pool:
        pool.run("1")
        wait_for(heartbeat.exists, 20, "the first touch")
        first = heartbeat.stat().st_mtime
        wait_for(lambda: heartbeat.stat().st_mtime > first, 20, "a later touch")
    heartbeat.unlink()
    with Pool(nodes=1) as pool:  # without the variable (local, SSH) no file is written
        pool.run("1")
    assert not heartbeat.exists()

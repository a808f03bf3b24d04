"""Ending what a pool left running after its owner died, from its registry record alone.

Only processes that are provably the pool's are signalled: the pid must still be the process
recorded (same start time), run ``skyward_jupyter.agent`` and, where the OS names processes
(Linux), be named ``sky-rank-*`` (ranks) or ``sky-template`` (the rank template). A rank leads a
session of its own, so its whole process group goes (DataLoader workers too). SIGTERM first,
SIGKILL after ``grace`` seconds.

SSH ranks are not reached from here: they end when their SSH channel closes, which the owner's
death did (and their heartbeat watchdog backs that up). An AWS pool is torn down through the
provider's own teardown (:func:`skyward_jupyter.providers.aws.teardown_from_record`): its
instances terminated, its key pair, security group and placement group deleted, found by the
pool's tag in the recorded region.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
from dataclasses import dataclass, field
from typing import Any

from ..registry import process_alive, process_start

_AGENT = b"skyward_jupyter.agent"


@dataclass
class ReapReport:
    killed: list[int] = field(default_factory=list)
    """Processes of the pool that were running and were ended."""
    gone: list[int] = field(default_factory=list)
    """Processes of the pool that had already ended (their pid may be another process's now)."""
    spared: list[int] = field(default_factory=list)
    """Recorded processes still running that are not provably agents: not touched."""
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "killed": sorted(self.killed),
            "gone": sorted(self.gone),
            "spared": sorted(self.spared),
            "notes": self.notes,
        }


def _read(pid: int, name: str) -> bytes | None:
    try:
        with open(f"/proc/{pid}/{name}", "rb") as f:
            return f.read()
    except OSError:
        return None


def is_agent(pid: int, start: str | None, names: tuple[bytes, ...]) -> bool:
    """Whether ``pid`` is still the recorded agent process (see the module's rules)."""
    if start is None or not process_alive(pid, start) or process_start(pid) == "?":
        return False  # without a start time a reused pid cannot be told apart: never guess
    cmdline = _read(pid, "cmdline")
    comm = _read(pid, "comm")
    if cmdline is None:
        try:
            import psutil

            proc = psutil.Process(pid)
            return _AGENT in " ".join(proc.cmdline()).encode()
        except Exception:  # noqa: BLE001 - no way to tell (no /proc, no psutil): leave it
            return False
    return _AGENT in cmdline and (comm is None or comm.startswith(names))


def _signal(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        try:
            group = os.getpgid(pid)
        except ProcessLookupError:
            return
        if group == pid:
            os.killpg(pid, sig)  # the rank and whatever it started (DataLoader workers)
        else:
            os.kill(pid, sig)


def _end(targets: dict[int, str | None], grace: float) -> list[int]:
    """SIGTERM, then SIGKILL after ``grace``; the pids that had to be ended."""
    for pid in targets:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if not any(process_alive(pid, start) for pid, start in targets.items()):
            break
        time.sleep(0.05)
    for pid, start in targets.items():
        if process_alive(pid, start):
            _signal(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(
        process_alive(pid, start) for pid, start in targets.items()
    ):
        time.sleep(0.05)
    return list(targets)


def reap(record: dict[str, Any], grace: float = 3.0) -> ReapReport:
    """End what ``record``'s pool left running. Call only when its owner is dead."""
    report = ReapReport()
    teardown = record.get("teardown") or {}
    provider = teardown.get("provider", record.get("provider"))
    if provider == "local":
        if teardown.get("host") not in (None, socket.gethostname()):
            report.notes.append(f"the pool ran on {teardown.get('host')}, not on this machine")
            return report
        for group, names in (("ranks", (b"sky-rank-",)), ("templates", (b"sky-template",))):
            targets: dict[int, str | None] = {}
            unsure: dict[int, str | None] = {}
            for item in teardown.get(group) or ():
                pid, start = int(item.get("pid") or 0), item.get("start")
                if not process_alive(pid, start):
                    report.gone.append(pid)  # ended, or the pid is another process's now
                elif is_agent(pid, start, names):
                    targets[pid] = start
                else:
                    unsure[pid] = start
            report.killed.extend(_end(targets, grace) if targets else ())
            # A process on its way out reads as no program at all: give those a moment.
            deadline = time.monotonic() + 1.0
            while time.monotonic() < deadline and any(
                process_alive(pid, start) for pid, start in unsure.items()
            ):
                time.sleep(0.05)
            for pid, start in unsure.items():
                (report.spared if process_alive(pid, start) else report.gone).append(pid)
        if report.spared:
            report.notes.append(
                f"pids {sorted(report.spared)} are no longer this pool's processes; left alone"
            )
    elif provider == "ssh":
        hosts = ", ".join(str(h.get("host")) for h in teardown.get("hosts") or ())
        report.notes.append(
            f"the ranks on {hosts or 'the SSH hosts'} end when their SSH channel closes, "
            "which the kernel's end did"
        )
    elif provider == "aws":
        from ..providers.aws import teardown_from_record
        from ..providers.base import ProviderError

        try:
            removed = teardown_from_record(teardown)
        except ProviderError as exc:
            report.notes.append(str(exc))
        else:
            report.notes.append(
                f"AWS pool {teardown.get('pool_tag')} in {teardown.get('region')}: removed "
                + (", ".join(removed) or "nothing (already gone)")
            )
    else:
        report.notes.append(f"nothing to reap for provider {provider!r} from this server")
    return report

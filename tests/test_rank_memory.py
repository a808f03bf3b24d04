"""What a rank holds for a global it is sent: a large ``bytes`` value once, not twice.

Real ranks of a local pool; the peak is the rank's own (``VmHWM``, reset just before the value
is sent), so it counts every copy the rank made on the way, however briefly held.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from skyward_jupyter import Pool
from skyward_jupyter.events import RankUsage

from .conftest import wait_for

SIZE = 256 << 20

RESET_PEAK = """
def _status(field):
    with open('/proc/self/status') as status:
        return next(int(l.split()[1]) * 1024 for l in status if l.startswith(field + ':'))
with open('/proc/self/clear_refs', 'w') as refs:
    refs.write('5')  # the peak is the resident size from here on
_held = _status('VmRSS')
"""


def test_a_large_bytes_global_is_held_once_on_every_rank(pool2: Pool) -> None:
    pool2.run(RESET_PEAK).raise_for_errors()
    value = b"\x01" * SIZE
    try:
        result = pool2.run(
            "(type(blob).__name__, len(blob), blob[-1], _status('VmHWM') - _held)",
            {"blob": value},
        ).raise_for_errors()
    finally:
        del value
        pool2.run("del blob, _held, _status").raise_for_errors()
    for kind, size, last, grew in result.values:
        assert (kind, size, last) == ("bytes", SIZE, 1)
        assert grew < 1.3 * SIZE, f"the rank's peak grew by {grew / SIZE:.2f} times the value"


def _memory_cgroup(pid: int) -> Path | None:
    """The cgroup v1 memory directory of ``pid``, when this test may make one below it."""
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            here = Path(f"/sys/fs/cgroup/memory{path}")
            return here if os.access(here, os.W_OK) else None
    return None


@pytest.mark.skipif(
    os.geteuid() != 0 or _memory_cgroup(os.getpid()) is None,
    reason="needs root and a writable cgroup v1 memory controller, to confine the rank",
)
def test_a_rank_the_oom_killer_ends_is_named_out_of_memory() -> None:
    """A real OOM kill, bounded: the rank is moved into a cgroup of its own with a limit just
    above what it holds, then a cell allocates past it; the kernel kills only that rank.
    """
    with Pool(nodes=1) as pool:
        pid = pool.ranks[0].hello.pid  # type: ignore[union-attr]
        parent = _memory_cgroup(pid)
        assert parent is not None
        confined = parent / f"skyward-oom-test-{pid}"
        confined.mkdir()
        try:
            with heartbeats(pool) as beats:  # a sample taken in the pool's cgroup first
                wait_for(lambda: len(beats) >= 1, 10, "a heartbeat from the rank")
            limit = rank_rss(pid) + SIZE
            (confined / "memory.limit_in_bytes").write_text(str(limit))
            (confined / "cgroup.procs").write_text(str(pid))
            with heartbeats(pool) as beats:  # the second was sampled in the cgroup
                wait_for(lambda: len(beats) >= 2, 10, "two heartbeats from the confined rank")
            result = pool.run("held = []\nwhile True:\n    held.append(b'\\x01' * (64 << 20))")
        finally:
            for left in (confined / "cgroup.procs").read_text().split():  # a failed test's rank
                (parent / "cgroup.procs").write_text(left)
            confined.rmdir()
        [error] = result.errors
        assert error.type_name == "RankLost"
        assert "killed by SIGKILL by the kernel's OOM killer: out of memory (it held " in (
            error.message
        ), error.message
        # The confined cgroup's limit: the rank looks again where its cgroup is once moved.
        assert f" of {limit / 2**30:.1f} GiB at its last report" in error.message, error.message
        assert pool.run("'back'").values == ["back"]  # restarted in the pool's own cgroup


@contextmanager
def heartbeats(pool: Pool) -> Iterator[list[RankUsage]]:
    beats: list[RankUsage] = []
    unsubscribe = pool.subscribe(lambda e: beats.append(e) if isinstance(e, RankUsage) else None)
    try:
        yield beats
    finally:
        unsubscribe()


def rank_rss(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return next(int(line.split()[1]) * 1024 for line in status.splitlines() if "VmRSS" in line)


def test_a_sigkill_without_memory_evidence_is_not_called_out_of_memory() -> None:
    """Killed from outside while holding little: the OOM count did not rise, so it is only a
    SIGKILL.
    """
    with Pool(nodes=2) as pool:
        pid = pool.ranks[1].hello.pid  # type: ignore[union-attr]
        with heartbeats(pool) as beats:
            wait_for(lambda: any(b.rank == 1 for b in beats), 10, "a heartbeat from rank 1")
        result = pool.run(
            "import os, signal, time\n"
            f"if int(os.environ['RANK']) == 1:\n    os.kill({pid}, signal.SIGKILL)\n"
            "time.sleep(0.5)"
        )
    lost = [e for e in result.errors if e.type_name == "RankLost"]
    assert [e.message for e in lost] == ["the rank's process killed by SIGKILL"], result.errors

"""A rank's stdout and stderr: they keep the order they were written in, and a cell that closes
or replaces one is told so and is heard again.

Real ranks of a local pool; each cell's output is what the pool's events carried.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from skyward_jupyter import Pool
from skyward_jupyter.events import OutputReceived
from skyward_jupyter.protocol import Script


@contextmanager
def heard(pool: Pool) -> Iterator[list[OutputReceived]]:
    events: list[OutputReceived] = []
    unsubscribe = pool.subscribe(
        lambda e: events.append(e) if isinstance(e, OutputReceived) else None
    )
    try:
        yield events
    finally:
        unsubscribe()


def text(events: list[OutputReceived], rank: int, stream: str = "stdout") -> str:
    return "".join(e.text for e in events if e.rank == rank and e.stream == stream)


def pids(pool: Pool) -> list[int]:
    return [r.hello.pid for r in pool.ranks if r.hello]


def test_a_closed_stdout_or_stderr_is_named_and_reopened(pool2: Pool) -> None:
    before = pids(pool2)
    for fd, stream in ((1, "stdout"), (2, "stderr")):
        result = pool2.run(f"import os, sys\nos.close({fd})\nprint('lost', file=sys.{stream})")
        assert [e.type_name for e in result.errors] == ["OSError", "OSError"], result.errors
        assert result.lost == (), result.errors
        assert sorted(result.notes) == [
            f"rank {r}: the cell closed its {stream} (fd {fd}); it was reopened for the next cells"
            for r in (0, 1)
        ]
        with heard(pool2) as events:
            result = pool2.run(f"print('heard', file=sys.{stream}); os.write({fd}, b'fd\\n')")
        assert result.ok and result.notes == (), (result.errors, result.notes)
        assert [text(events, r, stream) for r in (0, 1)] == ["heard\nfd\n"] * 2
    assert pids(pool2) == before


def test_a_replaced_sys_stdout_gets_the_cells_prints_then_the_notebook_does(pool2: Pool) -> None:
    with heard(pool2) as events:
        result = pool2.run("import io, sys\nsys.stdout = mine = io.StringIO()\nprint('kept')")
        assert result.ok, result.errors
        assert sorted(result.notes) == [
            f"rank {r}: the cell replaced sys.stdout; the rank's own was put back for the next "
            "cells (contextlib.redirect_stdout keeps a replacement to one block)"
            for r in (0, 1)
        ]
        assert pool2.run("print('heard', repr(mine.getvalue()))").notes == ()
    assert [text(events, r) for r in (0, 1)] == ["heard 'kept\\n'\n"] * 2


def test_what_a_cells_own_sys_stdout_still_buffers_reaches_that_cell(pool2: Pool) -> None:
    """A cell's buffered replacement of sys.stdout (on the same descriptor, and kept by the
    cell) is flushed at the cell's end: its prints come with that cell, not later or never.
    """
    with heard(pool2) as events:
        result = pool2.run(
            "import sys\nsys.stdout = mine = open(1, 'w', buffering=1 << 16, closefd=False)\n"
            "print('buffered')"
        )
        assert result.ok, result.errors
        cell = result.cell_id
    assert [text([e for e in events if e.cell_id == cell], r) for r in (0, 1)] == ["buffered\n"] * 2


def test_a_closed_sys_stderr_is_reopened(pool2: Pool) -> None:
    with heard(pool2) as events:
        result = pool2.run("import sys\nsys.stderr.close()")
        assert sorted(result.notes) == [
            f"rank {r}: the cell closed sys.stderr; it was reopened for the next cells"
            for r in (0, 1)
        ]
        assert pool2.run("print('heard', file=sys.stderr)").ok
        # torch's log handler, made before the cell, writes to the reopened stream too
        assert pool2.run("import logging\nlogging.getLogger('torch').warning('logged')").ok
    for r in (0, 1):
        assert re.fullmatch(r"heard\n.*\] logged\n", text(events, r, "stderr"))


def test_a_redirected_block_or_a_descriptor_pointed_elsewhere(pool2: Pool, tmp_path: Path) -> None:
    log = tmp_path / "log"
    result = pool2.run(
        "import contextlib, io, os\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n    print('quiet')\n"
        "saved = os.dup(1)\n"
        "if int(os.environ['RANK']) == 1:\n"
        f"    os.dup2(os.open({str(log)!r}, os.O_WRONLY | os.O_CREAT), 1)"
    )
    assert result.ok, result.errors
    assert result.notes == (
        "rank 1: the cell pointed its stdout (fd 1) elsewhere: what it writes there no longer "
        "reaches the notebook",
    )
    assert pool2.run("print('to the log', flush=True)").notes == ()  # named once
    assert log.read_text() == "to the log\n"
    with heard(pool2) as events:
        assert pool2.run("os.dup2(saved, 1)\nprint('heard')").notes == ()
    assert [text(events, r) for r in (0, 1)] == ["heard\n"] * 2


# ---------------------------------------------------------------------------- the streams' order

INTERLEAVED = """\
import sys
for i in range(100):
    print('flushed', i, flush=True)
    print('to stderr', i, file=sys.stderr)
    print('plain', i)
    sys.stderr.write(f'written {i}\\n')
    print('part', i, end=' ')
    print('then stderr', i, file=sys.stderr)
    print()
"""


def in_order(pieces: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Consecutive text of one stream as one piece: where the chunks were cut does not matter."""
    return [
        (stream, "".join(text for _, text in group))
        for stream, group in itertools.groupby(pieces, key=lambda piece: piece[0])
    ]


EXPECTED = in_order(
    [
        piece
        for i in range(100)
        for piece in (
            ("stdout", f"flushed {i}\n"),
            ("stderr", f"to stderr {i}\n"),
            ("stdout", f"plain {i}\n"),
            ("stderr", f"written {i}\n"),
            ("stdout", f"part {i} "),
            ("stderr", f"then stderr {i}\n"),
            ("stdout", "\n"),
        )
    ]
)


def test_stdout_and_stderr_arrive_in_the_order_a_cell_or_script_wrote_them(
    pool2: Pool, tmp_path: Path
) -> None:
    script = tmp_path / "interleaved.py"
    script.write_text(INTERLEAVED)
    runs = {
        "cell": lambda: pool2.run(INTERLEAVED),
        "script": lambda: pool2.run(INTERLEAVED, filename=str(script), script=Script(str(script))),
    }
    for what, run in runs.items():
        with heard(pool2) as events:
            assert run().ok
        for rank in (0, 1):
            got = in_order([(e.stream, e.text) for e in events if e.rank == rank])
            assert got == EXPECTED, f"{what}, rank {rank}: first difference at " + str(
                next(i for i, (a, b) in enumerate(zip(got, EXPECTED, strict=False)) if a != b)
            )


TORCH_LOGGED = """\
import logging
log = logging.getLogger("torch.distributed")  # its handler was made as torch was imported
for i in range(50):
    print("printed", i, flush=True)
    log.warning("logged %d", i)
"""


def test_what_torchs_loggers_write_keeps_its_order_with_prints(pool2: Pool) -> None:
    with heard(pool2) as events:
        assert pool2.run(TORCH_LOGGED).ok
    expected = [(what, i) for i in range(50) for what in ("printed", "logged")]
    for rank in (0, 1):
        pieces = in_order([(e.stream, e.text) for e in events if e.rank == rank])
        lines = [
            (found.group(1), int(found.group(2)))
            for _, text in pieces
            for line in text.splitlines()
            if (found := re.search(r"(printed|logged) (\d+)$", line))
        ]
        assert lines == expected, lines


FORKED = """\
import os, sys, time
started = time.monotonic()
child = os.fork()
if child == 0:
    for i in range(5):
        print('child out', i, flush=True)
        print('child err', i, file=sys.stderr)
    os._exit(0)
os.waitpid(child, 0)
time.monotonic() - started
"""


def test_a_forked_childs_interleaved_prints_do_not_wait_for_the_ranks_pumps(pool2: Pool) -> None:
    """A DataLoader worker forked by the cell writes through the rank's streams: it has no pump
    of its own to wait for, and must not stall each time it switches streams.
    """
    with heard(pool2) as events:
        result = pool2.run(FORKED, timeout=60)
    assert result.ok, result.errors
    assert max(result.values) < 3.0, result.values
    for rank in (0, 1):
        assert text(events, rank).count("child out") == 5
        assert text(events, rank, "stderr").count("child err") == 5

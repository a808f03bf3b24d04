"""The least a process per rank costs a trivial cell on this machine: what bounds ``bench_scale``.

N processes are forked from this one, each waiting on a pipe of its own, as a pool's ranks do;
each round writes a command to every one and reads every answer, like a trivial cell. Two loops:

* **bare**: a small pickled tuple in, ``eval`` of ``1``, a small pickled tuple out;
* **wire**: the pool's own wire and messages (``SyncChannel``, ``RunCell`` in, ``exec`` of the
  cell, ``CellDone`` with the pickled value out), without anything else the agent does.

It reports the median round and the CPU time per rank and round (the children's, reaped at the
end, so process exits count too: a few percent). Compare with ``bench_scale``'s trivial cell and
its CPU per rank at the same size: the agent's own work is the difference. No goal; the figures
say what a rank costs before any feature. Not in ``make bench``: run it by hand, on a quiet
machine: ``python bench/bench_floor.py --ranks 256 --runs 100``.
"""

from __future__ import annotations

import argparse
import os
import pickle
import selectors
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from types import CodeType

from skyward_jupyter import protocol as p
from skyward_jupyter import wire

WARM_UP = 20


def _bare(read_fd: int, write_fd: int) -> None:
    code = compile("1", "<cell>", "eval")
    while data := os.read(read_fd, 65536):
        _, cell_id = pickle.loads(data)
        os.write(write_fd, pickle.dumps(("done", cell_id, repr(eval(code, {})))))


def _wire(read_fd: int, write_fd: int) -> None:
    channel = wire.SyncChannel(read_fd, write_fd)
    namespace: dict[str, object] = {}
    compiled: dict[str, CodeType] = {}  # as the agent keeps a cell's code
    while True:
        try:
            command = channel.recv()
        except EOFError:
            return
        started = time.perf_counter()
        if command.source not in compiled:
            compiled[command.source] = compile(command.source, command.filename, "eval")
        value = eval(compiled[command.source], namespace)
        seconds = time.perf_counter() - started
        channel.send(p.CellDone(command.cell_id, p.Pickled.dump(value), repr(value), None, seconds))


def _bare_command(cell_id: int) -> bytes:
    return pickle.dumps(("run", cell_id))


def _wire_command(cell_id: int) -> bytes:
    (frame,) = wire.encode(p.RunCell(cell_id, "1", "<In [1]>"))
    return bytes(frame)


def measure(
    ranks: int, runs: int, serve: Callable[[int, int], None], command: Callable[[int], bytes]
) -> tuple[float, float]:
    """(median round in ms, CPU µs per rank and round) of ``ranks`` processes running ``serve``."""
    pipes: list[tuple[int, int]] = []
    children = []
    for _ in range(ranks):
        down_r, down_w = os.pipe()
        up_r, up_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            for theirs in (down_w, up_r, *(fd for pair in pipes for fd in pair)):
                os.close(theirs)
            serve(down_r, up_w)
            os._exit(0)
        os.close(down_r)
        os.close(up_w)
        pipes.append((down_w, up_r))
        children.append(pid)
    selector = selectors.DefaultSelector()
    for _, answers in pipes:
        selector.register(answers, selectors.EVENT_READ)
    before = os.times()
    rounds = []
    for cell_id in range(WARM_UP + runs):
        started = time.perf_counter()
        data = command(cell_id)
        for commands, _ in pipes:
            os.write(commands, data)
        left = ranks
        while left:
            for key, _ in selector.select():
                os.read(key.fd, 65536)
                left -= 1
        if cell_id >= WARM_UP:
            rounds.append(time.perf_counter() - started)
    for commands, answers in pipes:
        os.close(commands)
        os.close(answers)
    for pid in children:
        os.waitpid(pid, 0)
    after = os.times()
    cpu = after.children_user + after.children_system
    cpu -= before.children_user + before.children_system
    return statistics.median(rounds) * 1e3, cpu / (WARM_UP + runs) / ranks * 1e6


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=256)
    parser.add_argument("--runs", type=int, default=100)
    args = parser.parse_args(argv)
    print(f"{args.ranks} processes, {args.runs} rounds after {WARM_UP}; {os.cpu_count()} CPUs")
    for name, serve, command in (("bare", _bare, _bare_command), ("wire", _wire, _wire_command)):
        median, cpu = measure(args.ranks, args.runs, serve, command)
        print(f"{name}: median round {median:.2f} ms, CPU {cpu:.0f} us per rank and round")
    return 0


if __name__ == "__main__":
    sys.exit(main())

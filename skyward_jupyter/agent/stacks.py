"""Where a rank is: its threads' Python stacks, and the collective its cell waits in.

Read from another thread (``sys._current_frames``), so it works while the cell's thread is
blocked: torch releases the GIL inside a collective. The cell's own frames are shown as in its
tracebacks (the agent's frames around them left out); the agent's threads are not the user's
business and are only counted.

A collective is recognised by its frame: a ``torch.distributed`` collective function on the
cell's thread, or autograd's backward (where DDP's gradient all-reduce waits; whether it waits or
computes, the pool tells by the rank's CPU use). The :class:`Watch` keeps how long the thread has
been in the same collective at the same line, sampled by the watchdog thread.
"""

from __future__ import annotations

import os
import pickle
import sys
import sysconfig
import threading
import time
import traceback
from dataclasses import dataclass
from types import FrameType
from typing import Any

from .. import protocol as p

_AGENT_DIR = os.path.dirname(os.path.abspath(__file__))
_INSTALLED = tuple(
    {os.path.join(p, "") for p in (sys.prefix, sys.base_prefix, *sysconfig.get_paths().values())}
    | {os.path.join(os.path.dirname(_AGENT_DIR), "")}
)
"""Python's own library, installed packages and this package: not the user's code."""
_C10D = os.path.join("torch", "distributed", "distributed_c10d.py")
_AUTOGRAD = os.path.join("torch", "autograd", "graph.py")
BACKWARD = "backward"
"""What a rank waiting in DDP's gradient all-reduce (or computing gradients) is in."""
COLLECTIVES = frozenset(
    {
        "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object",
        "all_to_all", "all_to_all_single", "barrier", "monitored_barrier", "broadcast",
        "broadcast_object_list", "gather", "gather_object", "reduce", "reduce_scatter",
        "reduce_scatter_tensor", "scatter", "scatter_object_list", "send", "recv",
        "batch_isend_irecv",
    }
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class Waiting:
    collective: str
    where: str
    """The user's line that called it: ``In [7] line 3`` or ``train.py line 40``."""


def waiting(frame: FrameType | None) -> Waiting | None:
    """The collective the stack ending at ``frame`` waits in, and the user's line calling it."""
    found: str | None = None
    while frame is not None:
        code = frame.f_code
        if found is None:
            if code.co_filename.endswith(_C10D) and code.co_name in COLLECTIVES:
                found = code.co_name
            elif code.co_filename.endswith(_AUTOGRAD) and code.co_name == "_engine_run_backward":
                found = BACKWARD
        elif _users(code.co_filename):
            return Waiting(found, line_of(code.co_filename, frame.f_lineno))
        frame = frame.f_back
    return None


def line_of(filename: str, lineno: int) -> str:
    """``In [7] line 3`` (a cell, named as the notebook numbers it), ``train.py line 40``."""
    return f"{p.cell_name(filename) or os.path.basename(filename)} line {lineno}"


def _users(filename: str) -> bool:
    """A frame of the user's code: a cell, a script, a module of theirs (not torch, not ours)."""
    if p.cell_name(filename) is not None:
        return True
    return not filename.startswith("<") and users_file(filename)


def users_file(filename: str) -> bool:
    """A file of the user's: not Python's library, an installed package, or this package."""
    path = os.path.abspath(filename)
    return not path.startswith(_INSTALLED) and "site-packages" not in path


class Watch:
    """How long the cell's thread has been waiting in the same collective (watchdog-sampled)."""

    def __init__(self, agent_threads: frozenset[str]) -> None:
        self._agent_threads = agent_threads
        self._now: Waiting | None = None
        self._since = 0.0

    def sample(self) -> tuple[Waiting | None, float]:
        main = threading.main_thread().ident
        seen = waiting(sys._current_frames().get(main or 0))
        now = time.monotonic()
        if seen != self._now:
            self._now, self._since = seen, now
        return seen, (now - self._since if seen else 0.0)

    def stacks(self) -> p.Stacks:
        """Every thread's stack, the cell's thread first, and what it waits in."""
        seen, waited = self.sample()
        pending = nccl_pending()
        if seen is None and pending:
            # NCCL collectives return at once; the wait shows at a later synchronisation.
            seen, waited = pending[0]
        frames = sys._current_frames()
        names = {t.ident: t.name for t in threading.enumerate()}
        main = threading.main_thread().ident
        order = sorted(frames, key=lambda ident: ident != main)
        parts, hidden = [], 0
        for ident in order:
            name = names.get(ident, f"thread {ident}")
            if name in self._agent_threads:
                hidden += 1
                continue
            lines = _format(frames[ident], from_user=ident == main)
            title = "cell thread" if ident == main else f"thread {name!r}"
            parts.append(f"{title}:\n" + ("".join(lines) or "  (between cells)\n"))
        if pending:
            parts.append("NCCL collectives not completed (flight recorder):\n")
            parts.extend(f"  {w.collective} from {w.where}, {age:.0f} s\n" for w, age in pending)
        if hidden:
            parts.append(f"({hidden} threads of the agent not shown)\n")
        return p.Stacks(
            "".join(parts), seen.collective if seen else None, seen.where if seen else None, waited
        )


def _format(frame: FrameType, from_user: bool) -> list[str]:
    """A thread's stack; for the cell's thread, from the user's first frame on (none between
    cells: the agent is waiting for its next command).
    """
    stack = traceback.extract_stack(frame)
    if from_user:
        first = next((i for i, f in enumerate(stack) if _users(f.filename)), len(stack))
        stack = traceback.StackSummary.from_list(stack[first:])
    kept = [
        f
        for f in stack
        if not (
            f.filename.startswith("<frozen") or os.path.abspath(f.filename).startswith(_AGENT_DIR)
        )
    ]
    return traceback.format_list(kept)


def nccl_pending() -> list[tuple[Waiting, float]]:
    """The NCCL collectives this rank issued that have not completed, oldest first, from torch's
    flight recorder (on when ``TORCH_FR_BUFFER_SIZE`` > 0, which the pool sets on GPU ranks). Not
    run here: the project's machines have no GPU.
    """
    if "torch" not in sys.modules:
        return []
    try:
        import torch
        import torch.distributed as dist

        if not (dist.is_initialized() and dist.get_backend() == "nccl"):
            return []
        dump = torch._C._distributed_c10d._dump_fr_trace(True, True, True)  # type: ignore[attr-defined]
        entries = pickle.loads(dump).get("entries", [])
    except (AttributeError, RuntimeError, ValueError, pickle.UnpicklingError):
        return []
    return pending_from(entries, time.time_ns())


def pending_from(entries: list[dict[str, Any]], now: int) -> list[tuple[Waiting, float]]:
    """The flight recorder's entries not completed, with the user's line that issued each."""
    found = []
    for entry in entries:
        if entry.get("state") == "completed":
            continue
        name = str(entry.get("profiling_name", "collective")).removeprefix("nccl:")
        frames = [f for f in entry.get("frames", ()) if _users(str(f.get("filename", "")))]
        where = line_of(str(frames[0]["filename"]), int(frames[0]["line"])) if frames else "?"
        age = (now - int(entry.get("time_created_ns", now))) / 1e9
        found.append((Waiting(name, where), age))
    return found

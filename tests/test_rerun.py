"""Re-running a training cell after a failed, interrupted or timed-out cell, in a real kernel.

Rank 1 fails (raises, or sleeps past the interrupt) while rank 0 waits in a collective: the
pool frees rank 0 by closing the group's connections and forms the group again. What was built
on the earlier group (a DDP model, an FSDP2 module, a ``new_group`` group) cannot move to the new
one: the failing cell names it, and its next use fails in one line saying how to build it again,
never with a peer's "Connection closed". Ranks that all stop in step keep the group, and what
was built on it.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from .test_magics import POOL2, Cell, Kernel


@pytest.fixture(scope="module")
def kernel() -> Iterator[Kernel]:
    k = Kernel()
    try:
        k.ok("%load_ext skyward_jupyter")
        yield k
    finally:
        k.close()


@pytest.fixture
def nb(kernel: Kernel) -> Iterator[Kernel]:
    yield kernel
    problem = kernel.ensure_healthy()
    kernel.register_pool_pids()
    if problem:
        pytest.fail(problem)


SETUP = (
    "%%sky\nimport time, torch, torch.nn as nn, torch.distributed as dist\n"
    "from torch.nn.parallel import DistributedDataParallel as DDP\n"
    "from torch.distributed.fsdp import fully_shard\n"
    "from torch.distributed.device_mesh import init_device_mesh\n"
    "torch.manual_seed(0)\n"
)


@dataclass(frozen=True)
class Kind:
    build: str
    """Binds ``obj``, built on the pool's group."""
    use: str
    """One training step with ``obj`` (a collective in it)."""
    listed: str
    """How the failing cell names ``obj``."""
    fix: str
    """What the refusal says to do."""
    rebuild: str
    """Doing it."""


KINDS = {
    "DDP": Kind(
        "obj = DDP(nn.Linear(4, 2))",
        "obj(torch.ones(8, 4)).sum().backward()",
        "obj (DDP)",
        "obj = DDP(obj.module)",
        "obj = DDP(obj.module)",
    ),
    "FSDP2": Kind(
        "obj = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))\nfully_shard(obj)",
        "obj(torch.ones(8, 4)).sum().backward()",
        "obj (FSDP)",
        "run the code that created and sharded it again",
        "obj = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))\nfully_shard(obj)",
    ),
    "new_group": Kind(
        "obj = dist.new_group([0, 1])",
        "t = torch.ones(2)\ndist.all_reduce(t, group=obj)",
        "obj (process group)",
        "obj = dist.new_group(...) as before",
        "obj = dist.new_group([0, 1])",
    ),
}

# Rank 1 fails before its step while rank 0 is in the step's collective, once.
TRAIN = (
    "%%sky\nfor step in range(3):\n"
    "    if step == 1 and dist.get_rank() == 1 and FAIL:\n"
    "        raise ValueError('bad batch on rank 1')\n"
    "{use}\n"
    "'trained'"
)


def _indented(code: str) -> str:
    return "\n".join("    " + line for line in code.splitlines())


def _refused(cell: Cell, kind: Kind) -> None:
    """The cell failed on every rank with the one-line refusal, before any collective."""
    assert cell.status == "error", str(cell)
    evalue = cell.errors[0]["evalue"]
    first = evalue.splitlines()[0]
    assert re.search(
        r"StaleGroupError: obj was built on the pool's earlier process group, which the pool "
        r"formed again after cell \d+; build it again: ",
        first,
    ), evalue
    assert kind.fix in first, evalue
    assert "other rank(s): rank 1: StaleGroupError" in evalue or "rank 0: StaleGroupError" in (
        evalue
    ), evalue
    text = str(cell)
    assert "Connection closed" not in text and "not initialized in the world" not in text, text


def _reformed(cell: Cell, listed: str) -> None:
    """The failing cell says that the group was formed again, and what must be built again."""
    note = next(
        (line for line in cell.stderr.splitlines() if "formed its process group again" in line),
        None,
    )
    assert note is not None, str(cell)
    assert "no rank was restarted" in note, note
    assert "must be built again" in note and listed in note, note


@pytest.mark.parametrize("name", list(KINDS))
def test_a_rerun_after_a_failure_refuses_what_was_built_on_the_earlier_group(
    nb: Kernel, name: str
) -> None:
    kind = KINDS[name]
    nb.ok(POOL2)
    nb.ok(SETUP + kind.build + "\nFAIL = True")
    train = TRAIN.format(use=_indented(kind.use))
    cell = nb.fails(train)
    assert "ValueError: bad batch on rank 1" in cell.errors[0]["evalue"], str(cell)
    _reformed(cell, kind.listed)
    nb.ok("%%sky\nFAIL = False")
    _refused(nb.fails(train), kind)  # the natural rerun: one line, on every rank
    nb.ok("%%sky\n" + kind.rebuild)
    assert nb.ok(train).shown == ["'trained'"]


@pytest.mark.parametrize("how", ["interrupted", "timed out"])
def test_a_rerun_after_a_stop_refuses_a_ddp_model_built_before(nb: Kernel, how: str) -> None:
    nb.ok(POOL2)
    nb.ok(SETUP + "obj = DDP(nn.Linear(4, 2))")
    # Rank 1 sleeps in Python (an interrupt stops it); rank 0 waits for it in the all-reduce.
    stuck = (
        "%%sky{options}\nif dist.get_rank() == 1:\n    time.sleep(60)\n"
        "print('waiting', flush=True)\nobj(torch.ones(8, 4)).sum().backward()"
    )
    if how == "interrupted":
        cell, _ = nb.interrupted(stuck.format(options=""), when="waiting")
    else:
        cell = nb.fails(stuck.format(options=" --timeout 2"))
        assert "timed out after 2.0 s" in cell.stderr, str(cell)
    assert cell.status == "error", str(cell)
    _reformed(cell, "obj (DDP)")
    _refused(nb.fails("%%sky\n" + KINDS["DDP"].use), KINDS["DDP"])
    nb.ok("%%sky\nobj = DDP(obj.module)\n" + KINDS["DDP"].use)


def test_ranks_that_stop_in_step_keep_the_group_and_what_was_built_on_it(nb: Kernel) -> None:
    nb.ok(POOL2)
    nb.ok(SETUP + "obj = DDP(nn.Linear(4, 2))\ng = dist.new_group([0, 1])")
    use = KINDS["DDP"].use + "\n" + KINDS["new_group"].use.replace("obj", "g")
    nb.ok("%%sky\n" + use)
    # Every rank raises at the same point: no collective is left half-done.
    cell = nb.fails("%%sky\n" + use + "\nraise ValueError(f'bad rank {dist.get_rank()}')")
    assert "formed its process group again" not in cell.stderr, str(cell)
    # An interrupt that finds every rank outside a collective.
    cell, _ = nb.interrupted(
        "%%sky\n" + use + "\nprint('sleeping', flush=True)\ntime.sleep(60)", when="sleeping"
    )
    assert cell.reply["ename"] == "KeyboardInterrupt", str(cell)
    assert "formed its process group again" not in cell.stderr, str(cell)
    nb.ok("%%sky\n" + use)

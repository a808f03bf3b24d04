"""Re-running a training cell after a failed, interrupted or timed-out cell, in a real kernel.

Rank 1 fails (raises, or sleeps past the interrupt) while rank 0 waits in a collective: the
pool frees rank 0 by closing the group's connections and forms the group again. A DDP model is
wrapped again on the new group, and the rerun trains. What torch cannot move to the new group (an
FSDP2 module, a ``new_group`` group, a DDP model with a communication hook) is named by the
failing cell, and its next use fails in one line saying how to build it again, never with a
peer's "Connection closed". Ranks that all stop in step keep the group, and what was built on it.
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
    "import threading\n"
    "torch.manual_seed(0)\n"
    # A rank says where it waits only once it has called its next collective (torch counts the
    # call), so the failure below finds it inside the collective whatever the machine's load.
    "def once_in_collective(then):\n"
    "    groups = dist.distributed_c10d._world.pg_map\n"
    "    calls = lambda: sum(g._get_sequence_number_for_group() for g in groups)\n"
    "    before = calls()\n"
    "    def watch():\n"
    "        while calls() == before:\n"
    "            time.sleep(0.001)\n"
    "        then()\n"
    "    threading.Thread(target=watch, daemon=True).start()\n"
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


STEP = "obj(torch.ones(8, 4)).sum().backward()"
HOOK = "from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as hooks\n"

KINDS = {
    "FSDP2": Kind(
        "obj = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))\nfully_shard(obj)",
        STEP,
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
    "DDP with a communication hook": Kind(
        HOOK + "obj = DDP(nn.Linear(4, 2))\nobj.register_comm_hook(None, hooks.allreduce_hook)",
        STEP,
        "obj (DDP)",
        "obj = DDP(obj.module, ...) as it was built, its hook too",
        "obj = DDP(obj.module)\nobj.register_comm_hook(None, hooks.allreduce_hook)",
    ),
}

# Rank 1 fails before its step once rank 0 is in the step's collective, once.
TRAIN = (
    "%%sky\nfor step in range(3):\n"
    "    if step == 1 and FAIL:\n"
    "        store = dist.distributed_c10d._get_default_store()\n"
    "        if dist.get_rank() == 0:\n"
    "            once_in_collective(lambda: store.set('rank 0 waits', '1'))\n"
    "        else:\n"
    "            store.wait(['rank 0 waits'])\n"
    "            raise ValueError('bad batch on rank 1')\n"
    "{use}\n"
    "'trained'"
)


def _indented(code: str) -> str:
    return "\n".join("    " + line for line in code.splitlines())


def _refused(cell: Cell, kind: Kind, name: str = "obj") -> None:
    """The cell failed on every rank with the one-line refusal, before any collective."""
    assert cell.status == "error", str(cell)
    evalue = cell.errors[0]["evalue"]
    first = evalue.splitlines()[0]
    assert re.search(
        rf"StaleGroupError: {name} was built on the pool's earlier process group, which the pool "
        r"formed again after cell \d+; build it again: ",
        first,
    ), evalue
    assert kind.fix.replace("obj", name) in first, evalue
    assert "other rank(s): rank 1: StaleGroupError" in evalue or "rank 0: StaleGroupError" in (
        evalue
    ), evalue
    text = str(cell)
    assert "Connection closed" not in text and "not initialized in the world" not in text, text


def _reformed(cell: Cell, listed: str | None = None) -> str:
    """The failing cell says that the group was formed again (no rank restarted), and what must be
    built again; returns its line.
    """
    note = next(
        (line for line in cell.stderr.splitlines() if "formed its process group again" in line),
        None,
    )
    assert note is not None, str(cell)
    assert "no rank was restarted" in note, note
    if listed is not None:
        assert "must be built again" in note and listed in note.split("must be built again")[1]
    return note


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


def test_a_ddp_model_is_wrapped_again_on_the_new_group_and_the_rerun_trains(nb: Kernel) -> None:
    nb.ok(POOL2)
    nb.ok(SETUP + "obj = DDP(nn.Linear(4, 2))\nopt = torch.optim.SGD(obj.parameters(), lr=0.1)")
    train = TRAIN.format(use=_indented(STEP + "\nopt.step()\nopt.zero_grad()"))
    nb.ok("%%sky\nFAIL = True")
    cell = nb.fails(train)
    assert "ValueError: bad batch on rank 1" in cell.errors[0]["evalue"], str(cell)
    note = _reformed(cell)
    assert "wrapped again on the new group: obj (DDP)" in note and "built again" not in note
    nb.ok("%%sky\nFAIL = False")
    assert nb.ok(train).shown == ["'trained'"]  # the natural rerun, as written
    weights = nb.ok("%%sky --all\nround(obj.module.weight.sum().item(), 6)").per_rank
    assert weights[0] == weights[1], weights  # rank 0's broadcast, then the same steps


@pytest.mark.parametrize("how", ["interrupted", "timed out"])
def test_after_a_stop_ddp_trains_on_and_a_group_built_before_is_refused(
    nb: Kernel, how: str
) -> None:
    nb.ok(POOL2)
    nb.ok(SETUP + "obj = DDP(nn.Linear(4, 2))\ng = dist.new_group([0, 1])")
    # Rank 1 sleeps in Python (an interrupt stops it); rank 0 waits for it in the all-reduce.
    stuck = (
        "%%sky{options}\nif dist.get_rank() == 1:\n    time.sleep(60)\n"
        "once_in_collective(lambda: print('waiting', flush=True))\n" + STEP
    )
    if how == "interrupted":
        cell, _ = nb.interrupted(stuck.format(options=""), when="waiting")
    else:
        cell = nb.fails(stuck.format(options=" --timeout 2"))
        assert "timed out after 2.0 s" in cell.stderr, str(cell)
    assert cell.status == "error", str(cell)
    note = _reformed(cell, "g (process group)")
    assert "wrapped again on the new group: obj (DDP)" in note, note
    nb.ok("%%sky\n" + STEP)
    group = KINDS["new_group"]
    _refused(nb.fails("%%sky\n" + group.use.replace("obj", "g")), group, "g")


def test_ranks_that_stop_in_step_keep_the_group_and_what_was_built_on_it(nb: Kernel) -> None:
    nb.ok(POOL2)
    nb.ok(SETUP + "obj = DDP(nn.Linear(4, 2))\ng = dist.new_group([0, 1])")
    use = STEP + "\n" + KINDS["new_group"].use.replace("obj", "g")
    nb.ok("%%sky\n" + use)
    # Every rank raises at the same point: no collective is left half-done.
    cell = nb.fails("%%sky\n" + use + "\nraise ValueError(f'bad rank {dist.get_rank()}')")
    assert "formed its process group again" not in cell.stderr, str(cell)
    # An interrupt that finds every rank outside a collective.
    cell, _ = nb.interrupted(
        "%%sky\n" + use + "\nprint('sleeping', flush=True)\ntime.sleep(60)", when="sleeping"
    )
    assert cell.reply["ename"] == "CellInterrupted", str(cell)
    assert "formed its process group again" not in cell.stderr, str(cell)
    nb.ok("%%sky\n" + use)


def _cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.skipif(_cuda_devices() < 2, reason="NCCL with two ranks needs two GPUs")
def test_with_nccl_a_ddp_model_is_wrapped_again_and_a_group_refused(nb: Kernel) -> None:
    nb.ok("%%sky --nodes 2 --backend nccl\npass")
    try:
        nb.ok(
            SETUP.replace("%%sky", "%%sky --nodes 2 --backend nccl")
            + "dev = torch.device('cuda', torch.cuda.current_device())\n"
            "obj = DDP(nn.Linear(4, 2).to(dev), device_ids=[dev.index])\n"
            "g = dist.new_group([0, 1])\nFAIL = True"
        )
        step = "obj(torch.ones(8, 4, device=dev)).sum().backward()\ntorch.cuda.synchronize()"
        train = TRAIN.replace("%%sky", "%%sky --nodes 2 --backend nccl").format(use=_indented(step))
        cell = nb.fails(train)
        note = _reformed(cell, "g (process group)")
        assert "wrapped again on the new group: obj (DDP)" in note, note
        nb.ok("%%sky --nodes 2 --backend nccl\nFAIL = False")
        assert nb.ok(train).shown == ["'trained'"]
        group = KINDS["new_group"]
        use = group.use.replace("obj", "g").replace("torch.ones(2)", "torch.ones(2, device=dev)")
        _refused(nb.fails("%%sky --nodes 2 --backend nccl\n" + use), group, "g")
    finally:
        nb.ok("%sky down")

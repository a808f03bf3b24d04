"""``--framework jax``: every rank in one ``jax.distributed`` world, on a CPU pool (issue 16).

JAX's CPU collectives (gloo) run a real cross-process ``psum`` here, as they would over a
network between machines; the cells are written as JAX users write multi-process code
(``shard_map`` over a mesh of every process's devices, ``multihost_utils``).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from skyward_jupyter import Pool
from skyward_jupyter.frameworks import Frameworks
from skyward_jupyter.results import PoolError
from skyward_jupyter.session import Session
from skyward_jupyter.spec import PoolSpec, SpecError

from .conftest import _module_pool_pids, agent_pids, wait_for

PSUM = """
import jax, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
mesh = Mesh(np.array(jax.devices()), ("i",))
psum = jax.jit(jax.shard_map(lambda a: jax.lax.psum(a, "i"), mesh=mesh, in_specs=P("i"),
                             out_specs=P()))
local = np.array([jax.process_index() + 1.0])
float(psum(jax.make_array_from_process_local_data(NamedSharding(mesh, P("i")), local))[0])
"""
WORLD = """
import os, jax
import torch.distributed as dist
(jax.process_count(), jax.process_index(), len(jax.devices()), len(jax.local_devices()),
 os.environ["JAX_COORDINATOR_ADDRESS"], os.environ["JAX_NUM_PROCESSES"],
 os.environ["JAX_PROCESS_ID"], os.environ["JAX_LOCAL_DEVICE_COUNT"],
 dist.is_initialized() and dist.get_world_size())
"""


def _pids(pool: Pool) -> set[int]:
    return {r.hello.pid for r in pool.ranks if r.hello}


@pytest.fixture(scope="module")
def pool() -> Iterator[Pool]:
    """torch and JAX together: each world is the pool's, side by side. Its ranks are
    registered with conftest's leak check (a lost rank's test replaces them all).
    """
    shared = Pool(nodes=2, frameworks=Frameworks(torch=True, jax=True), interrupt_grace=2.0)
    shared.start()
    _module_pool_pids.update(_pids(shared))
    try:
        yield shared
    finally:
        last = _pids(shared)
        shared.close()
        _module_pool_pids.difference_update(last)
        wait_for(lambda: not (last & agent_pids()), 15, "the shared pool's ranks to end")


@pytest.fixture(autouse=True)
def _replaced_ranks_are_the_pools(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "pool" in request.fixturenames:
        _module_pool_pids.update(_pids(request.getfixturevalue("pool")))


def test_every_rank_is_in_one_jax_world_beside_torchs(pool: Pool) -> None:
    assert "jax.distributed, 2 processes" in pool.worlds_note
    assert "torch.distributed gloo" in pool.worlds_note
    worlds = pool.run(WORLD).raise_for_errors().values
    head = pool.nodes[0].address
    for rank, world in enumerate(worlds):
        count, index, devices, local, coordinator, n, pid, local_count, torch_world = world
        assert (count, index, devices, local) == (2, rank, 2, 1)
        assert coordinator.startswith(f"{head}:") and (n, pid, local_count) == ("2", str(rank), "1")
        assert torch_world == 2
    assert pool.run(PSUM).raise_for_errors().values == [3.0, 3.0]


def test_a_scripts_own_initialize_finds_the_pools_world(pool: Pool) -> None:
    result = pool.run(
        "import jax\njax.distributed.initialize()\njax.distributed.shutdown()\n"
        "jax.distributed.initialize(num_processes=2, process_id=jax.process_index())\n"
        "jax.process_count()"
    ).raise_for_errors()
    assert result.values == [2, 2]
    assert any("uses the pool's JAX world (2 processes)" in n for n in result.notes)
    assert any("shutdown() is left to the pool" in n for n in result.notes)
    wrong = pool.run("jax.distributed.initialize(num_processes=4)")
    causes = [e for e in wrong.errors if not e.secondary]  # a peer may be stopped first
    assert causes and {e.type_name for e in causes} == {"ValueError"}, wrong.errors
    assert "the pool's JAX world has 2 processes" in causes[0].message
    assert pool.run(PSUM).raise_for_errors().values == [3.0, 3.0]


def test_a_failing_rank_leaves_the_world_and_the_namespaces(pool: Pool) -> None:
    pool.run("kept = 'here'").raise_for_errors()
    failed = pool.run("if jax.process_index() == 1:\n    raise ValueError('rank 1 fails')\n")
    causes = [e for e in failed.errors if not e.secondary]  # rank 0 may be stopped by the pool
    assert [e.rank for e in causes] == [1] and causes[0].type_name == "ValueError", failed.errors
    assert pool.run(PSUM).raise_for_errors().values == [3.0, 3.0]
    assert pool.run("kept").values == ["here", "here"]


def test_an_interrupted_loop_of_collectives_leaves_a_working_world(pool: Pool) -> None:
    pool.run(PSUM).raise_for_errors()
    loop = (
        "import time\nfor step in range(100000):\n"
        "    total = float(psum(x)[0])\n    time.sleep(0.01)\n"
    )
    pool.run(
        "x = jax.make_array_from_process_local_data(NamedSharding(mesh, P('i')), local)"
    ).raise_for_errors()
    stopped = pool.run(loop, timeout=2.0)
    assert stopped.errors and any("timed out" in n for n in stopped.notes)
    # A rank stopped inside a collective is killed and every rank replaced; either way the
    # world works again.
    assert pool.run(PSUM).raise_for_errors().values == [3.0, 3.0]
    assert pool.run("jax.process_count()").values == [2, 2]


def test_a_lost_rank_brings_a_fresh_world_on_every_rank(pool: Pool) -> None:
    pool.run("kept = 1").raise_for_errors()
    before = [r.hello.pid for r in pool.ranks if r.hello]
    os.kill(before[1], signal.SIGKILL)
    wait_for(
        lambda: all(
            r.hello is not None and r.hello.pid not in before and r.state.value == "ready"
            for r in pool.ranks
        ),
        60,
        "every rank to be replaced",
    )
    result = pool.run(PSUM).raise_for_errors()
    assert result.values == [3.0, 3.0] and result.lost == (1,)
    assert pool.run("'kept' in globals()").values == [False, False]
    assert pool.run(WORLD).raise_for_errors().values[1][:3] == (2, 1, 2)


def test_jax_alone_sets_up_no_torch_group() -> None:
    session = Session(announce=lambda _: None)
    try:
        spec = session.spec_from({"frameworks": ["jax"], "nodes": 2})
        result = session.run_cell(WORLD + "\n", {}, spec=spec).raise_for_errors()
        assert [v[:3] for v in result.values] == [(2, 0, 2), (2, 1, 2)]
        assert [v[-1] for v in result.values] == [False, False]
        assert session.pools["default"].pool.worlds_note == "jax.distributed, 2 processes"
    finally:
        session.down_all()


def test_framework_none_sets_up_nothing() -> None:
    with Pool(nodes=2, frameworks=Frameworks(torch=False)) as pool:
        assert "--framework none" in pool.worlds_note
        result = pool.run(
            "import torch.distributed as dist\n"
            "(dist.is_initialized(), rank, world_size, 'device' in globals())"
        )
        assert result.values == [(False, 0, 2, False), (False, 1, 2, False)]


def test_without_jax_on_the_ranks_the_error_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shim = tmp_path / "jax"
    shim.mkdir()
    (shim / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'jax'\")\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    with pytest.raises(PoolError) as raised:
        Pool(nodes=2, frameworks=Frameworks(jax=True)).start()
    message = str(raised.value)
    assert message.startswith("JAX is not installed on rank 0 (node 0, ")
    assert "pip install 'skyward_jupyter[jax]'" in message and "\n" not in message


def test_framework_options_are_checked_before_any_machine() -> None:
    from skyward_jupyter.magics import SkyMagics  # noqa: F401 - the option table is complete

    session = Session()
    spec = session.spec_from({"frameworks": ["torch", "jax", "jax"]})
    assert spec.frameworks == ("jax", "torch") and spec.describe().endswith("local, jax")
    setup = session.spec_from({"keras_backend": "jax"}).framework_setup({})
    assert setup.jax and setup.torch is None and setup.rank_env(False, {})["KERAS_BACKEND"] == "jax"
    with pytest.raises(SpecError, match="--framework none sets nothing up; it cannot go"):
        session.spec_from({"frameworks": ["none", "jax"]})
    with pytest.raises(SpecError, match="KERAS_BACKEND=torch and --keras-backend jax"):
        session.spec_from({"env": [("KERAS_BACKEND", "torch")], "keras_backend": "jax"})
    assert PoolSpec().framework_setup({}).agent_settings()["frameworks"] is None

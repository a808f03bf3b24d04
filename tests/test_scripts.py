"""Training code people already have, run on the warm pool as written (``%sky run``, issue 11).

The scripts in ``tests/byo/`` are written the way their community writes them: the PyTorch
ddp-tutorial-series torchrun example (its own ``init_process_group`` and
``destroy_process_group``, a data module beside it, argparse, a snapshot file in its directory),
and a dump of what a worker sees of its launcher, run under real ``torchrun`` for comparison.
Each test copies them into its own directory, as a user's project would hold them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import stat
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from skyward_jupyter import Pool
from skyward_jupyter.events import MetricsLogged
from skyward_jupyter.protocol import Script
from skyward_jupyter.results import CellError, PoolError, RunResult
from skyward_jupyter.session import PoolSpec, Session

from .conftest import kill_and_await_replacement, wait_for
from .test_magics import Kernel

BYO = Path(__file__).resolve().parent / "byo"
ALL_REDUCE = (
    "import torch, torch.distributed as dist\n"
    "t = torch.ones(1) * (dist.get_rank() + 1)\n"
    "dist.all_reduce(t)\n"
    "t.item()"
)


def run_script(pool: Pool, path: Path, *argv: str, timeout: float | None = None) -> RunResult:
    return pool.run(
        path.read_text(), filename=str(path), script=Script(str(path), argv), timeout=timeout
    )


def write(directory: Path, name: str, source: str) -> Path:
    path = directory / name
    path.write_text(textwrap.dedent(source))
    return path


@pytest.fixture()
def project(tmp_path: Path) -> Path:
    """A user's project directory holding the community scripts."""
    for name in ("multigpu_torchrun.py", "datautils.py", "dump_env.py"):
        shutil.copy(BYO / name, tmp_path / name)
    return tmp_path


# ---------------------------------------------------------------------- a torchrun script as is


def test_the_ddp_tutorial_script_runs_twice_and_leaves_the_pool_whole(
    pool2: Pool, project: Path
) -> None:
    pids = [r.hello.pid for r in pool2.ranks if r.hello]
    script = project / "multigpu_torchrun.py"

    first = run_script(pool2, script, "2", "1", "--batch_size", "32")
    first.raise_for_errors()
    # Its destroy_process_group() was honoured and the group formed again, said once.
    assert any("destroyed the process group" in n for n in first.notes), first.notes
    assert any("uses the pool's process group (gloo, 2 ranks)" in n for n in first.notes)
    # Its working directory was its own: the snapshot sits beside it.
    assert (project / "snapshot.pt").is_file()

    second = run_script(pool2, script, "3", "1")
    second.raise_for_errors()
    # The same warm processes: no interpreter start, no torch import.
    assert [r.hello.pid for r in pool2.ranks if r.hello] == pids
    # A collective right after works at once (no timeout from a destroyed group).
    assert pool2.run(ALL_REDUCE, timeout=20).raise_for_errors().values == [3.0, 3.0]
    assert all(r.state.value == "idle" or r.state.value == "ready" for r in pool2.ranks)


def test_a_script_sees_argv_main_its_directory_and_leaves_the_cells_alone(
    pool2: Pool, tmp_path: Path
) -> None:
    pool2.run("kept = 41").raise_for_errors()
    (tmp_path / "helper_mod.py").write_text("ANSWER = 42\n")
    (tmp_path / "data.csv").write_text("a,b\n1,2\n")
    script = write(
        tmp_path,
        "show.py",
        """
        import os, sys
        import helper_mod
        leaked = "from the script"
        assert __name__ == "__main__", __name__
        assert sys.argv == [__file__, "--lr", "0.1", "x y"], sys.argv
        assert os.getcwd() == os.path.dirname(__file__), os.getcwd()
        assert sys.path[0] == os.path.dirname(__file__), sys.path[:2]
        assert "kept" not in globals()
        assert open("data.csv").read().startswith("a,b")
        assert helper_mod.ANSWER == 42
        def typed(x: int) -> None: ...
        assert typed.__annotations__["x"] is int, "annotations are evaluated, as python runs it"
        def walrus(x: (y := int)) -> None: ...  # valid, though not with string annotations
        """,
    )
    cwd_before = pool2.run("import os, sys; (os.getcwd(), sys.argv, sys.path[0])").values
    run_script(pool2, script, "--lr", "0.1", "x y").raise_for_errors()
    after = pool2.run("(kept, 'leaked' in globals(), __name__)").raise_for_errors().values
    assert after == [(41, False, "__main__")] * 2
    annotated = pool2.run("def typed(x: (y := int)) -> None: ...\ntyped.__annotations__['x'] is y")
    assert annotated.raise_for_errors().values == [True, True]
    assert pool2.run("import os, sys; (os.getcwd(), sys.argv, sys.path[0])").values == cwd_before


def test_a_script_beside_the_notebook_is_on_sys_path_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``python show.py`` puts the script's directory on ``sys.path`` once; the pool's cells
    already have the notebook's directory there, which must not make it twice.
    """
    monkeypatch.chdir(tmp_path)
    script = write(
        tmp_path,
        "where.py",
        """
        import os, sys
        here = os.path.dirname(__file__)
        assert sys.path[0] == here and sys.path.count(here) == 1, list(sys.path)
        def walrus(x: (y := int)) -> None: ...  # valid, though not with string annotations
        """,
    )
    session = Session(announce=lambda text: None)
    try:
        paths = "import sys; list(sys.path)"
        before = session.run_cell(paths, {}, spec=PoolSpec(nodes=2)).raise_for_errors().values
        assert str(tmp_path) in before[0]
        session.run_script(str(script), []).raise_for_errors()
        assert session.run_cell(paths, {}).raise_for_errors().values == before
    finally:
        session.down_all()


def test_torch_distributed_nn_uses_the_group_formed_again(tmp_path: Path) -> None:
    """``torch.distributed.nn.functional`` takes the default group at its import as its
    functions' default, and DDP imports it. Imported while the pool's first group was up, it
    kept that group for the rank's life: once a lost rank was replaced and the group formed
    again, its collectives went to the dead peer.
    """
    script = write(
        tmp_path,
        "ddp_once.py",
        """
        import torch, torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP
        dist.init_process_group("gloo")
        DDP(torch.nn.Linear(2, 2))(torch.ones(1, 2)).sum().backward()
        """,
    )
    with Pool(nodes=2) as pool:
        run_script(pool, script).raise_for_errors()
        kill_and_await_replacement(pool, 1)
        cell = "import torch\nimport torch.distributed.nn.functional as F\n"
        cell += "F.all_reduce(torch.ones(1)).item()"
        assert pool.run(cell, timeout=30).raise_for_errors().values == [2.0, 2.0]


def test_a_scripts_objects_do_not_outlive_its_run(pool2: Pool, tmp_path: Path) -> None:
    """A script's namespace is a cycle (its functions hold its globals): on a GPU, a model left
    to a later collection would still hold its memory when the next run builds one.
    """
    script = write(
        tmp_path,
        "cyclic.py",
        """
        import builtins, gc, weakref

        class Model:
            pass

        def train():
            return model

        model = Model()
        builtins._sky_test_model = weakref.ref(model)
        gc.collect()  # the namespace is old now: only a full collection would free it
        """,
    )
    run_script(pool2, script).raise_for_errors()
    gone = pool2.run("import builtins; builtins._sky_test_model() is None").raise_for_errors()
    assert gone.values == [True, True]


def test_an_edited_module_beside_the_script_is_imported_afresh(pool2: Pool, tmp_path: Path) -> None:
    (tmp_path / "helper_mod.py").write_text("ANSWER = 42\n")
    script = write(
        tmp_path,
        "answer.py",
        """
        import json, sys
        import helper_mod
        json.dump(helper_mod.ANSWER, open(sys.argv[1], "w"))
        """,
    )
    out = tmp_path / "answer.json"
    run_script(pool2, script, str(out)).raise_for_errors()
    assert json.loads(out.read_text()) == 42
    (tmp_path / "helper_mod.py").write_text("ANSWER = 43\n")
    run_script(pool2, script, str(out)).raise_for_errors()
    assert json.loads(out.read_text()) == 43
    # Neither the module nor its directory stays with the ranks after the run.
    assert pool2.run("import sys\n'helper_mod' in sys.modules").values == [False, False]


def test_restart_count_counts_failures_not_a_scripts_destroy(pool2: Pool) -> None:
    count = "import os\nos.environ['TORCHELASTIC_RESTART_COUNT']"
    before = int(pool2.run(count).raise_for_errors().values[0])
    pool2.run("import torch.distributed as dist\ndist.destroy_process_group()").raise_for_errors()
    assert pool2.run(count).values == [str(before)] * 2
    failing = (
        "import torch, torch.distributed as dist\n"
        "if dist.get_rank() == 1:\n"
        "    raise ValueError('bad')\n"
        "dist.all_reduce(torch.ones(1))"
    )
    assert not pool2.run(failing, timeout=30).ok
    assert pool2.run(count).values == [str(before + 1)] * 2


def test_a_scripts_error_shows_its_own_file_and_line(pool2: Pool, tmp_path: Path) -> None:
    script = write(
        tmp_path,
        "broken.py",
        """
        import torch.distributed as dist

        def train():
            raise ValueError(f"bad batch on rank {dist.get_rank()}")

        train()
        """,
    )
    result = run_script(pool2, script)
    error = CellError(result.errors)
    assert error.primary.type_name == "ValueError"
    assert f'File "{script}", line 5, in train' in error.primary.traceback
    assert 'raise ValueError(f"bad batch on rank {dist.get_rank()}")' in error.primary.traceback
    assert pool2.run(ALL_REDUCE, timeout=20).raise_for_errors().values == [3.0, 3.0]


def test_a_scripts_log_reaches_the_views(pool2: Pool, tmp_path: Path) -> None:
    events: list[MetricsLogged] = []
    unsubscribe = pool2.subscribe(
        lambda e: events.append(e) if isinstance(e, MetricsLogged) else None
    )
    script = write(
        tmp_path,
        "logs.py",
        """
        from skyward_jupyter import log
        for step in range(3):
            log(step=step, loss=1.0 / (step + 1))
        """,
    )
    try:
        run_script(pool2, script).raise_for_errors()
    finally:
        unsubscribe()
    rows = sorted((e.rank, step, values["loss"]) for e in events for step, values in e.rows)
    assert rows == [(r, s, 1.0 / (s + 1)) for r in (0, 1) for s in range(3)]


def test_exit_statuses_of_a_script(pool2: Pool, tmp_path: Path) -> None:
    fine = write(tmp_path, "fine.py", "import sys\nsys.exit(0)\n")
    assert run_script(pool2, fine).ok
    mixed = write(
        tmp_path,
        "mixed.py",
        "import sys, torch.distributed as dist\nsys.exit(0 if dist.get_rank() == 0 else 3)\n",
    )
    result = run_script(pool2, mixed)
    # Rank 0 may be stopped by the pool, after rank 1's failure, before its own exit: secondary.
    assert [e.rank for e in result.errors if not e.secondary] == [1], result.errors
    summary = CellError(result.errors).summary().splitlines()[0]
    assert summary.startswith("cell failed on rank 1 ("), summary
    assert summary.endswith("ScriptExit: mixed.py exited with status 3"), summary
    assert pool2.run(ALL_REDUCE, timeout=20).raise_for_errors().values == [3.0, 3.0]


def test_a_script_times_out_like_a_cell(pool2: Pool, tmp_path: Path) -> None:
    sleeper = write(tmp_path, "sleeper.py", "import time\ntime.sleep(60)\n")
    result = run_script(pool2, sleeper, timeout=1.0)
    assert not result.ok
    assert any("timed out after 1.0 s" in n for n in result.notes)
    assert pool2.run(ALL_REDUCE, timeout=20).raise_for_errors().values == [3.0, 3.0]


# ------------------------------------------------------- the script's own process-group calls


def test_init_process_group_that_matches_the_pool_uses_its_group(pool2: Pool) -> None:
    result = pool2.run(
        "import os, torch.distributed as dist\n"
        "dist.init_process_group('gloo', init_method='env://',\n"
        "    rank=int(os.environ['RANK']), world_size=int(os.environ['WORLD_SIZE']))\n"
        "dist.init_process_group(backend='cpu:gloo,cuda:nccl')\n"
        "from torch.distributed import init_process_group\n"
        "init_process_group()\n"
        "dist.get_world_size()"
    ).raise_for_errors()
    assert result.values == [2, 2]


@pytest.mark.parametrize(
    ("call", "says"),
    [
        (
            "dist.init_process_group('nccl')",
            "init_process_group(backend='nccl'): this pool's process group uses 'gloo' "
            "(the ranks have no GPU)",
        ),
        ("dist.init_process_group(rank=0)", "init_process_group(rank=0): this process is rank"),
        (
            "dist.init_process_group(world_size=4)",
            "init_process_group(world_size=4): the pool's group has 2 ranks",
        ),
    ],
)
def test_init_process_group_that_differs_is_a_clear_error(
    pool2: Pool, call: str, says: str
) -> None:
    result = pool2.run(f"import torch.distributed as dist\n{call}")
    errors = result.errors
    # The rank that fails first leads; a peer the pool stopped before it raised the same error
    # itself ends as a secondary KeyboardInterrupt.
    assert errors and all(e.type_name == "ValueError" or e.secondary for e in errors), errors
    assert any(not e.secondary for e in errors), errors
    first = CellError(errors).summary().splitlines()[0]
    assert says in first, first
    assert pool2.run(ALL_REDUCE, timeout=20).raise_for_errors().values == [3.0, 3.0]


def test_destroy_is_honoured_in_the_cell_and_the_next_cell_has_a_group(pool2: Pool) -> None:
    result = pool2.run(
        "import torch.distributed as dist\ndist.destroy_process_group()\ndist.is_initialized()"
    ).raise_for_errors()
    assert result.values == [False, False]
    # The pool formed its group again before this returned: status shows ready ranks now.
    assert {r.state.value for r in pool2.ranks} <= {"idle", "ready"}
    assert pool2.run(ALL_REDUCE, timeout=20).raise_for_errors().values == [3.0, 3.0]


def test_a_script_may_destroy_and_init_again_in_one_run(pool2: Pool, tmp_path: Path) -> None:
    script = write(
        tmp_path,
        "twice.py",
        """
        import torch, torch.distributed as dist
        for round in range(2):
            dist.init_process_group("gloo")
            t = torch.ones(1)
            dist.all_reduce(t)
            assert t.item() == 2.0
            dist.destroy_process_group()
        """,
    )
    run_script(pool2, script).raise_for_errors()
    assert pool2.run(ALL_REDUCE, timeout=20).raise_for_errors().values == [3.0, 3.0]


# ------------------------------------------------------------------------ torchrun's environment

LAUNCHER_ONLY = {"TORCHELASTIC_SIGNALS_TO_HANDLE", "_"}
"""Set by torchrun for its own agent (the signals it forwards) or by the shell: no worker reads."""
SAME_VALUE = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "OMP_NUM_THREADS",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
)


def _dumps(directory: Path) -> list[dict[str, object]]:
    return [json.loads((directory / f"rank{k}.json").read_text()) for k in (0, 1)]


def test_a_rank_has_the_environment_torchrun_gives_a_worker(project: Path) -> None:
    under_torchrun, on_pool = project / "torchrun", project / "pool"
    under_torchrun.mkdir()
    on_pool.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    torchrun = Path(sys.executable).with_name("torchrun")
    subprocess.run(
        [
            str(torchrun),
            "--standalone",
            "--nproc-per-node",
            "2",
            "dump_env.py",
            str(under_torchrun),
        ],
        cwd=project,
        env=env,
        check=True,
        capture_output=True,
        timeout=120,
    )
    with Pool(nodes=1, procs_per_node=2) as pool:
        run_script(pool, project / "dump_env.py", str(on_pool)).raise_for_errors()

    for theirs, ours in zip(_dumps(under_torchrun), _dumps(on_pool), strict=True):
        their_env, our_env = theirs["env"], ours["env"]
        assert isinstance(their_env, dict) and isinstance(our_env, dict)
        launcher = set(their_env) - set(os.environ) - LAUNCHER_ONLY
        assert launcher - set(our_env) == set(), "torchrun sets these, the pool does not"
        assert {k: our_env[k] for k in SAME_VALUE} == {k: their_env[k] for k in SAME_VALUE}
        # Nor does the pool set torch variables of its own on a CPU rank: a flight recorder there
        # would capture a Python stack at every collective of the training loop. (The socket
        # interface variables are the pool's choice of route, set where the user left them.)
        torch_settings = {k for k in our_env if k.startswith("TORCH_")}
        assert torch_settings - set(their_env) - set(os.environ) == set()
        # Same meaning, different value by nature: the address names this machine, the port is
        # the port of the store the group was formed through, one run id for every rank, and an
        # error file per rank.
        for dump in (theirs, ours):
            d_env = dump["env"]
            assert isinstance(d_env, dict)
            assert dump["master_ip"] == socket.gethostbyname("localhost") or str(
                dump["master_ip"]
            ).startswith("127.")
            assert int(d_env["MASTER_PORT"]) == dump["store_port"]
            # torchrun's directory outlives its run; the pool's (private) one goes with the pool
            error_dir = os.path.dirname(d_env["TORCHELASTIC_ERROR_FILE"])
            assert os.path.isdir(error_dir) if dump is theirs else not os.path.exists(error_dir)
            assert d_env["TORCHELASTIC_RUN_ID"]
        assert (theirs["rank"], theirs["world"]) == (ours["rank"], ours["world"])
    ours0, ours1 = (d["env"] for d in _dumps(on_pool))
    assert isinstance(ours0, dict) and isinstance(ours1, dict)
    assert ours0["TORCHELASTIC_RUN_ID"] == ours1["TORCHELASTIC_RUN_ID"]
    assert ours0["TORCHELASTIC_ERROR_FILE"] != ours1["TORCHELASTIC_ERROR_FILE"]


RECORDED = """\
import json, os, sys
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

LAUNCH = ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_ERROR_FILE")


@record
def main() -> None:
    dist.init_process_group("gloo")
    seen = {name: os.environ[name] for name in LAUNCH}
    with open(os.path.join(sys.argv[1], f"rank{dist.get_rank()}.json"), "w") as out:
        json.dump(seen, out)
    dist.barrier()  # both ranks wrote what they saw
    if sys.argv[2] == "fail":
        if dist.get_rank() == 1:
            raise ValueError("rank 1 fails on purpose")
        dist.barrier()  # waits for rank 1, which failed: the pool stops it


if __name__ == "__main__":
    main()
"""
CELLS_LAUNCH = (
    "import os\n[os.environ[n] for n in ('TORCHELASTIC_RUN_ID', 'TORCHELASTIC_ERROR_FILE')]"
)


def test_the_users_env_wins_over_torchruns_choices(tmp_path: Path) -> None:
    env = {"OMP_NUM_THREADS": "2", "ACCELERATE_USE_CPU": "false", "TORCHELASTIC_RUN_ID": "mine"}
    script = write(tmp_path, "recorded.py", RECORDED)
    with Pool(nodes=2, env=env) as pool:
        values = (
            pool.run(
                "import os, torch\n"
                "(os.environ['OMP_NUM_THREADS'], torch.get_num_threads(), "
                "os.environ['ACCELERATE_USE_CPU'], os.environ['TORCHELASTIC_RUN_ID'])"
            )
            .raise_for_errors()
            .values
        )
        for run in ("first", "second"):  # the same run id twice: each run still has its file
            (tmp_path / run).mkdir()
            run_script(pool, script, str(tmp_path / run), "fail", timeout=60)
            seen = [json.loads((tmp_path / run / f"rank{k}.json").read_text()) for k in (0, 1)]
            assert [(s["TORCHELASTIC_RUN_ID"], s["TORCHELASTIC_RESTART_COUNT"]) for s in seen] == [
                ("mine", "0")
            ] * 2
    assert values == [("2", 2, "false", "mine")] * 2


def test_each_script_run_is_a_launch_of_its_own(tmp_path: Path) -> None:
    """As each torchrun is: its own run id, no restarts yet (also after a failed run), an error
    file of its own for ``@record`` that reports as before, private, and gone with the pool.
    """
    script = write(tmp_path, "recorded.py", RECORDED)

    def launch(outcome: str) -> tuple[RunResult, list[dict[str, str]]]:
        seen = tmp_path / outcome
        seen.mkdir()
        result = run_script(pool, script, str(seen), outcome, timeout=60)
        return result, [json.loads((seen / f"rank{k}.json").read_text()) for k in (0, 1)]

    with Pool(nodes=2) as pool:
        cells = pool.run(CELLS_LAUNCH).raise_for_errors().values
        failed, first = launch("fail")
        assert not failed.ok
        headline = CellError(failed.errors).summary().splitlines()[0]
        assert headline.startswith("cell failed on rank 1 "), headline
        assert headline.endswith("ValueError: rank 1 fails on purpose"), headline
        # The cells' group was formed again after the failure; the next run is a new launch.
        assert pool.run("import os\nos.environ['TORCHELASTIC_RESTART_COUNT']").values == ["1"] * 2
        second_result, second = launch("pass")
        second_result.raise_for_errors()
        assert pool.run(CELLS_LAUNCH).values == cells  # the cells' own launch, put back
        for run in (first, second):
            assert run[0]["TORCHELASTIC_RUN_ID"] == run[1]["TORCHELASTIC_RUN_ID"]
            assert [r["TORCHELASTIC_RESTART_COUNT"] for r in run] == ["0", "0"]
        run_ids = {cells[0][0], first[0]["TORCHELASTIC_RUN_ID"], second[0]["TORCHELASTIC_RUN_ID"]}
        assert len(run_ids) == 3, run_ids
        # Each rank's error file is the run's own, in the rank's private directory; rank 1's
        # holds what @record wrote, readable by this user alone; those of the run that passed
        # (nothing recorded) are gone.
        for k in (0, 1):
            private = Path(cells[k][1]).parent
            files = [Path(run[k]["TORCHELASTIC_ERROR_FILE"]) for run in (first, second)]
            assert files[0] != files[1] and all(f.parent.parent == private for f in files)
        recorded = Path(first[1]["TORCHELASTIC_ERROR_FILE"])
        error = json.loads(recorded.read_text())
        assert error["message"]["message"] == "ValueError: rank 1 fails on purpose"
        assert stat.S_IMODE(recorded.stat().st_mode) == 0o600
        assert stat.S_IMODE(recorded.parent.stat().st_mode) == 0o700
        assert not any(Path(r["TORCHELASTIC_ERROR_FILE"]).parent.exists() for r in second)
    wait_for(lambda: not recorded.parent.parent.exists(), 10, "the error file to go with the pool")


def test_ranks_sharing_a_machine_get_one_thread_each(pool2: Pool) -> None:
    values = pool2.run(
        "import os, torch\n(os.environ.get('OMP_NUM_THREADS'), torch.get_num_threads())"
    ).values
    expected = os.environ.get("OMP_NUM_THREADS", "1")
    assert values == [(expected, int(expected))] * 2


@pytest.fixture(autouse=True)
def _pool_is_whole(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test that left the shared pool unable to run a collective fails here, not the next."""
    yield
    if "pool2" in request.fixturenames:
        pool = request.getfixturevalue("pool2")
        assert pool.run(ALL_REDUCE, timeout=30).raise_for_errors().values == [3.0, 3.0]


# ------------------------------------------------------------------ the group's state is told


def test_status_says_broken_when_the_group_cannot_form_again() -> None:
    said: list[str] = []
    session = Session(announce=said.append)
    breaker = (
        "import torch.distributed as dist\n"
        "from skyward_jupyter.agent import torch_setup\n"
        "def refuse(self, port, secret):\n"
        "    raise RuntimeError('no route to the store')\n"
        "torch_setup.ProcessGroup.join = refuse\n"
        "dist.destroy_process_group()\n"
    )
    try:
        session.run_cell(breaker, {}, spec=PoolSpec(nodes=2)).raise_for_errors()
        assert any("could not recover" in s and "no route to the store" in s for s in said)
        status = session.status()
        assert ", broken, " in status and "run %sky restart" in status, status
        with pytest.raises(PoolError, match=r"no working process group .* restart it"):
            session.run_cell(ALL_REDUCE, {})
        session.restart()
        assert ", ready, " in session.status()  # the panels' word: no cell on it yet
        assert session.run_cell(ALL_REDUCE, {}).raise_for_errors().values == [3.0, 3.0]
    finally:
        session.down_all()


# --------------------------------------------------------------- %sky run in a real kernel


@pytest.fixture(scope="module")
def kernel() -> Iterator[Kernel]:
    nb = Kernel()
    try:
        nb.ok("%load_ext skyward_jupyter")
        yield nb
    finally:
        nb.close()


def test_sky_run_in_a_kernel(kernel: Kernel, project: Path) -> None:
    script = project / "multigpu_torchrun.py"
    first = kernel.ok(f"%sky run --nodes 2 {script} 2 1 --batch_size 32")
    assert "[GPU0] Epoch 0 | Batchsize: 32 | Steps: 4" in first.stdout, str(first)
    assert "[GPU1]" not in first.stdout  # the head's output only, as for a cell
    assert "uses the pool's process group (gloo, 2 ranks)" in first.stderr, str(first)
    second = kernel.ok(f"%sky run {script} 3 1")
    assert "Resuming training from snapshot at Epoch 2" in second.stdout, str(second)
    assert "starting" not in second.stderr  # the warm pool, not a new one
    cell = kernel.ok(f"%%sky --all\n{ALL_REDUCE}")
    assert cell.per_rank == {0: "3.0", 1: "3.0"}, str(cell)
    assert ", idle, " in kernel.status()  # the panels' word: waiting for the next cell
    kernel.register_pool_pids()


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ("%sky run no_such_script.py", "no such script: no_such_script.py (looked in "),
        ("%sky run {empty}", "empty is a directory without a __main__.py: give the script"),
        ("%sky run {bad}", "bad.py, line 2: SyntaxError: "),
    ],
)
def test_sky_run_bad_input_is_one_line(kernel: Kernel, project: Path, line: str, says: str) -> None:
    (project / "bad.py").write_text("print('fine')\ndef broken(:\n")
    (project / "empty").mkdir(exist_ok=True)
    cell = kernel.fails(line.format(bad=project / "bad.py", empty=project / "empty"))
    assert cell.reply["ename"] == "UsageError", str(cell)
    assert says in cell.reply["evalue"] and "\n" not in cell.reply["evalue"], str(cell)
    kernel.register_pool_pids()


def test_sky_run_of_a_directory_runs_its_main_as_python_does(
    kernel: Kernel, tmp_path: Path
) -> None:
    app = tmp_path / "app"
    app.mkdir()
    write(app, "__main__.py", "import sys\nprint('main of', __file__, sys.argv, sys.path[0])")
    cell = kernel.ok(f"%sky run {app} --flag")
    assert f"main of {app / '__main__.py'} ['{app}', '--flag'] {app}" in cell.stdout, str(cell)
    kernel.register_pool_pids()


HEAD_INTERLEAVED = """\
import sys
import torch.distributed as dist

if dist.get_rank() == 0:
    for i in range(5):
        print("step", i)  # a plain print: no flush
        print("warning", i, file=sys.stderr)
"""


def test_the_heads_stdout_and_stderr_keep_their_order_in_the_notebook(
    kernel: Kernel, tmp_path: Path
) -> None:
    script = write(tmp_path, "interleaved.py", HEAD_INTERLEAVED)
    expected = [
        line
        for i in range(5)
        for line in (("stdout", f"step {i}"), ("stderr", f"[rank 0 stderr] warning {i}"))
    ]
    for run in (f"%sky run --nodes 2 {script}", f"%%sky --nodes 2\n{HEAD_INTERLEAVED}"):
        cell = kernel.ok(run)
        shown = [
            (m["content"]["name"], line)
            for m in cell.messages
            if m["msg_type"] == "stream"
            for line in m["content"]["text"].splitlines()
            if re.fullmatch(r"(\[rank 0 stderr\] )?(step|warning) \d", line)
        ]
        assert shown == expected, run
    kernel.register_pool_pids()


def test_sky_run_interrupt(kernel: Kernel, tmp_path: Path) -> None:
    # Past the barrier, rank 1 too is a print away from its sleep when rank 0 says it started.
    script = write(
        tmp_path,
        "long.py",
        "import time, torch.distributed as dist\ndist.init_process_group('gloo')\n"
        "dist.barrier()\nprint('started', flush=True)\ntime.sleep(60)\n",
    )
    cell, _ = kernel.interrupted(f"%sky run --nodes 2 {script}", when="started")
    assert cell.reply["ename"] == "CellInterrupted", str(cell)
    assert cell.errors[0]["traceback"][1:] == [
        "rank 0: stopped at long.py line 5: time.sleep(60)",
        "rank 1: stopped at long.py line 5: time.sleep(60)",
    ], str(cell)
    cell = kernel.ok(f"%%sky --all\n{ALL_REDUCE}")
    assert cell.per_rank == {0: "3.0", 1: "3.0"}, str(cell)
    kernel.register_pool_pids()


def test_a_group_the_code_formed_again_is_left_as_fast_as_the_pools() -> None:
    """A script destroys the pool's group and forms its own, then rank 1 fails while rank 0
    waits in that group's all_reduce (ignoring SIGINT, with a long grace before the kill). A
    DDP model holds the group, so destroying it closes nothing: only shutting down the sockets
    of *that* group on the failed rank frees rank 0 at once.
    """
    with Pool(nodes=2, interrupt_grace=30.0) as pool:
        pool.run(
            "import signal\nagent_sigint = signal.signal(signal.SIGINT, lambda *_: None)"
        ).raise_for_errors()
        started = time.monotonic()
        result = pool.run(
            "import torch, torch.distributed as dist\n"
            "dist.destroy_process_group()\n"
            "dist.init_process_group('gloo')\n"
            "held = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))\n"
            "if dist.get_rank() == 1:\n"
            "    raise ValueError('bad batch on rank 1')\n"
            "dist.all_reduce(torch.ones(1))\n"
        )
        took = time.monotonic() - started
        assert not [n for n in result.notes if "killed" in n], (
            f"rank 0 stayed in the collective until it was killed ({took:.0f} s): {result.notes}"
        )
        assert took < 15, f"the cell took {took:.0f} s to end"
        assert CellError(result.errors).primary.rank == 1
        pool.run("signal.signal(signal.SIGINT, agent_sigint)").raise_for_errors()
        assert pool.run(ALL_REDUCE, timeout=20).raise_for_errors().values == [3.0, 3.0]


def test_ranks_sharing_a_machine_get_one_thread_each_whatever_the_notebook_has(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    with Pool(nodes=2) as pool:
        values = pool.run(
            "import os, torch\n(os.environ.get('OMP_NUM_THREADS'), torch.get_num_threads())"
        ).values
    assert values == [("1", 1)] * 2

"""``%%sky`` and ``%sky`` through real Jupyter kernels (jupyter_client, the venv's ``python3``).

Most tests share one kernel (and, where they leave it as they found it, its 2-rank pool); the
tests that end a kernel (shutdown, restart, SIGKILL) each get their own. Rank processes that the
shared kernel keeps warm between tests are registered with conftest's ``_module_pool_pids``, so
its per-test leak check still catches anything else left running; a test that leaves the shared
pool's process group broken errors in teardown, and the pool is restarted for the next test.


"""

from __future__ import annotations

import ast
import asyncio
import base64
import contextlib
import os
import re
import shutil
import signal
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from jupyter_client.blocking.client import BlockingKernelClient
from jupyter_client.manager import KernelManager

from skyward_jupyter import capture, checked_source
from skyward_jupyter.capture import Shipper
from skyward_jupyter.events import PoolMessage, RankState
from skyward_jupyter.magics import _HANDLERS
from skyward_jupyter.options import COMMANDS, unknown_option
from skyward_jupyter.pool import Pool
from skyward_jupyter.ranks import Ranks
from skyward_jupyter.results import PoolError, RanksRestarted
from skyward_jupyter.session import PoolSpec, Session

from .conftest import (
    TEMPLATE,
    _module_pool_pids,
    agent_pids,
    outputs_of,
    reply_of,
    skip_where_nccl_runs,
    wait_for,
)

ROOT = Path(__file__).resolve().parents[1]
HEALTH = "%%sky --all\nimport torch.distributed as dist\ndist.is_initialized()"
CELL_TIMEOUT = 90.0  # a pool start on a loaded 2-core machine included
GONE_TIMEOUT = 20.0

# ------------------------------------------------------------------------------ kernel helper


@dataclass
class Cell:
    """What one executed cell produced: its iopub messages (parent = this cell) and its reply."""

    code: str
    msg_id: str
    reply: dict[str, Any]
    messages: list[dict[str, Any]] = field(default_factory=list)

    @property
    def status(self) -> str:
        return str(self.reply["status"])

    def stream(self, name: str) -> str:
        return "".join(
            m["content"]["text"]
            for m in self.messages
            if m["msg_type"] == "stream" and m["content"]["name"] == name
        )

    @property
    def stdout(self) -> str:
        return self.stream("stdout")

    @property
    def stderr(self) -> str:
        return self.stream("stderr")

    @property
    def shown(self) -> list[str]:
        """text/plain of every execute_result and display_data, in order (not the pool panel)."""
        return [
            m["content"]["data"].get("text/plain", "")
            for m in self.messages
            if m["msg_type"] in ("execute_result", "display_data")
            and "skyward_jupyter" not in m["content"].get("metadata", {})
        ]

    @property
    def per_rank(self) -> dict[int, str]:
        """What ``--all`` shows: ``[rank k] value`` lines (in the cell's result or its stdout)."""
        return rank_lines("\n".join([*self.shown, self.stdout]))

    @property
    def status_line(self) -> list[str]:
        """What the one start-up line said, in turn (its display, then each update)."""
        return [
            m["content"]["data"]["text/plain"]
            for m in self.messages
            if m["msg_type"] in ("display_data", "update_display_data")
            and "status" in m["content"].get("metadata", {}).get("skyward_jupyter", {})
        ]

    @property
    def errors(self) -> list[dict[str, Any]]:
        return [m["content"] for m in self.messages if m["msg_type"] == "error"]

    @property
    def page(self) -> str:
        """What ``?`` shows (a pager payload of the execute_reply)."""
        return "".join(p["data"]["text/plain"] for p in self.reply.get("payload", []))

    def __str__(self) -> str:
        summary = [(m["msg_type"], m["content"]) for m in self.messages]
        return f"cell {self.code!r}: {self.status} {self.reply.get('evalue', '')!r}\n{summary}"


def _text_of(msg: dict[str, Any]) -> str:
    """The text a stream or a display message shows."""
    if msg["msg_type"] == "stream":
        return str(msg["content"]["text"])
    if msg["msg_type"] in ("display_data", "update_display_data"):
        return str(msg["content"]["data"].get("text/plain", ""))
    return ""


def _ppid(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])


def live_agents() -> set[int]:
    """Ranks and templates of this test session that are running now."""
    return agent_pids() | agent_pids(TEMPLATE)


class Kernel:
    """A real ipykernel started from the venv's python, and a blocking client to it."""

    def __init__(self, cwd: Path | None = None) -> None:
        # IPC sockets in a private directory: a TCP port the client picked free could be taken
        # by another test's process before the kernel binds it ("Address already in use").
        self.sockets = tempfile.mkdtemp(prefix="skyward-kernel-", dir="/tmp")  # a short path
        # Gone with this object, or at exit, also for a kernel a test ends without close().
        self._remove_sockets = weakref.finalize(self, shutil.rmtree, self.sockets, True)
        self.km = KernelManager(
            kernel_name="python3", transport="ipc", ip=os.path.join(self.sockets, "kernel")
        )
        self.km.start_kernel(cwd=str(cwd or ROOT))
        self.kc: BlockingKernelClient = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=60)
        self.iopub: list[dict[str, Any]] = []  # every iopub message seen, in arrival order
        self.registered: set[int] = set()

    @property
    def pid(self) -> int:
        pid = self.km.provisioner.pid  # type: ignore[union-attr]
        assert isinstance(pid, int)
        return pid

    def execute(
        self,
        code: str,
        timeout: float = CELL_TIMEOUT,
        on_message: Callable[[dict[str, Any]], None] | None = None,
        silent: bool = False,
    ) -> Cell:
        """Run ``code``; collect its iopub messages until the kernel is idle for it."""
        msg_id = self.kc.execute(code, silent=silent, allow_stdin=False)
        deadline = time.monotonic() + timeout
        what = f"cell {code!r}"
        mine: list[dict[str, Any]] = []
        for msg in outputs_of(self.kc, msg_id, deadline, what, seen=self.iopub.append):
            mine.append(msg)
            if on_message is not None:
                on_message(msg)
        return Cell(code, msg_id, reply_of(self.kc, msg_id, deadline, what), mine)

    def acting(
        self, code: str, when: str, action: Callable[[], None], timeout: float = 40
    ) -> tuple[Cell, float]:
        """Run ``code``, call ``action`` once its output shows ``when``; return the cell and
        how long it took to end after the action.
        """
        sent: list[float] = []

        def act_once(msg: dict[str, Any]) -> None:
            if not sent and when in _text_of(msg):
                sent.append(time.monotonic())
                action()

        cell = self.execute(code, timeout=timeout, on_message=act_once)
        assert sent, f"{when!r} never arrived while the cell ran: {cell}"
        return cell, time.monotonic() - sent[0]

    def interrupted(self, code: str, when: str, timeout: float = 40) -> tuple[Cell, float]:
        """Run ``code``, interrupt the kernel once its output shows ``when``; return the cell
        and how long it took to end after the interrupt.
        """
        try:
            return self.acting(code, when, self.km.interrupt_kernel, timeout)
        except AssertionError:
            for _ in range(2):  # leave the kernel usable for the tests after this one
                self.km.interrupt_kernel()
            self.execute("pass", timeout=30)
            raise

    def ensure_healthy(self) -> str | None:
        """If the current pool's process group is broken, restart the pool and say what was seen.

        Keeps one test's broken pool from failing the tests after it.
        """
        if self.status().strip() == "no pools":
            return None
        cell = self.execute(HEALTH)
        if cell.status == "ok" and set(cell.per_rank.values()) == {"True"}:
            return None
        self.ok("%sky restart")
        return f"the pool's process group was broken (restarted it): {cell}"

    def ok(self, code: str, **kw: Any) -> Cell:
        cell = self.execute(code, **kw)
        assert cell.status == "ok", str(cell)
        assert not cell.errors, str(cell)
        return cell

    def fails(self, code: str, **kw: Any) -> Cell:
        cell = self.execute(code, **kw)
        assert cell.status == "error", str(cell)
        return cell

    def eval(self, expression: str) -> Any:
        """The value of a plain (notebook-side) expression, read back from its repr."""
        cell = self.ok(expression)
        assert len(cell.shown) == 1, str(cell)
        return ast.literal_eval(cell.shown[0])

    def status(self) -> str:
        return self.ok("%sky status").stdout

    def pool_pids(self) -> list[int]:
        """The pids of every rank of every pool, as ``%sky status`` lists them."""
        return [int(p) for p in re.findall(r"local pid (\d+)", self.status())]

    def started_processes(self) -> set[int]:
        """Ranks and templates descended from this kernel's process."""
        found = set()
        for pid in live_agents():
            parent = _ppid(pid)
            for _ in range(4):
                if parent is None or parent <= 1:
                    break
                if parent == self.pid:
                    found.add(pid)
                    break
                parent = _ppid(parent)
        return found

    def register_pool_pids(self) -> None:
        """Tell conftest's leak check that this kernel's current pools may outlive the test."""
        current = set(self.pool_pids())
        _module_pool_pids.difference_update(self.registered)
        _module_pool_pids.update(current)
        self.registered = current

    def close(self) -> None:
        """Shut the kernel down (if it still runs) and wait until its ranks and template ended."""
        spawned = self.started_processes() | self.registered
        with contextlib.suppress(Exception):
            self.km.shutdown_kernel(now=not self.km.is_alive())
        self.kc.stop_channels()
        try:
            wait_for(
                lambda: not (spawned & live_agents()),
                GONE_TIMEOUT,
                "the kernel's rank and template processes to end",
            )
        finally:
            _module_pool_pids.difference_update(self.registered)
            self.registered.clear()
            self._remove_sockets()


def normalised(status: str) -> str:
    return re.sub(r"up \d+ s", "up _ s", status)


def rank_lines(text: str) -> dict[int, str]:
    """``[rank k] value`` lines (what ``--all`` prints) as {k: value}."""
    return {int(k): v for k, v in re.findall(r"^\[rank (\d+)\] (.*)$", text, re.M)}


# ------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def shared_kernel() -> Iterator[Kernel]:
    kernel = Kernel()
    try:
        kernel.ok("%load_ext skyward_jupyter")
        yield kernel
    finally:
        kernel.close()


@pytest.fixture
def nb(shared_kernel: Kernel) -> Iterator[Kernel]:
    """The shared kernel; what it keeps warm after the test is registered for the leak check.

    A test that leaves the pool's process group broken errors here (and the pool is restarted
    for the next test): every cell after a failure is promised a working group.
    """
    yield shared_kernel
    problem = shared_kernel.ensure_healthy()
    shared_kernel.register_pool_pids()
    if problem:
        pytest.fail(problem)


@pytest.fixture
def own_kernel() -> Iterator[Kernel]:
    kernel = Kernel()
    try:
        yield kernel
    finally:
        kernel.close()


def test_a_local_pool_larger_than_the_memory_available_is_refused_before_any_rank(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With 8 GiB available, 1000 local ranks (32 GiB at start) are refused in one line that
    says how many fit; 16 ranks always start. The machine's own memory decides nothing here.
    """
    from skyward_jupyter.providers import local

    monkeypatch.setattr(local, "meminfo", lambda field: 8 << 30)
    with pytest.raises(local.ProviderError) as refused:
        local._check_fits(1000)
    assert str(refused.value) == (
        "1000 local ranks would need about 31 GiB of memory (32 MiB a rank at start); this "
        "machine has 8.0 GiB available, room for 256 ranks: ask for fewer --nodes or "
        "--procs-per-node"
    )
    local._check_fits(256)
    monkeypatch.setattr(local, "meminfo", lambda field: 1 << 20)
    local._check_fits(16)


POOL2 = "%%sky --nodes 2\npass"  # the shared 2-rank pool: reused when it is already there

# ------------------------------------------------------------------------------ 1. options

BAD_OPTIONS = [
    ("--nodes 0", "must be from 1 to 1024 (MAX_RANKS"),
    ("--nodes 100000", "must be from 1 to 1024 (MAX_RANKS, the most a pool may have), got 100000"),
    ("--nodes 100 --procs-per-node 100", "10000 ranks; a pool has at most 1024"),
    ("--heartbeat-timeout nan", "--heartbeat-timeout: expected a finite number of seconds"),
    ("--heartbeat-timeout 0.5", "must be from 2 to 3600 seconds"),
    ("--desync-after inf", "--desync-after: expected a finite number of seconds, got inf"),
    ("--sync-cap nan", "--sync-cap: expected a finite number of MB, got nan"),
    ("--sync-cap inf", "--sync-cap: expected a finite number of MB, got inf"),
    ("--sync-cap 1e300", "must be more than 0 to 1.04858e+06 MB"),
    ("--sync /no/such/dir", "--sync: no such directory: /no/such/dir"),
    ("--timeout nan", "--timeout: expected a finite number of seconds, got nan"),
    ("--timeout -5", "--timeout: must be more than 0 to"),
    ("--idle-timeout inf", "--idle-timeout: expected a finite number of minutes"),
    ("--nodes x", "expected a whole number"),
    ("--provider nope", "unknown provider 'nope'; known: local, aws, ray, slurm, ssh"),
    ("--gpu 'H100;x'", "expected a GPU model (H100, NVIDIA H200, RTX 4090, ...) or none"),
    ("--gpu NOPE", "--gpu NOPE: this machine"),
    ("--env FOO", "expected KEY=VALUE"),
    ("--env RANK=5", "--env RANK: the pool sets RANK on each rank itself"),
    ("--env A=1 --env MASTER_PORT=1", "--env MASTER_PORT: the pool sets MASTER_PORT"),
    ("--provider ssh", "needs --hosts"),
    ("--hosts alice@gpu1:99999", "bad port"),
    ("--provider aws --ssh-cidr 0.0.0.0/0", "refusing to open SSH to the whole internet"),
    ("--provider aws --idle-timeout -1", "must be from 0 to 43200 minutes"),
    ("--gpus-per-node 1", "--gpus-per-node: an option of the ray, slurm providers; name one"),
    ("--provider slurm --gpus-per-node 65", "--gpus-per-node: must be from 0 to 64 GPUs, got 65"),
    ("--ray-address a:1 --partition p", "--partition is slurm's): give one provider's only"),
    ("--provider aws --hosts me@gpu1", "--provider aws does not take --hosts (--hosts is ssh's)"),
    ("--secure --backend nccl", "--secure carries gloo's traffic only"),
    ("--secure --framework jax", "--secure covers torch's gloo traffic only"),
    ("--ranks x", "--ranks: expected ranks such as 0, 0,2 or 0,2-3, got 'x'"),
    ("--ranks 0,3-1", "--ranks: 3-1: a range goes up, as in 1-3"),
    ("--ranks 5000", "no pool has rank 5000: a pool has at most 1024 ranks"),
    ('"unterminated', '%%sky: No closing quotation in its options: "unterminated'),
    ("--out def", "--out: expected a variable name, got 'def'"),
    ("--out print", "--out: 'print' is Python's builtin print, which the result would hide"),
    ("--rank 0", "unknown option --rank; did you mean --ranks?"),
    ("--head --ranks 1", "--head is --ranks 0; give one of them"),
]


def _check_bad_options(nb: Kernel) -> None:
    before = normalised(nb.status())
    ranks_before = agent_pids()
    for option, fragment in BAD_OPTIONS:
        cell = nb.fails(f"%%sky {option}\nprint('THE CELL RAN')")
        assert cell.reply["ename"] == "UsageError", str(cell)
        evalue = cell.reply["evalue"]
        assert fragment in evalue, str(cell)
        assert "\n" not in evalue.strip(), f"not one line: {evalue!r}"
        assert cell.stderr == f"UsageError: {evalue}\n", str(cell)
        assert "THE CELL RAN" not in cell.stdout
        assert not cell.errors, "a usage error shows no traceback"
        assert normalised(nb.status()) == before, f"{option} changed the pools"
        assert agent_pids() == ranks_before, f"{option} started or ended rank processes"


def test_bad_options_are_one_line_usage_errors_that_change_nothing(nb: Kernel) -> None:
    nb.ok("%sky down --all")
    assert nb.status().strip() == "no pools"
    _check_bad_options(nb)  # with no pool: none is started
    assert nb.status().strip() == "no pools"

    nb.ok(POOL2)
    assert len(nb.pool_pids()) == 2
    _check_bad_options(nb)  # with a pool: it is neither replaced nor restarted


def test_the_last_env_value_of_a_variable_wins(nb: Kernel) -> None:
    cell = nb.ok(
        "%%sky --name env --nodes 1 --env B=3 --env B=2 --env C=ü\nimport os\nos.environ['B']"
    )
    assert cell.shown == ["'2'"], str(cell)
    nb.ok("%sky down env")


def test_line_commands_check_numbers_before_touching_the_pool(nb: Kernel, tmp_path: Path) -> None:
    nb.ok(POOL2)
    before, ranks_before = normalised(nb.status()), agent_pids()
    script = tmp_path / "train.py"
    script.write_text("print('THE SCRIPT RAN')\n")
    for line, fragment in [
        ("%sky up --nodes 100000", "got 100000"),
        ('%sky up --name "x', "%sky: No closing quotation in its options"),
        ("%sky down default --all", "give a pool's name, or --all for every pool"),
        ("%sky pull class", "expected a variable name, got 'class'"),
        ("%sky config --heartbeat-timeout nan", "finite number of seconds, got nan"),
        ("%sky config --sync-cap inf", "finite number of MB, got inf"),
        ("%sky config --timeout 5", "--timeout: it is a %%sky cell's own option"),
        (f"%sky run --timeout nan {script}", "--timeout: expected a finite number"),
        (f"%sky run --nodes 2 --procs-per-node 1000 {script}", "2000 ranks"),
    ]:
        cell = nb.fails(line)
        assert cell.reply["ename"] == "UsageError", str(cell)
        assert fragment in cell.reply["evalue"], str(cell)
        assert "THE SCRIPT RAN" not in cell.stdout
        assert normalised(nb.status()) == before, f"{line} changed the pools"
        assert agent_pids() == ranks_before, f"{line} started or ended rank processes"
    nb.ok("%%sky --nodes 2\npass")  # the defaults were left as they were


def test_a_starting_pool_stops_at_once_on_interrupt(nb: Kernel) -> None:
    """Ctrl-C while many ranks start ends the start there (the pool did not start: it did
    not run to its end first) and leaves no rank behind; the name keeps the description until
    ``%sky down`` forgets it.
    """
    nb.ok("%sky down --all")
    before = agent_pids()
    cell, _ = nb.interrupted("%%sky --nodes 12 --name many\npass", when="starting")
    assert cell.reply.get("ename") == "WaitInterrupted", str(cell)
    said = "KeyboardInterrupt: pool 'many' was not started: stopped at the interrupt"
    assert [line for line in cell.reply["traceback"] if line.strip()] == [
        said + ", and nothing of it is left running"
    ], str(cell)  # one line, not the notebook's frames
    status = nb.status()
    assert re.fullmatch(r"\* many: 12 nodes x .*, did not start \(.*\)\n", status), status
    nb.ok("%sky down many")
    assert nb.status().strip() == "no pools"
    wait_for(lambda: agent_pids() <= before, GONE_TIMEOUT, "the interrupted start's ranks to end")


def test_one_table_runs_every_command() -> None:
    """Each command of the table that builds the parsers and the help has its one handler."""
    assert set(_HANDLERS) == {c.name for c in COMMANDS}


def test_help_documents_every_option(nb: Kernel) -> None:
    options = [
        "--nodes",
        "--procs-per-node",
        "--provider",
        "--gpu",
        "--name",
        "--backend",
        "--env",
        "--stdout",
        "--all",
        "--out",
        "--timeout",
        "--ranks",
        "--head",
    ]
    for code in ("%%sky?", "get_ipython().run_line_magic('pinfo', 'sky')"):
        page = nb.ok(code).page
        missing = [o for o in options if not re.search(rf"{o}\b", page)]
        assert not missing, f"{code} does not document {missing}:\n{page}"
        for command in ("up", "down", "status", "restart", "pull", "push", "config"):
            assert f"%sky {command}" in page
        # Grouped as people choose: the pool, the cell's output, then each provider's own (an
        # option providers share under all their names).
        headings = re.findall(r"^(\w[\w ,]*) options:$", page, re.M)
        assert headings[:2] == ["pool", "output"], headings
        providers = {"aws provider", "slurm provider", "ray provider", "ssh provider"}
        assert providers | {"ray, slurm provider"} <= set(headings), headings
        ssh = page.split("\nssh provider options:")[1].split("\n\n")[0]
        assert "--hosts" in ssh and "--spot" not in ssh and "--partition" not in ssh
        shared = page.split("\nray, slurm provider options:")[1].split("\n\n")[0]
        assert shared.count("--gpus-per-node") == 1 and "GPUs to ask for on each node" in shared
        assert "ray: " not in shared and "slurm: " not in shared  # one help, declared once
        examples = page.split("examples:\n")[1].split("\n\n")[0].splitlines()
        lines = [e for e in examples if e.startswith("  %%sky ")]
        assert len(lines) == 3 and all(e.startswith(" ") for e in examples), examples


UNKNOWN_OPTIONS = [
    # each of these was once expanded (--gpus to Slurm's --gpus-per-node) or silently taken
    ("%%sky --gpus 1", "%%sky: unknown option --gpus; did you mean --gpu or --gpus-per-node?"),
    ("%%sky --node 2", "%%sky: unknown option --node; did you mean --nodes?"),
    ("%%sky --proc 2", "%%sky: unknown option --proc; did you mean --procs-per-node?"),
    ("%%sky --nodes 2 --std all", "%%sky: unknown option --std; did you mean --stdout?"),
    (
        "%%sky --nproc-per-node 2",
        "%%sky: unknown option --nproc-per-node: that is torchrun's spelling; here it is "
        "--procs-per-node",
    ),
    ("%%sky --nproc_per_node=2", "here it is --procs-per-node"),
    (
        "%%sky --nnodes 2",
        "%%sky: unknown option --nnodes: that is torchrun's spelling; here it is --nodes",
    ),
    ("%%sky --node-rank 0", "the pool numbers its nodes itself"),
    ("%sky run --gpus 1 {script}", "%sky run: unknown option --gpus; did you mean --gpu"),
    ("%sky run --node 2 {script}", "%sky run: unknown option --node; did you mean --nodes?"),
    ("%sky run --nproc-per-node 2 {script}", "here it is --procs-per-node"),
    ("%sky up --node 2", "%sky up: unknown option --node; did you mean --nodes?"),
    ("%sky config --node 2", "%sky config: unknown option --node; did you mean --nodes?"),
    ("%sky down --al", "%sky down: unknown option --al; did you mean --all?"),
    ("%sky restart --hard", "%sky restart: unknown option --hard"),
    ("%sky stat", "%sky: unknown command 'stat'; did you mean status?"),
]


def test_no_abbreviation_expands_and_near_misses_are_named(nb: Kernel, tmp_path: Path) -> None:
    """An option is taken only as written: an abbreviation or torchrun's spelling is refused in
    one line naming what was meant, and neither the pools nor the defaults change.
    """
    nb.ok(POOL2)
    before, ranks_before = normalised(nb.status()), agent_pids()
    script = tmp_path / "train.py"
    script.write_text("print('THE SCRIPT RAN')\n")
    for line, message in UNKNOWN_OPTIONS:
        code = line.format(script=script) + ("\nprint('THE CELL RAN')" if line[1] == "%" else "")
        cell = nb.fails(code)
        assert cell.reply["ename"] == "UsageError", str(cell)
        evalue = cell.reply["evalue"]
        assert message in evalue, str(cell)
        assert "\n" not in evalue.strip(), f"not one line: {evalue!r}"
        assert "THE CELL RAN" not in cell.stdout, str(cell)
        assert "THE SCRIPT RAN" not in cell.stdout, str(cell)
        assert normalised(nb.status()) == before, f"{line} changed the pools"
        assert agent_pids() == ranks_before, f"{line} started or ended rank processes"
    cell = nb.ok("%%sky --all\nimport torch.distributed as dist\ndist.get_world_size()")
    assert cell.per_rank == {0: "2", 1: "2"}, "the defaults changed"


def test_help_after_any_command_shows_it_and_runs_nothing(nb: Kernel, tmp_path: Path) -> None:
    """``-h``/``--help`` among a command's own options prints its help and nothing else runs:
    not the cell, not a new pool, not a shutdown or restart. After ``%sky run``'s script, the
    option is the script's (as torchrun passes it).
    """
    nb.ok(POOL2)
    before, ranks_before = normalised(nb.status()), agent_pids()
    script = tmp_path / "train.py"
    script.write_text("import sys\nprint('THE SCRIPT GOT', sys.argv[1:])\n")
    cases = [
        ("%%sky -h\nprint('THE CELL RAN')", "usage: %%sky [-h] [--nodes NODES]"),
        ("%%sky --nodes 3 --help\nprint('THE CELL RAN')", "usage: %%sky [-h]"),
        ("%sky --help", "Line magic (%sky COMMAND --help"),
        ("%sky -h", "usage: %%sky [-h]"),
        ("%sky run --help", "usage: %sky run [-h]"),
        (f"%sky run --nodes 3 -h {script}", "the script's arguments: all that follows SCRIPT"),
    ]
    cases += [(f"%sky {c.name} --help", f"usage: %sky {c.name} [-h]") for c in COMMANDS]
    for code, shown in cases:
        cell = nb.ok(code)
        assert shown in cell.stdout, str(cell)
        assert "THE CELL RAN" not in cell.stdout, str(cell)
        assert "THE SCRIPT GOT" not in cell.stdout, str(cell)
        assert normalised(nb.status()) == before, f"{code} changed the pools"
        assert agent_pids() == ranks_before, f"{code} started or ended rank processes"
    missing = nb.fails("%sky run --nodes 2")  # not "ARGS is required": ARGS may be empty
    assert (
        missing.reply["evalue"]
        == "%sky run: which script? %sky run [pool options] SCRIPT [ARGS ...]"
    )
    cell = nb.ok(f"%sky run {script} --help -h")
    assert "THE SCRIPT GOT ['--help', '-h']" in cell.stdout, str(cell)
    assert "usage:" not in cell.stdout, str(cell)


def test_nccl_without_nccl_or_gpus_is_refused_naming_why_before_the_pool_changes(
    nb: Kernel, tmp_path: Path
) -> None:
    """The cause, not advice about interfaces; and the working pool stays, so the next cell
    without options still runs on both of its ranks.
    """
    skip_where_nccl_runs()
    nb.ok(POOL2)
    before, ranks_before = normalised(nb.status()), agent_pids()
    script = tmp_path / "train.py"
    script.write_text("print('THE SCRIPT RAN')\n")
    for code in (
        "%%sky --nodes 2 --backend nccl\nprint('THE CELL RAN')",
        f"%sky run --nodes=2 --backend nccl {script}",
        "%sky up --backend nccl --name other",
    ):
        cell = nb.fails(code)
        assert cell.reply["ename"] == "UsageError", str(cell)
        evalue = cell.reply["evalue"]
        assert re.search(r"--backend nccl: this machine .* (built without NCCL|no GPU)", evalue)
        assert "use --backend gloo" in evalue and "SOCKET_IFNAME" not in evalue, evalue
        assert "THE CELL RAN" not in cell.stdout, str(cell)
        assert "THE SCRIPT RAN" not in cell.stdout, str(cell)
        assert normalised(nb.status()) == before, f"{code} changed the pools"
        assert agent_pids() == ranks_before, f"{code} started or ended rank processes"
    cell = nb.ok("%%sky --all\nimport torch.distributed as dist\ndist.get_world_size()")
    assert cell.per_rank == {0: "2", 1: "2"}


def test_a_count_of_one_is_singular(nb: Kernel) -> None:
    cell = nb.ok("%%sky --procs-per-node 1 --name solo\npass")
    try:
        # One line, not on stderr: "starting ..." turns into "ready in" in place.
        starting, ready = cell.status_line
        assert starting.startswith("pool 'solo': starting 1 node x 1 rank, "), str(cell)
        assert re.match(r"pool 'solo': 1 rank ready in \d", ready), str(cell)
        assert "pool 'solo'" not in cell.stderr, str(cell)
        restarted = nb.ok("%sky restart solo")
        assert re.search(r"pool 'solo': 1 fresh rank in \d", restarted.stderr), str(restarted)
    finally:
        nb.ok("%sky down solo")


# ------------------------------------------------------------------------------ 2. keep-alive


def test_two_cells_with_the_same_options_reuse_the_warm_pool(nb: Kernel) -> None:
    nb.ok("%%sky --nodes 2 --out first_pids\nimport os\nos.getpid()")
    first = nb.eval("first_pids.values")
    assert len(first) == 2 and len(set(first)) == 2

    cell = nb.ok("%%sky --nodes 2 --all\nimport os\nos.getpid()")
    assert cell.per_rank == {0: str(first[0]), 1: str(first[1])}
    assert "starting" not in cell.stderr and "replacing" not in cell.stderr

    nb.ok("%%sky --out plain_pids\nimport os\nos.getpid()")  # no options: the current pool
    assert nb.eval("plain_pids.values") == first
    assert sorted(nb.pool_pids()) == sorted(first)


# ------------------------------------------------------------------------------ 3. capture


def test_globals_read_inside_functions_and_lambdas_are_shipped(nb: Kernel) -> None:
    nb.ok(POOL2)
    nb.ok("IN_FUNCTION = 7\nIN_LAMBDA = 8")
    cell = nb.ok(
        "%%sky --all\n"
        "def uses_global():\n"
        "    return IN_FUNCTION\n"
        "reads_global = lambda: IN_LAMBDA + 1\n"
        "(uses_global(), reads_global())"
    )
    assert cell.per_rank == {0: "(7, 9)", 1: "(7, 9)"}, str(cell)


def test_an_unchanged_array_is_not_sent_again_and_a_changed_one_is(nb: Kernel) -> None:
    nb.ok(POOL2)
    nb.ok("import numpy as np\nbig = np.arange(100_000, dtype=np.float64)")
    nbytes = 800_000

    nb.ok("%%sky --out ship1\nfloat(big.sum())")
    assert nb.eval("ship1.shipped_bytes") > nbytes
    assert nb.eval("ship1.values") == [4999950000.0, 4999950000.0]

    nb.ok("%%sky --out ship2\nfloat(big.sum())")
    assert nb.eval("ship2.shipped_bytes") == 0
    assert nb.eval("ship2.values") == [4999950000.0, 4999950000.0]

    nb.ok("big[0] = 1000.0")
    nb.ok("%%sky --out ship3\nfloat(big.sum())")
    assert nb.eval("ship3.shipped_bytes") > nbytes
    assert nb.eval("ship3.values") == [4999951000.0, 4999951000.0]


def test_in_place_edits_of_large_globals_reach_the_ranks(nb: Kernel) -> None:
    """Past the size where an unchanged array is recognised without reading it again: one
    element edited in place (through the array, through a slice of it, in a torch tensor).
    """
    nb.ok(POOL2)
    nb.ok(
        "import numpy as np, torch\nbig = np.zeros(1 << 18)\npart = big[1000:200_000]\n"
        "t = torch.zeros(1 << 18)"
    )
    cell = "%%sky --out seen\n(float(big.sum()), float(part.sum()), float(t.sum()))"
    nb.ok(cell)
    nb.ok(cell)
    assert nb.eval("seen.shipped_bytes") < (1 << 20)  # the arrays were not sent again
    for edit, sums in [
        ("big[-1] = 4.0", (4.0, 0.0, 0.0)),  # on a page it shares with other memory
        ("big[5000] = 1.0", (5.0, 1.0, 0.0)),
        ("part[0] = 2.0", (7.0, 3.0, 0.0)),
        ("t[7] = 5.0", (7.0, 3.0, 5.0)),
    ]:
        nb.ok(edit)
        nb.ok(cell)
        assert nb.eval("seen.values") == [sums, sums], edit


def test_a_name_bound_by_a_sky_cell_stays_remote(nb: Kernel) -> None:
    nb.ok(POOL2)
    nb.ok("%%sky\nwhere_bound = 'remote'")
    nb.ok("where_bound = 'local'")
    cell = nb.ok("%%sky --all\nwhere_bound")
    assert cell.per_rank == {0: "'remote'", 1: "'remote'"}, str(cell)
    assert nb.eval("where_bound") == "local"


def test_a_name_bound_by_a_ranks_cell_stays_remote_on_those_ranks_only(nb: Kernel) -> None:
    """``%%sky --ranks 0`` binds a name on rank 0: the other ranks still get the notebook's
    value of it, and rank 0 keeps its own, until a cell on every rank binds it everywhere.
    """
    nb.ok(POOL2)
    nb.ok("bound_on_some = 'notebook'")
    for then, seen in [
        ("%%sky --ranks 0\nbound_on_some = 'rank 0'", ("'rank 0'", "'notebook'")),
        ("bound_on_some = 'notebook, edited'", ("'rank 0'", "'notebook, edited'")),
        ("%%sky\nbound_on_some = f'every rank {rank}'", ("'every rank 0'", "'every rank 1'")),
    ]:
        nb.ok(then)
        cell = nb.ok("%%sky --all\nbound_on_some")
        assert cell.per_rank == dict(enumerate(seen)), (then, str(cell))


def test_names_the_surviving_ranks_bound_stay_theirs_when_one_is_restarted(nb: Kernel) -> None:
    """Rank 1 dies in a cell and is restarted: what rank 0 bound stays its own, not replaced by
    the notebook's value of the name, and the restarted rank starts without it.
    """
    nb.ok(POOL2)
    nb.ok("kept_by_survivor = 'notebook'")
    nb.ok("%%sky\nkept_by_survivor = f'remote {rank}'")
    died = nb.fails("%%sky\nimport os\nalso_kept = 'bound before'\nif rank == 1:\n    os._exit(3)")
    assert "rank 1 was restarted: its namespace was lost" in str(died), str(died)
    reads = (
        "try:\n    seen = (kept_by_survivor, also_kept)\nexcept NameError as e:\n    seen = e.name"
    )
    cell = nb.ok(f"%%sky --all\n{reads}\nseen")
    assert cell.per_rank == {0: "('remote 0', 'bound before')", 1: "'kept_by_survivor'"}, str(cell)


def test_an_unpicklable_global_fails_the_cell_before_it_runs_naming_it(nb: Kernel) -> None:
    nb.ok(POOL2)
    pids = nb.pool_pids()
    nb.ok("import threading\na_lock = threading.Lock()")
    cell = nb.fails("%%sky\nran_before_lock = True\nprint('THE CELL RAN')\na_lock")
    assert cell.reply["ename"] == "UsageError", str(cell)
    assert "'a_lock'" in cell.reply["evalue"], str(cell)
    assert "THE CELL RAN" not in cell.stdout
    cell = nb.ok("%%sky --all\n'ran_before_lock' in globals()")
    assert cell.per_rank == {0: "False", 1: "False"}, "the cell ran on the ranks"
    assert nb.pool_pids() == pids


def test_a_name_a_failed_cell_never_bound_is_still_shipped(nb: Kernel) -> None:
    nb.ok(POOL2)
    nb.fails("%%sky\nraise ValueError('fails before binding')\nnever_bound = 'remote'")
    nb.ok("never_bound = 'local'")
    cell = nb.execute("%%sky --all\nnever_bound")
    assert cell.status == "ok", cell.reply.get("evalue")
    assert cell.per_rank == {0: "'local'", 1: "'local'"}


def test_a_notebook_function_is_shipped_by_value(nb: Kernel) -> None:
    nb.ok(POOL2)
    nb.ok("FACTOR = 2\ndef scaled(v):\n    return v * FACTOR")
    cell = nb.ok("%%sky --all\nscaled(21)")
    assert cell.per_rank == {0: "42", 1: "42"}, str(cell)
    # Redefined in the notebook: the new definition travels (its bytes changed).
    nb.ok("def scaled(v):\n    return v * FACTOR + 1")
    cell = nb.ok("%%sky --all\nscaled(21)")
    assert cell.per_rank == {0: "43", 1: "43"}, str(cell)


# ------------------------------------------------------------------------------ 4. display


def test_the_heads_last_value_is_the_cells_value(nb: Kernel) -> None:
    nb.ok(POOL2)
    cell = nb.ok(
        "%%sky --nodes 2\n"
        "import torch, torch.distributed as dist\n"
        "t = torch.ones(1) * (dist.get_rank() + 1)\n"
        "dist.all_reduce(t)\n"
        "t.item()"
    )
    assert cell.shown == ["3.0"], str(cell)
    assert cell.stdout == ""


def test_a_cell_is_checked_and_run_as_python_compiles_it(nb: Kernel) -> None:
    """Valid Python that string annotations would reject (a walrus in an annotation) passes the
    notebook's syntax check and runs, with its annotations evaluated, on the ranks.
    """
    nb.ok(POOL2)
    cell = nb.ok("%%sky --nodes 2\ndef f(x: (y := int)) -> None: ...\nf.__annotations__['x'] is y")
    assert cell.shown == ["True"], str(cell)


def test_a_cell_is_compiled_once_on_the_notebook(monkeypatch: pytest.MonkeyPatch) -> None:
    """The session checks a cell before its pool starts, and the pool sends what was checked:
    the notebook compiles the cell once, and not again when it runs again.
    """
    compiled: list[str] = []

    def counting(source: str, filename: str, *args: Any, **kwargs: Any) -> Any:
        compiled.append(filename)
        return compile(source, filename, *args, **kwargs)

    monkeypatch.setattr(checked_source, "compile", counting, raising=False)
    checked_source._compiles.cache_clear()  # (an earlier test may have run the same source)
    session = Session(announce=lambda text: None)
    try:
        for _ in range(2):
            assert session.run_cell("x = 7\nx + 1", {}, spec=PoolSpec(nodes=1)).values == [8]
    finally:
        session.down_all()
    assert compiled == ["<cell>"]


def test_a_syntax_error_in_a_cell_starts_no_pool(nb: Kernel) -> None:
    """Shown as in any cell: at its line, without the frames of the magic's code."""
    cell = nb.fails("%%sky --name never --nodes 1\nprint('fine')\ndef broken(:\n")
    assert cell.reply["ename"] == "SyntaxError", str(cell)
    number = cell.reply["execution_count"]
    assert cell.reply["evalue"] == f"invalid syntax (<In [{number}]>, line 2)", str(cell)
    assert not any("skyward_jupyter" in line for line in cell.reply["traceback"]), str(cell)
    indented = nb.fails("%%sky --name never\n  x = 1\ny = 2")
    assert indented.reply["ename"] == "IndentationError", str(indented)
    assert not any("skyward_jupyter" in line for line in indented.reply["traceback"])
    assert "never" not in nb.status()


def test_all_shows_every_ranks_value(nb: Kernel) -> None:
    nb.ok(POOL2)
    cell = nb.ok("%%sky --all\nimport torch.distributed as dist\ndist.get_rank() * 10")
    shown = "\n".join([*cell.shown, cell.stdout])
    assert shown.split() == ["[rank", "0]", "0", "[rank", "1]", "10"], str(cell)


def _outputs_in_order(cell: Cell) -> list[str]:
    """The cell's stdout (consecutive messages joined), images and HTML, in the order they came."""
    out: list[str] = []
    for m in cell.messages:
        data = m["content"].get("data", {})
        if m["msg_type"] == "stream" and m["content"]["name"] == "stdout":
            if out and not out[-1].startswith(("image:", "html:")):
                out[-1] += m["content"]["text"]
            else:
                out.append(m["content"]["text"])
        elif m["msg_type"] == "display_data" and "image/png" in data:
            png = base64.b64decode(data["image/png"])
            assert png.startswith(b"\x89PNG"), str(cell)
            out.append(f"image: {data['text/plain']}")
        elif m["msg_type"] == "display_data" and "text/html" in data:
            out.append(f"html: {data['text/html']}")
    return out


def test_a_heads_figures_and_displays_show_in_the_cell_and_no_rank_keeps_a_figure(
    nb: Kernel, tmp_path: Path
) -> None:
    """The kernel names Jupyter's inline backend, which the ranks inherit: there it printed each
    figure's text once per rank, and ``display`` (a notebook's builtin) was a NameError.
    ``plt.show()``, a figure left open at the end and ``display`` now show as Jupyter shows
    them, the head's only (its figures are the size it made them), in turn with its prints;
    no rank keeps a figure after a cell, nor after a script.
    """
    nb.ok(POOL2)
    cell = nb.ok(
        "%%sky --nodes 2\n"
        "import matplotlib.pyplot as plt, torch.distributed as dist\n"
        "from IPython.display import HTML\n"
        "rank = dist.get_rank()\n"
        "print('before')\n"
        "plt.figure(figsize=(4 + rank, 3))\n"
        "plt.plot([1, 2, 3], [rank] * 3)\n"
        "plt.show()\n"
        "display(HTML(f'<b>rank {rank}</b>'))\n"
        "print('between')\n"
        "fig, axes = plt.subplots(1, 2, figsize=(2 + rank, 2))\n"
        "axes[0].bar([1], [rank + 1])\n"
    )
    assert _outputs_in_order(cell) == [
        "before\n",
        "image: <Figure size 400x300 with 1 Axes>",
        "html: <b>rank 0</b>",
        "between\n",
        "image: <Figure size 200x200 with 2 Axes>",
    ], str(cell)
    assert "Figure size" not in cell.stderr and "non-interactive" not in cell.stderr, str(cell)
    shown = nb.ok(
        "%%sky\nfrom IPython.display import HTML\n"
        "handle = display(HTML('<i>step 1</i>'), display_id=True)\n"
        "handle.update(HTML('<i>step 2</i>'))\n"
    )
    first, update = (m for m in shown.messages if "text/html" in m["content"].get("data", {}))
    assert (first["msg_type"], update["msg_type"]) == ("display_data", "update_display_data")
    assert update["content"]["data"]["text/html"] == "<i>step 2</i>", str(shown)
    assert first["content"]["transient"] == update["content"]["transient"], str(shown)
    failed = nb.fails("%%sky\nimport matplotlib.pyplot as plt\nplt.plot([1, 2])\n1 / 0")
    assert _outputs_in_order(failed) == [], str(failed)  # drawn, it would race the pool's stop
    script = tmp_path / "plots.py"
    script.write_text(
        "import matplotlib.pyplot as plt\nplt.plot([1, 2])\nplt.savefig('/dev/null')\n"
    )
    nb.ok(f"%sky run --nodes 2 {script}")
    left = nb.ok("%%sky --all\nimport matplotlib.pyplot as plt\nlen(plt.get_fignums())")
    assert left.per_rank == {0: "0", 1: "0"} and _outputs_in_order(left) == [], str(left)


def test_a_cell_without_a_final_expression_displays_nothing(nb: Kernel) -> None:
    nb.ok(POOL2)
    for code in ("%%sky\nno_final_value = 5", "%%sky --all\nno_final_value = 6"):
        cell = nb.ok(code)
        assert cell.shown == [] and cell.stdout == "" and cell.stderr == "", str(cell)


def test_out_stores_a_result_with_one_value_per_rank(nb: Kernel) -> None:
    nb.ok(POOL2)
    cell = nb.ok("%%sky --out stored\nimport torch.distributed as dist\n{'rank': dist.get_rank()}")
    assert cell.shown == ["{'rank': 0}"], str(cell)
    assert nb.eval("stored.values") == [{"rank": 0}, {"rank": 1}]
    assert nb.eval("len(stored)") == 2
    text = nb.eval("repr(stored)")
    assert re.fullmatch(r"<RunResult cell \d+: 2 ranks, ok, \d+ bytes shipped>", text), text


def test_a_notebook_global_wins_over_a_ready_name(nb: Kernel) -> None:
    nb.ok(POOL2)
    cell = nb.ok("%%sky --all\n(rank, local_rank, world_size, device.type)")
    assert cell.per_rank == {0: "(0, 0, 2, 'cpu')", 1: "(1, 0, 2, 'cpu')"} or all(
        "'cuda')" in v for v in cell.per_rank.values()
    ), str(cell)
    nb.ok("local_rank = 'the notebook\\'s'")
    cell = nb.ok("%%sky --all\n(rank, local_rank)")
    assert cell.per_rank == {0: '(0, "the notebook\'s")', 1: '(1, "the notebook\'s")'}, str(cell)
    nb.ok("del local_rank")


def test_a_cell_on_some_ranks_shows_their_output_value_and_errors(nb: Kernel) -> None:
    nb.ok(POOL2)
    nb.ok("%%sky\nstate = rank * 10")
    cell = nb.ok("%%sky --ranks 1 --out on_one\nprint(f'hello from {rank}')\nstate += 1\nstate")
    assert cell.stdout == "hello from 1\n" and cell.shown == ["11"], str(cell)
    assert nb.eval("[(r.rank, r.value) for r in on_one]") == [(1, 11)]
    cell = nb.ok("%%sky --head --all\nstate")
    assert cell.per_rank == {0: "0"}, str(cell)
    cell = nb.ok("%%sky --ranks 0-1 --all\nstate")  # the others kept their state
    assert cell.per_rank == {0: "0", 1: "11"}, str(cell)
    failed = nb.fails("%%sky --ranks 1\nraise ValueError(f'rank {rank} fails')")
    assert failed.reply["ename"] == "CellError", str(failed)
    assert failed.reply["evalue"].startswith("cell failed on rank 1"), str(failed)
    assert "ValueError: rank 1 fails" in failed.reply["evalue"]
    started = time.monotonic()
    stuck = nb.fails("%%sky --head\nimport torch, torch.distributed as dist\ndist.barrier()")
    assert time.monotonic() - started < 20, "the head waited for the collective's timeout"
    number = stuck.reply["execution_count"]
    evalue = stuck.reply["evalue"]
    assert re.match(
        rf"cell failed on rank 0 \(.*\): CollectiveDesync: rank 0 in barrier at "
        rf"In \[{number}\] line 2: only rank 0 runs this cell \(--ranks 0\)",
        evalue,
    ), evalue
    cell = nb.ok("%%sky --all\nimport torch, torch.distributed as dist\ndist.barrier()\nstate")
    assert cell.per_rank == {0: "0", 1: "11"}, str(cell)


def test_ranks_the_pool_lacks_are_a_one_line_error_that_runs_nothing(nb: Kernel) -> None:
    nb.ok(POOL2)
    pids = nb.pool_pids()
    cell = nb.fails("%%sky --ranks 0,2-3\nprint('THE CELL RAN')")
    assert cell.reply["ename"] == "UsageError", str(cell)
    assert re.fullmatch(r"--ranks 2-3: pool '\w+' has ranks 0-1", cell.reply["evalue"]), str(cell)
    assert "THE CELL RAN" not in cell.stdout and nb.pool_pids() == pids


# ------------------------------------------------------------------------------ 5. output


def test_only_the_heads_stdout_shows_by_default(nb: Kernel) -> None:
    nb.ok(POOL2)
    cell = nb.ok("%%sky\nimport torch.distributed as dist\nprint(f'hello from {dist.get_rank()}')")
    assert cell.stdout == "hello from 0\n", str(cell)
    assert "hello from 1" not in cell.stderr


def test_stdout_all_prefixes_every_ranks_lines(nb: Kernel) -> None:
    nb.ok(POOL2)
    cell = nb.ok(
        "%%sky --stdout all\n"
        "import torch.distributed as dist\n"
        "print(f'one {dist.get_rank()}')\n"
        "print(f'two {dist.get_rank()}')"
    )
    lines = cell.stdout.splitlines()
    assert sorted(lines) == sorted(
        ["[rank 0] one 0", "[rank 0] two 0", "[rank 1] one 1", "[rank 1] two 1"]
    ), str(cell)
    assert lines.index("[rank 0] one 0") < lines.index("[rank 0] two 0")
    assert lines.index("[rank 1] one 1") < lines.index("[rank 1] two 1")
    cell = nb.ok("%%sky --stdout none\nimport sys\nprint('quiet')\nprint('loud', file=sys.stderr)")
    assert cell.stdout == "", str(cell)
    assert cell.stderr.splitlines() == ["[ranks 0-1 stderr] loud"], str(cell)


def test_every_ranks_stderr_shows_labelled(nb: Kernel) -> None:
    nb.ok(POOL2)
    cell = nb.ok(
        "%%sky\nimport sys, torch.distributed as dist\n"
        "print(f'careful {dist.get_rank()}', file=sys.stderr)"
    )
    assert sorted(cell.stderr.splitlines()) == [
        "[rank 0 stderr] careful 0",
        "[rank 1 stderr] careful 1",
    ], str(cell)
    assert cell.stdout == ""


def test_a_line_every_rank_writes_to_stderr_shows_once(nb: Kernel) -> None:
    nb.ok(POOL2)
    cell = nb.ok("%%sky\nimport sys\nprint('same', file=sys.stderr)")
    assert cell.stderr == "[ranks 0-1 stderr] same\n", str(cell)
    cell = nb.ok("%%sky\nimport warnings\nwarnings.warn('careful, same')")
    warned = [line for line in cell.stderr.splitlines() if "UserWarning: careful, same" in line]
    assert len(warned) == 1 and warned[0].startswith("[ranks 0-1 stderr] "), str(cell)
    assert "[rank 0 stderr]" not in cell.stderr and "[rank 1 stderr]" not in cell.stderr
    # A line only the head writes, just before the cell ends: held for rank 1, written at the end.
    cell = nb.ok(
        "%%sky\nimport sys, torch.distributed as dist\n"
        "if dist.get_rank() == 0:\n    print('head only', file=sys.stderr)"
    )
    assert cell.stderr == "[rank 0 stderr] head only\n", str(cell)


def test_output_is_attributed_to_the_cell_that_printed_it(nb: Kernel) -> None:
    nb.ok(POOL2)
    start = len(nb.iopub)
    lines = 2000
    first = nb.ok(
        "%%sky --stdout all\n"
        "import torch.distributed as dist\n"
        f"for i in range({lines}):\n"
        "    print(f'A-line {dist.get_rank()} {i}')\n"
        "print('A-tail', end='')"
    )
    second = nb.ok("%%sky\nprint('B-line')")

    # (Searched for rather than split into lines: an unterminated line of one rank is glued to
    # the next rank's line, see test_stdout_all_keeps_each_ranks_lines_apart.)
    found = re.findall(r"\[rank (\d)\] A-line (\d) (\d+)\n", first.stdout)
    for label in ("0", "1"):
        got = [int(i) for shown, r, i in found if shown == label and r == label]
        assert got == list(range(lines)), f"rank {label}'s lines are missing or out of order"
    assert len(found) == 2 * lines
    for rank in (0, 1):  # both ranks' unterminated last line arrived in this cell
        assert first.stdout.count(f"[rank {rank}] A-tail") == 1, first.stdout[-200:]
    assert second.stdout == "B-line\n", "the first cell's output reached the second cell"

    streams = [m for m in nb.iopub[start:] if m["msg_type"] == "stream"]
    for m in streams:
        parent = m["parent_header"].get("msg_id")
        if "A-" in m["content"]["text"]:
            assert parent == first.msg_id, f"A's output attributed to {parent}: {m['content']}"
        if "B-line" in m["content"]["text"]:
            assert parent == second.msg_id


def test_stdout_all_keeps_each_ranks_lines_apart(nb: Kernel) -> None:
    nb.ok(POOL2)
    cell = nb.ok(
        "%%sky --stdout all\n"
        "import time, torch.distributed as dist\n"
        "if dist.get_rank() == 0:\n"
        "    print('half', end='', flush=True)\n"
        "    time.sleep(0.5)  # the unterminated text is sent after a short hold\n"
        "dist.barrier()\n"
        "if dist.get_rank() == 1:\n"
        "    print('whole', flush=True)\n"
        "    time.sleep(0.5)\n"
        "dist.barrier()\n"
        "if dist.get_rank() == 0:\n"
        "    print('-done')"
    )
    lines = cell.stdout.splitlines()
    assert "[rank 1] whole" in lines, repr(cell.stdout)
    assert all(line.startswith("[rank ") for line in lines if line), repr(cell.stdout)


def test_a_carriage_return_progress_line_survives(nb: Kernel) -> None:
    nb.ok(POOL2)
    body = "for i in range(3):\n    print(f'\\rprogress {i}/3', end='', flush=True)\nprint()"
    cell = nb.ok("%%sky\n" + body)
    assert cell.stdout == "\rprogress 0/3\rprogress 1/3\rprogress 2/3\n", repr(cell.stdout)
    cell = nb.ok("%%sky --stdout all\n" + body)
    for rank in (0, 1):
        assert f"\r[rank {rank}] progress 2/3\n" in cell.stdout, repr(cell.stdout)


# ------------------------------------------------------------------------------ 6. errors


def test_a_failing_rank_shows_its_exception_and_the_cells_source_line(nb: Kernel) -> None:
    nb.ok(POOL2)
    started = time.monotonic()
    cell = nb.fails(
        "%%sky\n"
        "import torch.distributed as dist\n"
        "if dist.get_rank() == 1:\n"
        "    raise ValueError('only rank one fails')\n"
        "dist.barrier()  # rank 0 waits here for a peer that failed"
    )
    assert time.monotonic() - started < 20, "the head waited for the collective's timeout"
    assert len(cell.errors) == 1, str(cell)
    error = cell.errors[0]
    assert cell.reply["ename"] == error["ename"]
    assert error["evalue"].startswith("cell failed on rank 1"), error["evalue"]
    assert "ValueError: only rank one fails" in error["evalue"]
    traceback = "\n".join(error["traceback"])
    assert "--- rank 1" in traceback
    assert "raise ValueError('only rank one fails')" in traceback
    # The cell named as the notebook numbers it, in the traceback as in the panel.
    number = cell.reply["execution_count"]
    assert f'File "<In [{number}]>", line 3, in <module>' in traceback, traceback
    (panel,) = [
        m["content"]["data"]["text/plain"]
        for m in cell.messages
        if m["msg_type"] == "display_data"
        and "panel" in m["content"]["metadata"].get("skyward_jupyter", {})
    ]
    assert panel.startswith(f"In [{number}] "), panel
    assert "rank 0:" in traceback  # the head, stopped after the failure, is summarised
    # The pool recovered: a collective works on the next cell.
    cell = nb.ok(
        "%%sky\nimport torch, torch.distributed as dist\n"
        "t = torch.ones(1)\ndist.all_reduce(t)\nt.item()"
    )
    assert cell.shown == ["2.0"], str(cell)


def test_several_failing_ranks_are_summarised(nb: Kernel) -> None:
    nb.ok(POOL2)
    cell = nb.fails(
        "%%sky\nimport torch.distributed as dist\nraise RuntimeError(f'bad rank {dist.get_rank()}')"
    )
    assert len(cell.errors) == 1, str(cell)
    evalue = cell.errors[0]["evalue"]
    first = re.match(r"cell failed on rank (\d) \(.*\): RuntimeError: bad rank (\d)", evalue)
    assert first and first[1] == first[2], evalue
    other = re.search(r"and on 1 other rank\(s\): rank (\d): (\w+)", evalue)
    assert other and {first[1], other[1]} == {"0", "1"}, evalue
    traceback = "\n".join(cell.errors[0]["traceback"])
    assert "raise RuntimeError(f'bad rank {dist.get_rank()}')" in traceback
    assert f"rank {other[1]}: " in traceback


def test_the_same_error_on_another_rank_is_not_said_to_follow_the_first(nb: Kernel) -> None:
    """Both ranks run the same code and raise the same NameError on their own: the other rank's
    is "the same error", not "after the failure above".
    """
    nb.ok(POOL2)
    cell = nb.fails("%%sky\nundefined_on_every_rank + 1")
    traceback = "\n".join(cell.errors[0]["traceback"])
    assert "after the failure above" not in traceback, traceback
    assert re.search(
        r"^rank \d: NameError: name 'undefined_on_every_rank' is not defined \(the same error\)$",
        traceback,
        re.M,
    ), traceback


def test_the_group_reforms_after_every_failure(nb: Kernel) -> None:
    nb.ok(POOL2)
    try:
        for attempt in range(40):
            cell = nb.fails(
                "%%sky\nimport torch.distributed as dist\n"
                "raise RuntimeError(f'bad rank {dist.get_rank()}')"
            )
            assert cell.reply["ename"] == "CellError", f"try {attempt}: {cell.reply['evalue']}"
            health = nb.execute(HEALTH)
            assert health.per_rank == {0: "True", 1: "True"}, f"try {attempt}: {health}"
    finally:
        nb.ensure_healthy()


# ------------------------------------------------------------------------------ 7. interrupt


def test_interrupt_stops_the_cell_and_keeps_the_pool(nb: Kernel) -> None:
    nb.ok(POOL2)
    nb.ok("%%sky --out before_interrupt\nkept_across_interrupt = 41\nimport os\nos.getpid()")
    pids = nb.eval("before_interrupt.values")
    cell, took = nb.interrupted(
        # Past the barrier, rank 1 too is a print away from its sleep when the head's print
        # streams into the cell (the cue to interrupt).
        "%%sky\nimport time, torch.distributed as dist\ndist.barrier()\n"
        "print('sleeping', flush=True)\ntime.sleep(120)\nprint('woke')",
        when="sleeping",
    )
    assert took < 15, f"the cell ended {took:.1f} s after the interrupt"
    assert cell.status == "error", str(cell)
    assert cell.reply["ename"] == "CellInterrupted", str(cell)
    # The toolbar's stop: a line per rank, where it stopped; no frames of the magic, no source.
    number = cell.reply["execution_count"]
    assert cell.errors[0]["traceback"] == [
        "KeyboardInterrupt: cell interrupted on 2 ranks",
        f"rank 0: stopped at In [{number}] line 4: time.sleep(120)",
        f"rank 1: stopped at In [{number}] line 4: time.sleep(120)",
    ], str(cell)
    assert "woke" not in cell.stdout

    cell = nb.ok(
        "%%sky --all --out after_interrupt\nimport os\n(os.getpid(), kept_across_interrupt + 1)"
    )
    assert nb.eval("after_interrupt.values") == [(pids[0], 42), (pids[1], 42)], str(cell)


def test_names_bound_by_an_interrupted_cell_stay_remote(nb: Kernel) -> None:
    nb.ok(POOL2)
    cell, _ = nb.interrupted(
        "%%sky\ntrained = 'remote model'\nimport time, torch.distributed as dist\n"
        "dist.barrier()\nprint('sleeping', flush=True)\ntime.sleep(120)",
        when="sleeping",
    )
    assert cell.reply.get("ename") == "CellInterrupted", str(cell)
    nb.ok("trained = 'notebook model'")
    cell = nb.ok("%%sky --all\ntrained")
    assert cell.per_rank == {0: "'remote model'", 1: "'remote model'"}


def test_timeout_stops_the_cell_and_keeps_the_pool(nb: Kernel) -> None:
    nb.ok(POOL2)
    nb.ok("%%sky\nkept_across_timeout = 1")
    pids = nb.pool_pids()
    started = time.monotonic()
    cell = nb.fails("%%sky --timeout 1\nimport time\ntime.sleep(60)\nprint('woke')")
    assert time.monotonic() - started < 15
    assert "timed out after 1.0 s" in cell.stderr, str(cell)
    assert "woke" not in cell.stdout
    # Shown as the timeout and where each rank stopped, not as a Ctrl-C no one pressed.
    assert cell.reply["ename"] == "CellTimedOut", str(cell)
    assert cell.reply["evalue"] == "cell timed out after 1.0 s (--timeout)", str(cell)
    shown = cell.errors[0]["traceback"]
    assert shown[0] == "CellTimedOut: cell timed out after 1.0 s (--timeout)", shown
    assert [line.split(": ", 1)[0] for line in shown[1:]] == ["rank 0", "rank 1"], shown
    assert all("stopped at In [" in line and "time.sleep(60)" in line for line in shown[1:])
    assert "KeyboardInterrupt" not in "\n".join(shown)
    cell = nb.ok("%%sky --all\nkept_across_timeout + 1")
    assert cell.per_rank == {0: "2", 1: "2"}
    assert nb.pool_pids() == pids


def test_a_stopped_ranks_traceback_shows_only_the_cells_lines(nb: Kernel) -> None:
    nb.ok(POOL2)
    cell = nb.fails("%%sky --timeout 0.5\nimport time\ntime.sleep(60)")
    traceback = "\n".join(cell.errors[0]["traceback"])
    assert "time.sleep(60)" in traceback
    assert "skyward_jupyter" not in traceback, traceback


# ------------------------------------------------------------------------------ line magics


def test_pull_and_push(nb: Kernel) -> None:
    nb.ok(POOL2)
    nb.ok("%%sky\nimport torch.distributed as dist\npulled = dist.get_rank() * 10 + 1")
    nb.ok("%sky pull pulled --all")
    assert nb.eval("pulled") == [1, 11]
    nb.ok("%sky pull pulled --rank 1")
    assert nb.eval("pulled") == 11
    nb.ok("%sky pull pulled")
    assert nb.eval("pulled") == 1
    # A pulled array is the notebook's to change (it came back read-only).
    nb.ok("%%sky\nimport numpy as np\nweights = np.zeros(3)")
    nb.ok("%sky pull weights\nweights[0] = 1.0")
    assert nb.eval("weights.tolist()") == [1.0, 0.0, 0.0]
    # Read on the rank asked alone; a name it lacks, or a value that does not pickle, is a
    # one-line error that leaves the notebook's variable as it was.
    nb.ok("%%sky --ranks 1\nonly_on_one = 'one'")
    nb.ok("%sky pull only_on_one --rank 1")
    assert nb.eval("only_on_one") == "one"
    nb.ok("%%sky\nimport threading\nunpicklable = threading.Lock()")
    for line, said in [
        ("%sky pull only_on_one", "rank 0 has no variable 'only_on_one'"),
        ("%sky pull unpicklable --rank 1", "rank 1's unpicklable (<unlocked _thread.lock"),
    ]:
        cell = nb.fails(line)
        assert cell.reply["ename"] == "UsageError" and said in cell.reply["evalue"], str(cell)
    assert nb.eval("only_on_one") == "one" and "unpicklable" not in nb.eval("dir()")

    nb.ok("%%sky\npushed = 'remote'")
    nb.ok("pushed = 'local'")
    assert nb.ok("%%sky --all\npushed").per_rank == {0: "'remote'", 1: "'remote'"}
    cell = nb.ok("%sky push pushed")
    assert re.fullmatch(r"pushed pushed: \d+ bytes to each rank\n", cell.stdout), str(cell)
    assert nb.ok("%%sky --all\npushed").per_rank == {0: "'local'", 1: "'local'"}


def test_config_stdout_all_applies_to_later_cells(nb: Kernel) -> None:
    nb.ok(POOL2)
    try:
        cell = nb.ok("%sky config --stdout all")
        assert "stdout all" in cell.stdout, str(cell)
        code = "%%sky\nimport torch.distributed as dist\nprint(f'configured {dist.get_rank()}')"
        cell = nb.ok(code)
        assert sorted(cell.stdout.splitlines()) == [
            "[rank 0] configured 0",
            "[rank 1] configured 1",
        ], str(cell)
        cell = nb.ok(code.replace("%%sky", "%%sky --stdout head"))  # a cell's option wins
        assert cell.stdout == "configured 0\n", str(cell)
    finally:
        nb.ok("%sky config --stdout head")
    assert nb.ok(code).stdout == "configured 0\n"


def test_restart_gives_fresh_ranks_with_an_empty_namespace(nb: Kernel) -> None:
    nb.ok(POOL2)
    nb.ok("%%sky --out before_restart\nrestart_probe = 1\nimport os\nos.getpid()")
    old = set(nb.eval("before_restart.values"))
    nb.ok("%sky restart")
    wait_for(lambda: not (old & agent_pids()), GONE_TIMEOUT, "the old ranks to end")
    new = nb.pool_pids()
    assert len(new) == 2 and not (set(new) & old)
    nb.ok("%%sky --out after_restart\nimport os\n(os.getpid(), 'restart_probe' in globals())")
    assert nb.eval("after_restart.values") == [(new[0], False), (new[1], False)]


def test_a_model_and_its_optimizer_from_the_notebook_train_together_on_the_ranks(
    nb: Kernel,
) -> None:
    """Built in the notebook, the optimizer holds the model's parameters: on the ranks it still
    does, so its steps train the model (sent apart, it stepped copies and the model never
    moved).
    """
    nb.ok(POOL2)
    nb.ok(
        "import torch\nshared_model = torch.nn.Linear(4, 1)\n"
        "shared_opt = torch.optim.SGD(shared_model.parameters(), lr=0.1)"
    )
    nb.ok(
        "%%sky --out trained\nbefore = shared_model.weight.detach().clone()\n"
        "for _ in range(3):\n"
        "    shared_opt.zero_grad()\n"
        "    shared_model(torch.ones(2, 4)).sum().backward()\n"
        "    shared_opt.step()\n"
        "(not torch.equal(before, shared_model.weight),"
        " shared_opt.param_groups[0]['params'][0] is shared_model.weight)"
    )
    assert nb.eval("trained.values") == [(True, True), (True, True)]


def test_a_rank_keeping_its_own_model_keeps_the_optimizer_over_it_too(nb: Kernel) -> None:
    """A model one rank built in a ``--ranks`` cell stays that rank's when the notebook's model
    and optimizer travel together; the optimizer over the notebook's copy is not bound there
    (it would step a model the rank does not use), and the cell says so. Other ranks take both.
    """
    nb.ok(POOL2)
    nb.ok(
        "%%sky --ranks 0\nimport torch\nown_model = torch.nn.Linear(2, 1)\n"
        "with torch.no_grad():\n    own_model.weight.fill_(7.0)"
    )
    nb.ok(
        "import torch\nown_model = torch.nn.Linear(2, 1)\n"
        "own_opt = torch.optim.SGD(own_model.parameters(), lr=1.0)"
    )
    cell = nb.ok(
        "%%sky --out own_pair\n"
        "(own_model.weight[0, 0].item() == 7.0, 'own_opt' in globals(), 'own_opt' in globals()"
        " and own_opt.param_groups[0]['params'][0] is own_model.weight)"
    )
    assert nb.eval("own_pair.values") == [(True, False, False), (False, True, True)]
    assert "rank 0 keeps its own 'own_model', so the notebook's 'own_opt'" in cell.stderr, str(cell)
    # The optimizer the rank went without is named when a later cell misses it there.
    missed = nb.fails("%%sky\nown_opt.zero_grad()")
    assert "NameError" in str(missed), str(missed)
    assert "rank 0 did not bind the notebook's 'own_opt' (sent with <In [" in str(missed), str(
        missed
    )
    assert "%sky push own_model own_opt gives every rank the notebook's" in str(missed)
    # Once the rank has its own, and deleted it, the miss is its own doing: nothing to say.
    nb.ok("%%sky --ranks 0\nown_opt = torch.optim.SGD(own_model.parameters(), lr=1.0)")
    own_miss = nb.fails("%%sky --ranks 0\ndel own_opt\nown_opt")
    assert "NameError" in str(own_miss) and "did not bind" not in str(own_miss), str(own_miss)


def test_an_optimizer_read_alone_over_a_model_a_rank_kept_says_it_arrives_over_a_copy(
    nb: Kernel,
) -> None:
    """Rank 0 keeps a model of its own; the notebook makes another and an optimizer over it. A
    cell that reads the optimizer alone gives the ranks one over a copy of the notebook's model
    (not rank 0's), and says so: make it on the ranks, or push the two together.
    """
    nb.ok(POOL2)
    nb.ok("%%sky --ranks 0\nimport torch\nlone_model = torch.nn.Linear(2, 1)")
    nb.ok(
        "import torch\nlone_model = torch.nn.Linear(2, 1)\n"
        "lone_opt = torch.optim.SGD(lone_model.parameters(), lr=1.0)"
    )
    cell = nb.ok("%%sky\nlone_opt.param_groups[0]['lr']")
    assert (
        "'lone_opt' shares tensors with the notebook's 'lone_model', but the ranks' is their "
        "own (a %%sky cell bound it): on the ranks they share nothing"
    ) in cell.stderr, str(cell)
    assert "%sky push lone_model lone_opt" in cell.stderr, str(cell)


def test_an_optimizer_a_rank_deleted_itself_is_not_blamed_on_the_notebook(nb: Kernel) -> None:
    """A rank that kept its earlier optimizer (not the notebook's new one, over a model it does
    not use) and then deleted it in a cell: missing it later is the cell's doing, not said as a
    value the notebook's group left out.
    """
    nb.ok(POOL2)
    nb.ok(
        "import torch\nolder_model = torch.nn.Linear(2, 1)\n"
        "older_opt = torch.optim.SGD(older_model.parameters(), lr=1.0)"
    )
    nb.ok("%%sky\nolder_model, older_opt")
    nb.ok("%%sky --ranks 0\nolder_model = torch.nn.Linear(2, 1)")
    nb.ok(
        "older_model = torch.nn.Linear(2, 1)\n"
        "older_opt = torch.optim.SGD(older_model.parameters(), lr=0.5)"
    )
    kept = nb.ok("%%sky --out older_lr\nolder_model\nolder_opt.param_groups[0]['lr']")
    assert nb.eval("older_lr.values") == [1.0, 0.5], str(kept)
    gone = str(nb.fails("%%sky --ranks 0\ndel older_opt\nolder_opt"))
    assert "NameError" in gone and "did not bind" not in gone, gone


def test_a_pair_each_rank_deleted_half_of_is_named_where_a_cell_misses_it(nb: Kernel) -> None:
    """A model deleted on rank 0 and its optimizer on rank 1: neither rank binds half of the
    notebook's pair beside the half it still holds (the optimizer would step another model), so
    a cell that reads the missing half fails there, and says why and what to do.
    """
    nb.ok(POOL2)
    nb.ok(
        "import torch\nhalf_model = torch.nn.Linear(2, 1)\n"
        "half_opt = torch.optim.SGD(half_model.parameters(), lr=1.0)"
    )
    nb.ok("%%sky\nhalf_model, half_opt")
    nb.ok("%%sky\nif rank == 0:\n    del half_model\nelse:\n    del half_opt")
    # Each rank on its own: a failing rank stops the cell on the other before it may fail.
    # The cell the pair came with says it once; a later one that misses it again says so too.
    missed_0 = str(nb.fails("%%sky --ranks 0\nhalf_opt.zero_grad()\nhalf_model"))
    assert "rank 0 keeps its own 'half_opt', so the notebook's 'half_model'" in missed_0, missed_0
    assert "did not bind" not in missed_0, missed_0
    missed_1 = str(nb.fails("%%sky --ranks 1\nhalf_model\nhalf_opt"))
    assert "rank 1 did not bind the notebook's 'half_opt'" in missed_1, missed_1
    assert "%sky push half_model half_opt gives every rank the notebook's" in missed_1, missed_1
    nb.ok("%sky push half_model half_opt")
    assert nb.ok("%%sky --out half_both\n'half_model' in globals() and 'half_opt' in globals()")
    assert nb.eval("half_both.values") == [True, True]


def test_a_pushed_function_brings_its_globals_by_the_cells_rules(nb: Kernel) -> None:
    """``%sky push`` of a function sends the globals it reads too, by a cell's rules: a name
    that only some ranks bound themselves stays theirs there; the pushed name itself goes to
    every rank.
    """
    nb.ok(POOL2)
    nb.ok("%%sky --ranks 0\npush_base = 100")
    nb.ok("push_base = 1\ndef push_bump():\n    return push_base + 1")
    nb.ok("%sky push push_bump")
    nb.ok("%%sky --out bumped\npush_bump()")
    assert nb.eval("bumped.values") == [101, 2]


def test_what_the_ranks_write_between_cells_is_written_by_the_next_cell(
    nb: Kernel, tmp_path: Path
) -> None:
    """A thread a cell left running prints after the cell ended: the next cell writes it first,
    said to be from between cells, by the cell's own rules (the head's stdout); not lost.
    """
    nb.ok(POOL2)
    done = tmp_path / "ticked"
    nb.ok(
        "%%sky\nimport threading, time, pathlib\n"
        "def tick_between():\n"
        "    time.sleep(0.2)\n"
        "    print('tick from rank', rank, flush=True)\n"
        f"    pathlib.Path('{done}-' + str(rank)).touch()\n"
        "threading.Thread(target=tick_between).start()"
    )
    wait_for(lambda: all(Path(f"{done}-{r}").exists() for r in (0, 1)), CELL_TIMEOUT, "the ticks")
    cell = nb.ok("%%sky\nprint('the next cell')")
    assert cell.stdout == "tick from rank 0\nthe next cell\n", str(cell)
    assert "pool 'default': the ranks wrote this between cells:" in cell.stderr, str(cell)
    assert "tick from rank" not in nb.ok("%%sky\npass").stdout  # written once
    Path(f"{done}-1").unlink()
    nb.ok("%%sky\nif rank == 1:\n    threading.Thread(target=tick_between).start()")
    wait_for(Path(f"{done}-1").exists, CELL_TIMEOUT, "rank 1's tick")
    quiet = nb.ok("%%sky\nprint('the cell after')")  # rank 1's stdout is not shown: nor said
    assert quiet.stdout == "the cell after\n", str(quiet)
    assert "between cells" not in quiet.stderr, str(quiet)


def test_a_cell_option_given_to_a_command_is_named_with_what_is_near_it() -> None:
    """``%sky config --timeout``: the cell's option, and the command's own that is near it."""
    said = unknown_option("--timeout", ["--time", "--nodes"])
    assert "it is a %%sky cell's own option (%%sky --timeout ...)" in said
    assert said.endswith("did you mean --time?")


def test_a_name_a_cell_deleted_on_the_ranks_travels_again_from_the_notebook(nb: Kernel) -> None:
    """``del x`` in a ``%%sky`` cell removes the ranks' ``x``; the notebook still has its own,
    which a later cell that reads ``x`` gets (not a NameError because it was sent once). A rank
    that did not delete it keeps what it holds, also a value the notebook sent that the ranks
    changed in place (a model they trained: the notebook's would undo the training).
    """
    nb.ok(POOL2)
    nb.ok("deleted_there = 5")
    nb.ok("%%sky\ndeleted_there + 1")
    nb.ok("%%sky\ndel deleted_there")
    nb.ok("%%sky --out after_del\ndeleted_there + 2")
    assert nb.eval("after_del.values") == [7, 7]
    nb.ok("%%sky --ranks 1\ndel deleted_there")  # on one rank: the other keeps its value
    nb.ok("%%sky --out after_some\ndeleted_there + 3")
    assert nb.eval("after_some.values") == [8, 8]
    nb.ok("%%sky\nowned_there = rank")  # the ranks' own now
    nb.ok("owned_there = 'notebook'")
    nb.ok("%%sky --ranks 1\ndel owned_there")
    nb.ok("%%sky --out owned\nowned_there")  # rank 0 keeps its own; rank 1 takes the notebook's
    assert nb.eval("owned.values") == [0, "notebook"]
    nb.ok("trained_in_place = [0]")
    nb.ok("%%sky\ntrained_in_place.append(rank + 1)")  # in place: each rank's copy differs now
    nb.ok("%%sky --ranks 0\ndel trained_in_place")
    nb.ok("%%sky --out after_training\ntrained_in_place")
    assert nb.eval("after_training.values") == [[0], [0, 2]]


def _lose_rank_1_while_idle(nb: Kernel, victim: int) -> None:
    """Kill rank 1 (pid ``victim``) from outside while the pool idles, and wait until the pool
    has started it again (ready: the recovery has said all it says).
    """
    os.kill(victim, signal.SIGKILL)

    def started_again() -> bool:
        line = next(x for x in nb.status().splitlines() if x.strip().startswith("rank 1 "))
        return f"local pid {victim})" not in line and line.endswith(": ready")

    wait_for(started_again, GONE_TIMEOUT, "the pool to start the lost rank again")


def test_a_cell_run_while_a_lost_rank_starts_again_sends_it_the_globals(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A cell that chose its globals while the pool was still starting a rank it lost (idle)
    waits for it, then sends the new rank every global it reads: chosen before the rank began
    again with an empty namespace, the unchanged ones were taken for there (a NameError on that
    rank). The restart is held until the cell has chosen, so the order is the one to test.
    """
    chosen = threading.Event()
    restart_dead = Ranks.restart_dead
    prepare = Shipper.prepare

    async def held_restart(self: Ranks, *args: Any, **kwargs: Any) -> list[str]:
        await asyncio.to_thread(chosen.wait, GONE_TIMEOUT)
        return await restart_dead(self, *args, **kwargs)

    def choosing(self: Shipper, *args: Any, **kwargs: Any) -> Any:
        shipment = prepare(self, *args, **kwargs)
        chosen.set()
        return shipment

    session = Session(announce=lambda text: None)
    notebook = {"kept_for_the_new_rank": 41}
    try:
        spec = PoolSpec(nodes=2)
        pids = session.run_cell(
            "kept_for_the_new_rank\nimport os\nos.getpid()", notebook, spec=spec
        )
        pool = session.pools["default"].pool
        told: list[str] = []

        def tell(event: object) -> None:
            if isinstance(event, PoolMessage):
                told.append(event.text)

        pool.subscribe(tell)
        monkeypatch.setattr(Ranks, "restart_dead", held_restart)
        monkeypatch.setattr(Shipper, "prepare", choosing)
        os.kill(pids.values[1], signal.SIGKILL)
        wait_for(
            lambda: pool.ranks[1].state is RankState.LOST,
            GONE_TIMEOUT,
            "the pool to see rank 1 gone",
        )
        after = session.run_cell("kept_for_the_new_rank + 1", notebook, spec=spec)
        assert after.values == [42, 42], str(after.errors)
        assert pool.ranks_started == 3
        assert any("the cell waits for the pool to start rank 1" in text for text in told), told
    finally:
        session.down_all()


def test_a_cell_whose_pool_keeps_starting_ranks_again_gives_up_after_three_choices(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A pool that has started ranks again each time the cell may run (a rank crashing as it
    starts): the cell chooses its globals anew, up to three times, then fails saying to wait
    for the pool. Each new choice sends every global again, and a warning it brings is said
    once, also when it left one choice and came back with the next.
    """
    said: list[str] = []
    session = Session(announce=said.append)
    notebook = {"sized_for_a_warning": bytes(4096)}
    spec = PoolSpec(nodes=2)
    monkeypatch.setattr(capture, "LARGE_GLOBAL_BYTES", 1024)
    tries: list[int | None] = []

    def restarting(self: Pool, *args: Any, **kwargs: Any) -> Any:
        tries.append(kwargs["started"])
        self._ranks.started += 1  # as a rank started again would count
        # Small for the second choice and large again for the third: its warning comes back.
        notebook["sized_for_a_warning"] = bytes(8 if len(tries) == 1 else 4096)
        raise RanksRestarted(f"pool {self.name!r} started ranks again before the cell ran")

    try:
        session.run_cell("len(sized_for_a_warning)", notebook, spec=spec)
        warning = next(text for text in said if "'sized_for_a_warning' is" in text)
        said.clear()
        notebook["sized_for_a_warning"] = bytes(4097)  # changed: the first choice warns too
        monkeypatch.setattr(Pool, "run", restarting)
        with pytest.raises(PoolError) as failed:
            session.run_cell("len(sized_for_a_warning)", notebook, spec=spec)
        assert str(failed.value) == (
            "pool 'default' started ranks again before the cell ran, 3 times while the cell "
            "waited; run it again once %sky status shows every rank ready"
        )
        assert tries == [2, 3, 4]  # chosen anew each time, at the count the pool then had
        assert said.count(warning) == 1, said  # said with the first choice only
    finally:
        monkeypatch.undo()
        session.down_all()


def _bind_then_lose_rank_1_while_idle(nb: Kernel, name: str) -> str:
    """On the 2-rank pool, a cell binds ``name`` on the ranks; then rank 1 is lost while idle
    and started again. The line that tells of the loss.
    """
    nb.ok(POOL2)
    nb.ok(f"%%sky --out pids_before_loss\n{name} = 1\nimport os\nos.getpid()")
    victim = nb.eval("pids_before_loss.values")[1]
    _lose_rank_1_while_idle(nb, victim)
    return f"pool 'default': rank 1 (node 1, local pid {victim}) killed by SIGKILL while idle"


def test_a_rank_lost_between_cells_is_told_by_the_next_cell(nb: Kernel) -> None:
    """A rank killed from outside while the pool idles is started again without its namespace:
    in a notebook with a frontend no panel is showing then, so the next cell on the pool says
    so first, before its own (failing) output.
    """
    told = _bind_then_lose_rank_1_while_idle(nb, "kept_before_loss")
    cell = nb.fails("%%sky\nkept_before_loss")
    assert told in cell.stderr, str(cell)
    assert "pool 'default': rank 1 was restarted: its namespace was lost" in cell.stderr, str(cell)
    assert "NameError" in cell.reply["evalue"] or "NameError" in str(cell), str(cell)
    assert told not in nb.execute("%%sky\npass").stderr  # told once


def test_a_rank_restarted_while_idle_gets_the_notebooks_globals_again(nb: Kernel) -> None:
    """A notebook global sent once, then a rank lost while idle and started again: the next
    cell sends the global again (that rank's namespace is new), not a NameError on it. The rank
    that was not lost keeps what it made of a value sent to it (trained in place).
    """
    nb.ok(POOL2)
    nb.ok("sent_before_idle_loss = 42\nchanged_before_idle_loss = [0]")
    nb.ok(
        "%%sky --out before_idle_loss\nimport os\nchanged_before_idle_loss.append(rank)\n"
        "(sent_before_idle_loss, os.getpid())"
    )
    victim = nb.eval("before_idle_loss.values")[1][1]
    _lose_rank_1_while_idle(nb, victim)
    nb.ok("%%sky --out after_idle_loss\n(sent_before_idle_loss + 1, changed_before_idle_loss)")
    assert nb.eval("after_idle_loss.values") == [(43, [0, 0]), (43, [0])]


def test_a_mistyped_pool_name_is_named_with_the_pools_that_run(nb: Kernel) -> None:
    nb.ok(POOL2)
    for line in ("%sky stacks typo", "%sky restart typo", "%sky who typo"):
        cell = nb.fails(line)
        assert "no pool named 'typo' (running: 'default')" in str(cell), (line, str(cell))


def test_a_rank_lost_between_cells_is_told_by_a_pull_before_its_error(nb: Kernel) -> None:
    """``%sky pull`` runs without a cell's view: what the pool said since its last cell (a rank
    lost while idle, restarted without its namespace) is told with the pull, before the error
    it explains, and not again by the next cell.
    """
    told = _bind_then_lose_rank_1_while_idle(nb, "kept_before_pull")
    pull = nb.fails("%sky pull kept_before_pull --rank 1")
    assert told in pull.stderr, str(pull)
    assert pull.stderr.index(told) < pull.stderr.index("has no variable"), str(pull)
    assert told not in nb.ok("%%sky\npass").stderr  # told once


# ------------------------------------------------------------------------------ 2. replacement


def test_options_that_spell_out_what_the_pool_chose_keep_it_and_its_state(nb: Kernel) -> None:
    """``--backend gloo`` on a pool whose group is gloo's, ``--framework torch`` on one that set
    torch up, ``--procs-per-node 1`` where each node has one rank, or a cell leaving out what
    started the pool: the same pool, its ranks' state kept. A real difference still replaces it.
    """
    nb.ok("%%sky --name spelled --nodes 1 --procs-per-node 2 --backend gloo\nkept = rank + 7")
    for options in ("", "--framework torch", "--backend gloo --framework torch,torch"):
        cell = nb.ok(f"%%sky --name spelled --nodes 1 --procs-per-node 2 {options} --out r\nkept")
        assert "replacing" not in cell.stderr, (options, str(cell))
        assert nb.eval("r.values") == [7, 8], options
    nb.ok("%%sky --name once --nodes 2\nkept = rank + 7")  # a rank per node (a CPU, no GPU)
    cell = nb.ok("%%sky --name once --nodes 2 --procs-per-node 1 --out r\nkept")
    assert "replacing" not in cell.stderr and nb.eval("r.values") == [7, 8], str(cell)
    nb.ok("%sky down once")
    cell = nb.ok("%%sky --name spelled --nodes 1 --procs-per-node 2 --framework none\n1")
    assert "replacing" in cell.stderr and "--framework (default) -> none" in cell.stderr, str(cell)
    nb.ok("%sky down spelled")


def test_other_options_replace_the_pool_and_names_add_pools(nb: Kernel) -> None:
    nb.ok("%%sky --nodes 2 --out two_nodes\nimport os\nos.getpid()")
    two = nb.eval("two_nodes.values")

    cell = nb.ok("%%sky --nodes 1 --out one_node\nimport os\nos.getpid()")
    assert "replacing 2 nodes x 1 rank per GPU or CPU, local (--nodes 2 -> 1)" in cell.stderr, str(
        cell
    )
    one = nb.eval("one_node.values")
    assert len(one) == 1 and one[0] not in two
    wait_for(lambda: not (set(two) & agent_pids()), GONE_TIMEOUT, "the replaced ranks to end")

    nb.ok("%%sky --out current_pool\nimport os\nos.getpid()")
    assert nb.eval("current_pool.values") == one

    cell = nb.ok("%%sky --name other --out other_pool\nimport os\nos.getpid()")
    assert "replacing" not in cell.stderr
    other = nb.eval("other_pool.values")
    assert len(other) == 1 and other != one
    status = nb.status()
    assert re.search(r"^  default: 1 node\b", status, re.M), status
    assert re.search(r"^\* other: 1 node\b", status, re.M), status
    assert set(nb.pool_pids()) == {*one, *other}
    assert {*one, *other} <= agent_pids()

    nb.ok("%sky down --all")
    assert nb.status().strip() == "no pools"
    wait_for(lambda: not ({*one, *other} & agent_pids()), GONE_TIMEOUT, "the pools' ranks to end")


def test_a_failed_replacement_leaves_the_local_pool_as_it_was(nb: Kernel, tmp_path: Path) -> None:
    """A working 2-node pool, then replacements that fail: one that this CPU machine's torch
    refuses (NCCL), one that breaks the ranks' start (torch refuses ``TORCH_LOGS`` at import).
    Each says that the old pool still runs, the next cell without options runs on it (same
    processes, world size 2), and its panel state (metrics) is still the one shown. The ranks
    the failed starts made are gone (the leak check after the test).
    """
    world = (
        "%%sky --all\nimport os, torch.distributed as dist\n(os.getpid(), dist.get_world_size())"
    )
    nb.ok(POOL2)
    nb.ok("%%sky\nfrom skyward_jupyter import log\nlog(step=1, loss=2.5)")
    before = nb.ok(world).per_rank
    assert len(before) == 2 and all(v.endswith(", 2)") for v in before.values()), before
    status = normalised(nb.status())
    kept = (
        r"pool 'default': its replacement \(--env \(default\) -> TORCH_LOGS=not_a_log_name\) "
        r"did not start; the pool 'default' is still running as before \(2 nodes x 1 rank per "
        r"GPU or CPU, local\), and cells without pool options run on it"
    )
    # NCCL may be refused before anything starts, or when the group forms: either way the pool
    # stays. The bad variable is found only when the ranks start.
    for options, said in (("--backend nccl", ""), ("--env TORCH_LOGS=not_a_log_name", kept)):
        failed = nb.fails(f"%%sky --nodes 2 {options}\nprint('THE CELL RAN')")
        assert "THE CELL RAN" not in failed.stdout, str(failed)
        # Said where the start was said: its line ("starting ...") turns into the outcome.
        assert re.search(said, "\n".join([failed.stderr, *failed.status_line])), str(failed)
        assert nb.ok(world).per_rank == before, f"after {options}: not the same 2 ranks"
        assert normalised(nb.status()) == status
        metrics = nb.ok("%sky metrics")
        assert re.search(r"\b1\s+loss\s+2\.5\b", metrics.shown[0]), str(metrics)
    script = tmp_path / "train.py"
    script.write_text("import torch.distributed as d\nprint('world size', d.get_world_size())\n")
    failed = nb.fails(f"%sky run --nodes 2 --backend nccl {script}")
    assert "world size" not in failed.stdout, str(failed)
    assert "world size 2" in nb.ok(f"%sky run {script}").stdout


def test_metrics_that_diverge_or_overflow_show_as_they_are(nb: Kernel) -> None:
    """A diverged loss (inf, -inf), values near the largest float and a NaN on one rank: the
    cell, its panel and ``%sky metrics`` show them; a NaN is the step's whichever rank sent it.
    """
    nb.ok(POOL2)
    cell = nb.ok(
        "%%sky\nfrom skyward_jupyter import log\n"
        "log(step=0, loss=float('inf'), low=-float('inf'), huge=1e308,\n"
        "    a=float('nan') if rank == 0 else 1.0, b=1.0 if rank == 0 else float('nan'))"
    )
    assert "failed to draw" not in cell.stderr and not cell.errors, str(cell)
    nb.ok("shown = %sky metrics")
    rows = nb.ok(
        "print(sorted((r['name'], r['mean'], r['min'], r['max']) for r in shown if r['step'] == 0))"
    )
    nan, inf = "nan", "inf"
    assert rows.stdout.strip() == (
        f"[('a', {nan}, {nan}, {nan}), ('b', {nan}, {nan}, {nan}), "
        f"('huge', 1e+308, 1e+308, 1e+308), ('loss', {inf}, {inf}, {inf}), "
        f"('low', -{inf}, -{inf}, -{inf})]"
    ), str(rows)
    table = nb.ok("print(shown._repr_html_())").stdout
    assert ">inf<" in table and ">-inf<" in table and ">nan<" in table, table


def test_a_description_its_provider_refuses_leaves_the_pool_untouched(nb: Kernel) -> None:
    """A pool elsewhere replaces the local one only after it has started, but what its provider
    can check here comes first: Slurm without its commands on PATH is one line, and the 2-node
    pool is neither replaced nor restarted.
    """
    world = "%%sky --all\nimport os, torch.distributed as d\n(os.getpid(), d.get_world_size())"
    nb.ok(POOL2)
    before = nb.ok(world).per_rank
    nb.ok("import os, sys\n_path = os.environ['PATH']\nos.environ['PATH'] = sys.prefix")
    try:
        refused = nb.fails("%%sky --provider slurm --nodes 2\nprint('THE CELL RAN')")
    finally:
        nb.ok("os.environ['PATH'] = _path")
    assert refused.reply["evalue"].startswith("sbatch not found: the slurm provider needs"), str(
        refused
    )
    assert "replacing" not in refused.stderr and "THE CELL RAN" not in refused.stdout
    assert nb.ok(world).per_rank == before


# ------------------------------------------------------------------------------ 8. no ranks left


def _start_pool(kernel: Kernel) -> set[int]:
    kernel.ok("%load_ext skyward_jupyter")
    kernel.ok(POOL2)
    ranks = set(kernel.pool_pids())
    spawned = kernel.started_processes()
    assert len(ranks) == 2 and ranks <= spawned, (ranks, spawned)
    assert spawned & agent_pids(TEMPLATE), "no rank template started by this kernel"
    return spawned


def test_shutting_the_kernel_down_ends_its_ranks(own_kernel: Kernel) -> None:
    spawned = _start_pool(own_kernel)
    own_kernel.km.shutdown_kernel(now=False)
    wait_for(lambda: not (spawned & live_agents()), GONE_TIMEOUT, "ranks and template to end")


def test_restarting_the_kernel_ends_its_ranks(own_kernel: Kernel) -> None:
    spawned = _start_pool(own_kernel)
    own_kernel.km.restart_kernel(now=False)
    wait_for(lambda: not (spawned & live_agents()), GONE_TIMEOUT, "ranks and template to end")
    own_kernel.kc.wait_for_ready(timeout=60)
    assert own_kernel.eval("1 + 1") == 2


def test_killing_the_kernel_ends_its_ranks(own_kernel: Kernel) -> None:
    spawned = _start_pool(own_kernel)
    os.kill(own_kernel.pid, signal.SIGKILL)
    wait_for(lambda: not (spawned & live_agents()), GONE_TIMEOUT, "ranks and template to end")


# ------------------------------------------------------------------------------ %sky auto


def _panel_texts(cell: Cell) -> list[str]:
    """text/plain of each display and update of the cell's panel."""
    return [
        m["content"]["data"]["text/plain"]
        for m in cell.messages
        if m["msg_type"] in ("display_data", "update_display_data")
        and "panel" in m["content"]["metadata"].get("skyward_jupyter", {})
    ]


def test_auto_runs_plain_cells_on_the_pool_and_the_notebooks_own_cells_here(nb: Kernel) -> None:
    nb.ok(POOL2)
    assert "auto: off" in nb.ok("%sky auto").stdout
    try:
        on = nb.ok("%sky auto on")
        (current,) = re.findall(r"^\* (\w+):", nb.status(), re.M)
        mark = f"auto: cells run on pool {current!r}"
        assert mark in on.stdout, str(on)
        assert mark in nb.ok("%sky auto").stdout
        # A function and a class defined in one plain cell, used by the next, on every rank.
        nb.ok(
            "import os\n"
            "def where():\n"
            "    return os.getpid()\n"
            "class Box:\n"
            "    def __init__(self, v):\n"
            "        self.v = v"
        )
        cell = nb.ok("box = Box(rank * 10)\nprint('ran in', where())\nbox.v + world_size")
        assert cell.shown == ["2"], str(cell)  # the head's value, as for %%sky
        (printed,) = re.findall(r"ran in (\d+)", cell.stdout)
        assert int(printed) in nb.pool_pids() and int(printed) != nb.pid, str(cell)
        assert any(mark in t for t in _panel_texts(cell)), str(cell)
        assert nb.ok("%%sky --all\nbox.v").per_rank == {0: "0", 1: "10"}
        # A failing cell shows the ranks' error as %%sky does, and auto stays on.
        failed = nb.fails("def boom():\n    raise ValueError('auto boom')\nboom()")
        (error,) = failed.errors
        assert error["evalue"].startswith("cell failed on rank"), error["evalue"]
        assert "ValueError: auto boom" in error["evalue"]
        traceback = "\n".join(error["traceback"])
        number = failed.reply["execution_count"]
        assert f'File "<In [{number}]>", line 2, in boom' in traceback, traceback
        assert nb.ok("rank + 1").shown == ["1"]
        # The notebook's own: %%local, shell escapes, magics and what they run, silent requests.
        here = nb.ok("%%local\nimport os\nnotebook_only = os.getpid()\nnotebook_only")
        assert here.shown == [str(nb.pid)], str(here)
        assert "from-the-shell" in nb.ok("!echo from-the-shell").stdout
        nb.ok("%%time\ntimed_here = 1")
        nb.ok("silent_here = 2", silent=True)
        local = nb.ok("%%local\n[name in globals() for name in ('box', 'Box', 'where')]")
        assert local.shown == ["[False, False, False]"], str(local)
        assert nb.ok("%%local\ntimed_here + silent_here").shown == ["3"]
        assert nb.ok("%%sky --all\n'notebook_only' in globals()").per_rank == {
            0: "False",
            1: "False",
        }
    finally:
        off = nb.ok("%sky auto off")
    assert "auto: off" in off.stdout, str(off)
    assert nb.ok("import os\nos.getpid()").shown == [str(nb.pid)]
    assert nb.ok("%%sky\nbox.v").shown == ["0"]  # the ranks kept what auto cells bound


def test_auto_goes_off_when_its_pool_is_shut_down(nb: Kernel) -> None:
    try:
        nb.ok("%sky auto on")
        nb.ok("%sky up --name autopool --nodes 1")  # auto follows the current pool
        assert "auto: cells run on pool 'autopool'" in nb.ok("%sky auto").stdout
        assert nb.ok("world_size").shown == ["1"]
        down = nb.ok("%sky down autopool")
        assert "auto: off, as pool 'autopool' ended" in down.stderr, str(down)
        assert "auto: off" in nb.ok("%sky auto").stdout
        nb.ok("plain_after_down = 1")
        assert nb.ok("%%local\nplain_after_down").shown == ["1"]  # it ran in the notebook
    finally:
        nb.ok("%sky auto off")
        if "autopool" in nb.status():
            nb.ok("%sky down autopool")

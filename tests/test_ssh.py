"""The SSH provider against real sshd hosts in network namespaces (tests/hosts.py)."""

from __future__ import annotations

import gc
import json
import logging
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from skyward_jupyter import Pool, PoolError
from skyward_jupyter.events import PoolMessage
from skyward_jupyter.protocol import Script
from skyward_jupyter.providers.base import ProviderError
from skyward_jupyter.providers.ssh import Host, SSHOptions, SSHProvider
from skyward_jupyter.providers.ssh_prepare import package_digest

from .conftest import (
    agents_among,
    hold_rank_ones_gil,
    ranks_among,
    skip_where_nccl_runs,
    ssh_hosts_fixture,
    wait_for,
)
from .hosts import Hosts, available, ssh_hosts, ssh_provider
from .lifetime import detach, flat, kill_all, new_tag, running

pytestmark = pytest.mark.skipif(available() is not None, reason=str(available()))

ALL_REDUCE = (
    "import torch, torch.distributed as dist\n"
    "t = torch.ones(1) * (dist.get_rank() + 1)\n"
    "dist.all_reduce(t)\n"
    "(t.item(), dist.get_world_size(), __import__('socket').gethostname())"
)


hosts = ssh_hosts_fixture(3, "hosts")


@pytest.fixture
def tag() -> Iterator[str]:
    made = new_tag()
    yield made
    kill_all(made)


def _remote_agents(hosts: Hosts) -> list[int]:
    """Every process of the package on the hosts: ranks and the hosts' warm templates."""
    return agents_among(pid for i in range(len(hosts)) for pid in hosts.pids(i))


def _remote_ranks(hosts: Hosts) -> list[int]:
    return ranks_among(pid for i in range(len(hosts)) for pid in hosts.pids(i))


def test_ddp_across_three_hosts_and_the_package_ships_once(hosts: Hosts, tmp_path: Path) -> None:
    provider = ssh_provider(hosts, 3, tmp_path)
    with Pool(nodes=3, provider=provider, heartbeat_timeout=10) as pool:
        result = pool.run(ALL_REDUCE)
        assert result.ok, result.errors
        assert [v[:2] for v in result.values] == [(6.0, 3)] * 3
        assert pool.master_port and pool.nodes[0].address == hosts[0].address
        step = pool.run(
            "import torch.nn as nn\n"
            "from torch.nn.parallel import DistributedDataParallel as DDP\n"
            "torch.manual_seed(dist.get_rank())\n"
            "model = DDP(nn.Linear(4, 2))\n"
            "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
            "model(torch.randn(8, 4) * (dist.get_rank() + 1)).sum().backward()\n"
            "opt.step()\n"
            "[p.detach().tolist() for p in model.parameters()]"
        )
        assert step.ok, step.errors
        assert step.values[0] == step.values[1] == step.values[2]
    # Each host has its own disk: the package went to each once, with no staging directory left.
    assert sorted(provider.shipped) == sorted(
        f"{hosts.user}@{a}:{hosts[0].port}" for a in hosts.addresses
    )
    for i in range(3):
        listing = subprocess.run(
            hosts.inside_argv(i, "ls", str(tmp_path / "cache")), capture_output=True, text=True
        )
        assert listing.stdout.split() == [package_digest()], listing
    again = ssh_provider(hosts, 2, tmp_path)
    with Pool(nodes=2, provider=again) as pool:
        assert pool.run("1").values == [1, 1]
    assert again.shipped == []
    wait_for(lambda: not _remote_agents(hosts), 10, "remote ranks to end after close")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"python": "/nonexistent/python3"}, "no Python at"),
        ({"python": "/usr/bin/python3"}, "torch is not installed"),
        ({"identity": "WRONG_KEY"}, "authentication failed"),
        ({"known_hosts": "OTHER_KNOWN_HOSTS"}, "host key is not trusted"),
    ],
)
def test_clear_errors(hosts: Hosts, tmp_path: Path, change: dict[str, str], message: str) -> None:
    if change.get("identity") == "WRONG_KEY":
        key = tmp_path / "wrong"
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
        change = {"identity": str(key)}
    if change.get("known_hosts") == "OTHER_KNOWN_HOSTS":
        other = tmp_path / "known_hosts"
        key = tmp_path / "impostor"
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
        pub = (tmp_path / "impostor.pub").read_text().split()[:2]
        other.write_text(f"[{hosts[0].address}]:{hosts[0].port} {' '.join(pub)}\n")
        change = {"known_hosts": str(other)}
    started = time.monotonic()
    with pytest.raises(ProviderError, match=message) as raised:
        Pool(nodes=1, provider=ssh_provider(hosts, 1, tmp_path, **change)).start()
    assert hosts[0].address in str(raised.value)
    assert time.monotonic() - started < 30


def test_unreachable_and_refused_hosts_are_named(hosts: Hosts, tmp_path: Path) -> None:
    refused = SSHProvider(
        [Host(hosts[0].address, hosts.user, 2299)],
        SSHOptions(identity=str(hosts.client_key), known_hosts=str(hosts.known_hosts)),
    )
    with pytest.raises(ProviderError, match="connection refused on port 2299"):
        Pool(nodes=1, provider=refused).start()
    hosts.down_link(2)
    try:
        started = time.monotonic()
        with pytest.raises(ProviderError, match=f"{hosts[2].address}:{hosts[2].port}: unreachable"):
            Pool(nodes=1, provider=_provider_for(hosts, 2, tmp_path)).start()
        assert time.monotonic() - started < 20
    finally:
        hosts.up_link(2)


def test_a_host_name_that_does_not_resolve_is_named_at_once() -> None:
    """No sshd needed: the name fails before any connection (``.invalid`` never resolves)."""
    provider = SSHProvider([Host("no-such-host.invalid", None, 22)], SSHOptions(connect_timeout=15))
    started = time.monotonic()
    with pytest.raises(ProviderError) as raised:
        Pool(nodes=1, provider=provider).start()
    assert str(raised.value).startswith(
        "no-such-host.invalid: the host name no-such-host.invalid does not resolve ("
    ), raised.value
    assert str(raised.value).endswith("check its spelling, or give the host's IP address")
    assert time.monotonic() - started < 5


def _provider_for(hosts: Hosts, index: int, tmp: Path) -> SSHProvider:
    return SSHProvider(
        [Host(hosts[index].address, hosts.user, hosts[index].port)],
        SSHOptions(
            identity=str(hosts.client_key),
            known_hosts=str(hosts.known_hosts),
            python=sys.executable,
            connect_timeout=3,
            cache_dir=str(tmp / "cache"),
        ),
    )


def test_a_host_dying_mid_cell_ends_the_cell_and_names_it(hosts: Hosts, tmp_path: Path) -> None:
    with Pool(nodes=2, provider=ssh_provider(hosts, 2, tmp_path), heartbeat_timeout=8) as pool:
        pool.run("import time, torch.distributed as dist")
        killer_started = time.monotonic()

        def kill_host_one() -> None:
            wait_for(lambda: len(_remote_ranks(hosts)) == 2, 10, "both ranks")
            hosts.kill_sshd(1)

        killer = threading.Thread(target=kill_host_one)
        killer.start()
        result = pool.run("print('working', flush=True)\ndist.barrier()\ntime.sleep(60)")
        killer.join()
        assert time.monotonic() - killer_started < 40
        lost = {e.rank: e for e in result.errors}
        assert 1 in lost and hosts[1].address in (lost[1].where + lost[1].message)
    # The dead host's rank ends on its own, when its channel closes (at the latest when the
    # notebook's heartbeats stop, 8 s): on a loaded machine that can come after close() returns.
    wait_for(lambda: not _remote_agents(hosts), 20, "every agent on the hosts to end")


def test_a_rank_holding_its_gil_on_a_host_runs_on_and_is_said_busy(
    hosts: Hosts, tmp_path: Path
) -> None:
    """A rank on a host computes in C without letting its GIL go for twice the heartbeat
    timeout: the notebook looks at its process on the host (it runs), leaves it to finish and
    says why it is silent; the cell ends as written.
    """
    provider = ssh_provider(hosts, 1, tmp_path)
    with Pool(nodes=1, procs_per_node=2, provider=provider, heartbeat_timeout=3.0) as pool:
        result, busy = hold_rank_ones_gil(pool)
    assert result.values == ["done", "done"] and not result.lost, result.errors
    assert len(busy) == 1 and "yet its process runs" in busy[0], busy
    assert hosts[0].address in busy[0], busy
    # Its ranks end on the host once their channels close, which may come after close()
    # returns on a loaded machine: the next tests count the ranks on the hosts.
    wait_for(lambda: not _remote_agents(hosts), 20, "every agent on the hosts to end")


def _notebook_script(
    hosts: Hosts, tmp_path: Path, then: str, before: str = "", **pool: object
) -> Path:
    """A notebook process owning a pool on hosts 0 and 2 (host 1's sshd may have been killed
    by a test above): it runs ``before``, starts the pool (with ``pool``'s arguments), runs
    ``then``, and waits to be killed.
    """
    extra = "".join(f", {k}={v!r}" for k, v in pool.items())
    script = tmp_path / "notebook.py"
    script.write_text(
        "import json, sys, time\n"
        "from skyward_jupyter import Pool\n"
        "from skyward_jupyter.providers.ssh import Host, SSHOptions, SSHProvider\n"
        "from tests.lifetime import detach\n"
        f"{before}\n"
        f"hosts = [Host({hosts[0].address!r}, {hosts.user!r}, {hosts[0].port}),"
        f" Host({hosts[2].address!r}, {hosts.user!r}, {hosts[2].port})]\n"
        f"options = SSHOptions(identity={str(hosts.client_key)!r},"
        f" known_hosts={str(hosts.known_hosts)!r}, python={sys.executable!r},"
        f" cache_dir={str(tmp_path / 'cache')!r})\n"
        f"pool = Pool(nodes=2, provider=SSHProvider(hosts, options){extra}).start()\n"
        f"{then}\n"
        "time.sleep(600)\n"
    )
    return script


def _notebook(script: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(script)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
    )


def test_remote_ranks_end_when_the_notebook_is_killed(
    hosts: Hosts, tmp_path: Path, tag: str
) -> None:
    """The kernel's death ends the ranks, and what their cells detached on the hosts."""
    wait_for(lambda: not _remote_agents(hosts), 20, "earlier tests' agents on the hosts to end")
    then = f"print(json.dumps(pool.run(detach({tag!r})).values), flush=True)"
    notebook = _notebook(_notebook_script(hosts, tmp_path, then))
    try:
        assert notebook.stdout is not None
        pids = flat(json.loads(notebook.stdout.readline()))
        assert len(_remote_ranks(hosts)) == 2 and len(pids) == 6
        wait_for(lambda: sorted(running(tag)) == pids, 10, "the detached processes to run")
    finally:
        notebook.kill()
        notebook.wait()
    wait_for(lambda: not _remote_agents(hosts), 30, "remote ranks to end after the notebook died")
    wait_for(lambda: not running(tag), 10, "the detached processes to end with their ranks")


def _templates(hosts: Hosts, i: int) -> list[int]:
    return [pid for pid in agents_among(hosts.pids(i)) if _from_template_name(pid)]


def _from_template_name(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/comm").read_bytes().startswith(b"sky-node-templ")
    except OSError:
        return False


def test_a_hosts_template_ends_when_the_notebook_falls_silent(hosts: Hosts, tmp_path: Path) -> None:
    """A stopped notebook (as its machine cut off by a partition) sends no heartbeat, while the
    connection stays open: the hosts' templates end on their own, after as long as the ranks
    (``--heartbeat-timeout`` raises both), and with them.
    """
    script = _notebook_script(
        hosts,
        tmp_path,
        "print('ready', flush=True)",
        # the ranks' floor, lowered so that the test waits seconds, not half a minute
        before="import skyward_jupyter.providers.base as base; base.NOTEBOOK_SILENCE = 3.0",
        heartbeat_timeout=4.5,
    )
    notebook = _notebook(script)
    try:
        assert notebook.stdout is not None
        assert notebook.stdout.readline().strip() == "ready"
        templates = _templates(hosts, 0) + _templates(hosts, 2)
        assert len(templates) == 2
        for pid in templates:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            assert argv[argv.index(b"--heartbeat-timeout") + 1] == b"4.5"  # the ranks' value
        notebook.send_signal(signal.SIGSTOP)
        wait_for(
            lambda: not _remote_agents(hosts),
            20,
            "the templates and ranks to end without the notebook's heartbeat",
        )
    finally:
        notebook.kill()
        notebook.wait()


def test_host_strings_parse() -> None:
    assert Host.parse("alice@gpu1:2222") == Host("gpu1", "alice", 2222)
    assert Host.parse("gpu2") == Host("gpu2", None, 22)
    with pytest.raises(ValueError, match="bad port"):
        Host.parse("alice@gpu1:x")
    with pytest.raises(ProviderError, match="at least one"):
        SSHProvider([])


def test_sky_hosts_cell_in_a_real_kernel(hosts: Hosts, tmp_path: Path) -> None:
    """A notebook as users write one: a module and a data file beside it, the module imported in
    a notebook cell and used in a %%sky cell, then edited. The hosts do not see the notebook's
    directory: it travels, the ranks run in their copy, and the edited module is re-imported.
    """
    from .test_magics import Kernel

    (tmp_path / "mymod.py").write_text("def greet():\n    return 'hello'\n")
    (tmp_path / "data.csv").write_text("a,b\n1,2\n")
    kernel = Kernel(cwd=tmp_path)
    try:
        kernel.ok("%load_ext skyward_jupyter")
        kernel.ok("import mymod")
        targets = ",".join(f"{hosts.user}@{hosts[i].address}:{hosts[i].port}" for i in (0, 2))
        options = (
            f"--hosts {targets} --identity {hosts.client_key} --known-hosts {hosts.known_hosts}"
            f" --python {sys.executable}"
        )
        cell = kernel.ok(f"%%sky {options}\n{ALL_REDUCE}")
        assert "(3.0, 2," in " ".join(cell.shown), str(cell)
        used = kernel.ok(
            "%%sky --all\n(mymod.greet(), open('data.csv').read().split()[1], "
            "__import__('os').getcwd().startswith(__import__('os').path.expanduser('~')))"
        )
        assert " ".join(used.shown).count("('hello', '1,2', True)") == 2, str(used)
        (tmp_path / "mymod.py").write_text("def greet():\n    return 'edited'\n")
        edited = kernel.ok("%%sky --all\nmymod.greet()")
        assert " ".join(edited.shown).count("edited") == 2, str(edited)
        status = kernel.ok("%sky status").stdout
        assert "ssh to" in status and hosts[2].address in status
        kernel.ok("%sky down")
        wait_for(lambda: not _remote_agents(hosts), 20, "remote ranks to end after %sky down")
    finally:
        kernel.km.shutdown_kernel(now=True)
        kernel.kc.stop_channels()


def test_a_failed_replacement_of_an_ssh_pool_is_named_not_replaced_by_the_default(
    hosts: Hosts, tmp_path: Path
) -> None:
    """Off the notebook's machine the old pool ends before its replacement starts. A description
    that cannot work (a key file that is not there) is refused before the pool is touched; one
    that fails only as it starts (no Python at --python) leaves no pool, and the next cell or
    ``%sky run`` without options fails in one line naming it, rather than start the 1-node local
    default; ``%sky down`` forgets it.
    """
    from .test_magics import Kernel

    (tmp_path / "train.py").write_text("print('THE SCRIPT RAN')\n")
    # host 1's sshd was killed by an earlier test of this module
    targets = ",".join(f"{hosts.user}@{hosts[i].address}:{hosts[i].port}" for i in (0, 2))

    def options(identity: Path = hosts.client_key, python: str = sys.executable) -> str:
        return (
            f"--hosts {targets} --identity {identity} --known-hosts {hosts.known_hosts}"
            f" --python {python}"
        )

    world = "%%sky --all\nimport os, torch.distributed as d\n(os.getpid(), d.get_world_size())"
    kernel = Kernel(cwd=tmp_path)
    try:
        kernel.ok("%load_ext skyward_jupyter")
        kernel.ok(f"%%sky {options()}\npass")
        before = kernel.ok(world).per_rank
        assert len(before) == 2 and all(v.endswith(", 2)") for v in before.values()), before

        missing = tmp_path / "no_such_key"
        refused = kernel.fails(f"%%sky {options(identity=missing)}\nprint('THE CELL RAN')")
        assert refused.reply["evalue"] == (
            f"--identity {missing}: cannot read it (No such file or directory); name a file "
            "this user can read"
        ), str(refused)
        assert "replacing" not in refused.stderr and "THE CELL RAN" not in refused.stdout
        assert kernel.ok(world).per_rank == before, "the refused description touched the pool"

        shared = tmp_path / "shared_key"  # a private key others can read: ssh refuses it
        shared.write_bytes(hosts.client_key.read_bytes())
        shared.chmod(0o644)
        refused = kernel.fails(f"%%sky {options(identity=shared)}\nprint('THE CELL RAN')")
        assert refused.reply["evalue"] == (
            f"--identity {shared}: other users can read this private key (mode 0644); make it "
            f"yours alone: chmod 600 {shared}"
        ), str(refused)
        first = targets.split(",")[0]
        twice = kernel.fails(f"%%sky --hosts {first},{first}\nprint('THE CELL RAN')")
        assert f"{first} and {first} are the same host" in twice.reply["evalue"], str(twice)
        assert kernel.ok(world).per_rank == before, "a refused description touched the pool"

        failed = kernel.fails(f"%%sky {options(python='/nonexistent/python3')}\nprint(1)")
        assert "no Python at" in failed.reply["evalue"], str(failed)
        assert re.search(
            r"pool 'default': 2 nodes x 1 rank per GPU or CPU, ssh to .* did not start, and no "
            r"pool 'default' is left; cells without pool options refuse to run until it starts",
            # said where the start was said: its line ("starting ...") turns into the outcome
            "\n".join([failed.stderr, *failed.status_line]),
        ), str(failed)
        for code in ("%%sky\nprint('THE CELL RAN')", "%sky run train.py"):
            cell = kernel.fails(code)
            assert cell.reply["ename"] == "UsageError", str(cell)
            assert re.fullmatch(
                r"pool 'default' did not start as 2 nodes x 1 rank per GPU or CPU, ssh to \S+, "
                r"\S+ \(.*--python /nonexistent/python3.*\) and no other pool "
                r"runs in its place: give those pool options again to retry, or %sky down "
                r"default to forget them",
                cell.reply["evalue"],
            ), str(cell)
            assert "RAN" not in cell.stdout and "starting" not in cell.stderr, str(cell)
        status = kernel.ok("%sky status").stdout
        assert re.fullmatch(r"\* default: 2 nodes x .*, did not start \(.*\)\n", status), status

        forgot = kernel.ok("%sky down")
        assert "pool 'default': forgot 2 nodes x 1 rank per GPU or CPU" in forgot.stderr
        assert kernel.ok("%sky status").stdout == "no pools\n"
        wait_for(lambda: not _remote_agents(hosts), 20, "remote ranks to end")
    finally:
        kernel.km.shutdown_kernel(now=True)
        kernel.kc.stop_channels()


def test_versions_are_checked() -> None:
    import platform

    import cloudpickle

    from skyward_jupyter.providers.ssh_prepare import check_versions

    host = Host("gpu1", "alice")
    same = {
        "python": platform.python_version(),
        "executable": "/usr/bin/python3",
        "torch": "0.0.1",
        "cloudpickle": cloudpickle.__version__,
    }
    warnings = check_versions(host, same)
    assert any("torch 0.0.1 there" in w for w in warnings)
    with pytest.raises(ProviderError, match=r"alice@gpu1: Python 2\.7\.18 there"):
        check_versions(host, {**same, "python": "2.7.18"})
    with pytest.raises(ProviderError, match=r"cloudpickle 1\.0\.0 there"):
        check_versions(host, {**same, "cloudpickle": "1.0.0"})


def test_a_network_drop_mid_cell_ends_the_cell_in_bounded_time(
    hosts: Hosts, tmp_path: Path
) -> None:
    provider = SSHProvider(
        [Host(hosts[i].address, hosts.user, hosts[i].port) for i in (0, 2)],
        SSHOptions(
            identity=str(hosts.client_key),
            known_hosts=str(hosts.known_hosts),
            python=sys.executable,
            cache_dir=str(tmp_path / "cache"),
            keepalive_interval=2,
        ),
    )
    with Pool(nodes=2, provider=provider, heartbeat_timeout=6) as pool:
        pool.run("import time, torch.distributed as dist")

        def drop_host_two() -> None:
            wait_for(lambda: len(_remote_ranks(hosts)) >= 2, 10, "both ranks")
            hosts.down_link(2)

        dropper = threading.Thread(target=drop_host_two)
        started = time.monotonic()
        dropper.start()
        try:
            result = pool.run("dist.barrier()\ntime.sleep(60)")
            assert time.monotonic() - started < 40
            lost = {e.rank: e for e in result.errors}
            assert 1 in lost and hosts[2].address in (lost[1].where + lost[1].message)
            # The restart waits for the host's connection timeout: the cell does not.
            assert f"the pool is still starting rank 1 on {hosts[2].address} again" in str(
                result.notes
            ), result.notes
            # While the host stays unreachable, a cell says which rank is missing, where, why.
            with pytest.raises(PoolError) as missing:
                pool.run("1")
            said = str(missing.value)
            assert said.startswith(f"pool 'default' has lost rank 1 on {hosts[2].address}"), said
            assert "unreachable" in said and "%sky restart once that machine answers" in said
        finally:
            dropper.join()
            hosts.up_link(2)
    wait_for(lambda: not _remote_agents(hosts), 30, "remote ranks to end")


def test_hosts_whose_hostname_is_loopback_form_a_group_on_the_route_to_the_head(
    hosts: Hosts, tmp_path: Path
) -> None:
    """The hosts resolve their own hostname to 127.0.1.1 (Debian's default): without choosing
    the interface that routes to the head, gloo would advertise that and never connect.
    """
    probe = hosts.inside_argv(2, "getent", "hosts", hosts.hostnames[2])
    assert subprocess.run(probe, capture_output=True, text=True).stdout.startswith("127.0.1.1")
    with Pool(nodes=2, provider=ssh_provider(hosts, 2, tmp_path, which=(0, 2))) as pool:
        result = pool.run(ALL_REDUCE + ", __import__('os').environ.get('GLOO_SOCKET_IFNAME')")
        assert result.ok, result.errors
        assert [v[0][0] for v in result.values] == [3.0, 3.0]
        assert [v[0][2] for v in result.values] == [hosts.hostnames[0], hosts.hostnames[2]]
        assert [v[1] for v in result.values] == [hosts.interface] * 2


def test_a_group_that_cannot_connect_fails_in_seconds_naming_who_and_what_to_set(
    hosts: Hosts, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The user's own GLOO_SOCKET_IFNAME wins; a wrong one fails at once with the address,
    the port and the variable to set, never a bare exit status or an unretrieved task.
    """
    caplog.set_level(logging.ERROR)
    started = time.monotonic()
    provider = ssh_provider(hosts, 2, tmp_path, which=(0, 2))
    pool = Pool(nodes=2, provider=provider, env={"GLOO_SOCKET_IFNAME": "lo"})
    with pytest.raises(PoolError) as raised:
        pool.start()
    message = str(raised.value)
    assert time.monotonic() - started < 30  # the group's own timeout is 60 s
    assert re.search(r"rank \d cannot reach rank \d at 127\.0\.0\.1:\d+", message), message
    assert "GLOO_SOCKET_IFNAME=lo" in message and "set --env GLOO_SOCKET_IFNAME" in message
    assert "exited with status" not in message
    del pool
    gc.collect()
    assert "never retrieved" not in caplog.text
    wait_for(lambda: not _remote_agents(hosts), 10, "remote ranks to end")


def test_nccl_on_hosts_whose_torch_cannot_run_it_fails_naming_the_host_and_why(
    hosts: Hosts, tmp_path: Path
) -> None:
    """The notebook cannot see a host's torch: each rank says at its start whether it has NCCL
    and GPUs, and the start fails on that, before any group forms, naming the rank's host and
    the cause, not an interface to set.
    """
    skip_where_nccl_runs()
    started = time.monotonic()
    pool = Pool(nodes=2, provider=ssh_provider(hosts, 2, tmp_path, which=(0, 2)), backend="nccl")
    with pytest.raises(PoolError) as raised:
        pool.start()
    message = str(raised.value)
    assert re.fullmatch(
        rf"--backend nccl: rank 0 \(.*{re.escape(hosts[0].address)}.*\) has (torch \S+, which "
        r"is built without NCCL|no GPU that torch can use.*); use --backend gloo.*",
        message,
    ), message
    assert "SOCKET_IFNAME" not in message
    assert time.monotonic() - started < 30  # the group's own timeout is 60 s
    wait_for(lambda: not _remote_agents(hosts), 10, "remote ranks to end")


def test_a_host_allowing_few_sessions_gets_more_connections(tmp_path: Path) -> None:
    """sshd's MaxSessions 2, three ranks on the host: each rank's session (and the kill of a
    stuck one) still opens, on a further connection.
    """
    with ssh_hosts(1, tmp_path, max_sessions=2) as few:
        provider = ssh_provider(few, 1, tmp_path)
        with Pool(nodes=1, procs_per_node=3, provider=provider) as pool:
            result = pool.run(ALL_REDUCE)
            assert result.ok, result.errors
            assert [v[:2] for v in result.values] == [(6.0, 3)] * 3
            assert len(provider._sessions[0].conns) >= 2
            # a stuck rank is killed over a session too
            stuck = pool.run("import time\nif dist.get_rank() == 2: time.sleep(600)", timeout=3)
            assert not stuck.ok
            again = pool.run("dist.get_world_size()")
            assert again.values == [3, 3, 3], again.errors
        wait_for(lambda: not _remote_agents(few), 10, "remote ranks to end")


def _from_template(pid: int) -> bool:
    ppid = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]
    return Path(f"/proc/{ppid}/comm").read_bytes().startswith(b"sky-node-templ")


def test_ranks_are_forked_from_each_hosts_warm_template(hosts: Hosts, tmp_path: Path) -> None:
    """Ranks, and a lost rank's replacement, come from the host's template (torch imported
    once); an environment that changes what torch reads at import starts a rank directly.
    """
    provider = ssh_provider(hosts, 2, tmp_path, which=(0, 2))
    with Pool(nodes=2, provider=provider, heartbeat_timeout=8) as pool:
        first = [r.hello.pid for r in pool.ranks if r.hello]
        assert all(_from_template(pid) for pid in first)
        assert len(_remote_agents(hosts)) == 4  # two templates, two ranks
        pool.run("kept = 1")
        subprocess.run(hosts.inside_argv(2, "kill", "-9", str(first[1])), check=True)
        wait_for(
            lambda: (hello := pool.ranks[1].hello) is not None and hello.pid != first[1],
            30,
            "rank 1 to be replaced",
        )
        replaced = pool.ranks[1].hello
        assert replaced is not None and _from_template(replaced.pid)
        result = pool.run(ALL_REDUCE)
        assert result.ok and [v[:2] for v in result.values] == [(3.0, 2)] * 2
        assert result.lost == (1,)
        before = {r.hello.pid for r in pool.ranks if r.hello}
        pool.restart()  # %sky restart: fresh ranks on the same hosts, from their templates
        after = [r.hello.pid for r in pool.ranks if r.hello]
        assert len(after) == 2 and not before & set(after)
        assert all(_from_template(pid) for pid in after)
        fresh = pool.run(ALL_REDUCE + "\n'kept' in globals()")
        assert fresh.ok and fresh.values == [False, False]
    wait_for(lambda: not _remote_agents(hosts), 10, "ranks and templates to end")
    direct = ssh_provider(hosts, 2, tmp_path, which=(0, 2))
    with Pool(nodes=2, provider=direct, env={"MKL_NUM_THREADS": "1"}) as pool:
        pids = [r.hello.pid for r in pool.ranks if r.hello]
        assert not any(_from_template(pid) for pid in pids)
        assert pool.run(ALL_REDUCE).ok
    wait_for(lambda: not _remote_agents(hosts), 10, "ranks and templates to end")


def test_detached_children_on_hosts_end_with_restart_and_down(
    hosts: Hosts, tmp_path: Path, tag: str
) -> None:
    """``%sky restart`` kills the ranks over the connection, ``%sky down`` asks them to end:
    either way what their cells detached ends with them.
    """
    provider = ssh_provider(hosts, 2, tmp_path, which=(0, 2))
    with Pool(nodes=2, provider=provider, heartbeat_timeout=8) as pool:
        pids = flat(pool.run(detach(tag)).values)
        assert len(pids) == 6
        wait_for(lambda: sorted(running(tag)) == pids, 10, "the detached processes to run")
        pool.restart()
        wait_for(lambda: not running(tag), 10, "the detached processes to end with a restart")
        pids = flat(pool.run(detach(tag)).values)
        wait_for(lambda: sorted(running(tag)) == pids, 10, "the detached processes to run")
    wait_for(lambda: not running(tag), 10, "the detached processes to end with the pool")
    wait_for(lambda: not _remote_agents(hosts), 10, "ranks and templates to end")


def test_a_killed_template_gives_direct_starts_said_in_one_line(
    hosts: Hosts, tmp_path: Path
) -> None:
    provider = ssh_provider(hosts, 2, tmp_path, which=(0, 2))
    with Pool(nodes=2, provider=provider, heartbeat_timeout=8) as pool:
        said: list[str] = []
        pool.subscribe(
            lambda event: said.append(event.text) if isinstance(event, PoolMessage) else None
        )
        (template,) = _templates(hosts, 2)
        subprocess.run(hosts.inside_argv(2, "kill", "-9", str(template)), check=True)
        wait_for(lambda: not _templates(hosts, 2), 10, "host 2's template to die")
        pool.restart()
        after = [r.hello.pid for r in pool.ranks if r.hello]
        assert _from_template(after[0]) and not _from_template(after[1])
        assert pool.run(ALL_REDUCE).ok
        pool.restart()  # said once, not at every start
        gone = [text for text in said if "template" in text]
        host = provider.hosts[1]
        assert gone == [f"the warm template on {host} is gone; its ranks now start directly"]
    wait_for(lambda: not _remote_agents(hosts), 10, "ranks and templates to end")


def _private_dir(pool: Pool) -> str:
    """Rank 0's private directory (its torch error file's)."""
    found = pool.run(
        "__import__('os').path.dirname(__import__('os').environ['TORCHELASTIC_ERROR_FILE'])"
    )
    return str(found.values[0])


def _exists_on(hosts: Hosts, i: int, path: str) -> bool:
    return subprocess.run(hosts.inside_argv(i, "test", "-e", path), check=False).returncode == 0


def test_private_directories_on_a_host_go_with_a_kill_and_with_the_template(
    hosts: Hosts, tmp_path: Path
) -> None:
    """A rank's private directory goes when the pool kills the rank (``%sky restart``), and one
    that nobody could remove (its rank killed on the host, as by the OOM killer) goes with the
    host's template at the pool's end.
    """
    provider = ssh_provider(hosts, 1, tmp_path, which=(0,))
    with Pool(nodes=1, provider=provider, heartbeat_timeout=8) as pool:
        first = _private_dir(pool)
        parent = str(Path(first).parent)
        assert parent.endswith(f"skyward-{pool.run_id}") and _exists_on(hosts, 0, first)
        pool.restart()
        second = _private_dir(pool)
        assert second != first and _exists_on(hosts, 0, second)
        assert not _exists_on(hosts, 0, first)
        killed = pool.ranks[0].hello
        assert killed is not None
        subprocess.run(hosts.inside_argv(0, "kill", "-9", str(killed.pid)), check=True)
        wait_for(
            lambda: (hello := pool.ranks[0].hello) is not None and hello.pid != killed.pid,
            30,
            "rank 0 to be replaced",
        )
        assert pool.run("1").ok and _exists_on(hosts, 0, second)  # nobody removed it yet
    wait_for(lambda: not _remote_agents(hosts), 10, "ranks and templates to end")
    assert not _exists_on(hosts, 0, parent)


RECORDED = """\
import os
from torch.distributed.elastic.multiprocessing.errors import record


@record
def main() -> None:
    raise ValueError(os.environ["TORCHELASTIC_ERROR_FILE"])


if __name__ == "__main__":
    main()
"""


def test_a_script_runs_record_error_file_is_private_and_goes_with_the_pool(
    hosts: Hosts, tmp_path: Path
) -> None:
    """On a host as locally: ``@record`` writes the run's own error file, 0600 in the rank's
    private directory, and the file is gone once the pool is.
    """
    script = tmp_path / "recorded.py"
    script.write_text(RECORDED)
    provider = ssh_provider(hosts, 1, tmp_path, which=(0,))
    with Pool(nodes=1, provider=provider, heartbeat_timeout=8) as pool:
        private = _private_dir(pool)
        failed = pool.run(RECORDED, filename=str(script), script=Script(str(script)), timeout=60)
        assert not failed.ok and failed.errors[0].type_name == "ValueError", failed.errors
        error_file = failed.errors[0].message
        assert str(Path(error_file).parent.parent) == private, error_file
        mode = subprocess.run(
            hosts.inside_argv(0, "stat", "-c", "%a", error_file),
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
        assert mode == "600"
    wait_for(lambda: not _remote_agents(hosts), 10, "ranks and templates to end")
    assert not _exists_on(hosts, 0, error_file)

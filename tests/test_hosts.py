"""The SSH test hosts (tests/hosts.py): real sshds in network namespaces, reachable from here and
from each other, with gloo working between them; kill/partition helpers; nothing left after.
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import asyncssh
import pytest

from .conftest import wait_for
from .hosts import REGISTRY, Hosts, available, netns_pids, reap_stale, ssh_hosts

pytestmark = pytest.mark.skipif(available() is not None, reason=f"ssh hosts: {available()}")

PYTHON = sys.executable  # the project's venv, which the hosts see at the same path
T = TypeVar("T")
REPO = Path(__file__).resolve().parents[1]


def run(coro: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
    """Run a coroutine to completion, failing after ``timeout`` seconds."""

    async def bounded() -> T:
        return await asyncio.wait_for(coro, timeout)

    return asyncio.run(bounded())


def py(code: str) -> str:
    """A shell command running ``code`` with the venv's python."""
    return f"{shlex.quote(PYTHON)} -c {shlex.quote(textwrap.dedent(code))}"


def namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    return [line.split()[0] for line in out.stdout.splitlines() if line.strip()]


def leftovers(hosts: Hosts) -> list[str]:
    """What of ``hosts`` still exists on this machine (empty once it is torn down)."""
    left = []
    left += [ns for ns in namespaces() if any(ns == h.namespace for h in hosts)]
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True)
    for name in [hosts.bridge, *(h.veth for h in hosts)]:
        if f" {name}:" in links.stdout or f" {name}@" in links.stdout:
            left.append(name)
    for h in hosts:
        if Path(f"/etc/netns/{h.namespace}").exists():
            left.append(f"/etc/netns/{h.namespace}")
        stat = Path(f"/proc/{h.sshd_pid}/stat")
        if stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] != "Z":
            left.append(f"sshd pid {h.sshd_pid}")
    # any process still running one of our sshd configs
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdline = (proc / "cmdline").read_bytes()
            except OSError:
                continue
            if str(hosts.client_key.parent).encode() in cmdline:
                left.append(f"pid {proc.name}: {cmdline!r}")
    return left


@pytest.fixture(scope="module")
def hosts2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hosts]:
    with ssh_hosts(2, tmp_path_factory.mktemp("hosts2")) as hosts:
        yield hosts
    assert not leftovers(hosts)


def test_connects_to_each_host_with_strict_host_keys(hosts2: Hosts) -> None:
    async def go() -> list[tuple[str, str]]:
        out = []
        for i in range(len(hosts2)):
            async with asyncssh.connect(**hosts2.asyncssh_options(i)) as conn:
                ips = await conn.run("hostname -I", check=True, timeout=10)
                imported = await conn.run(
                    py("import torch; print(torch.__version__)"), check=True, timeout=60
                )
                out.append((str(ips.stdout).split()[0], str(imported.stdout)))
        return out

    results = run(go())
    assert [ip for ip, _ in results] == hosts2.addresses
    assert all(version.strip() for _, version in results)


def test_a_private_host_is_an_ordinary_machine(hosts2: Hosts, tmp_path: Path) -> None:
    """Its own hostname on 127.0.1.1, an unprivileged login with a private home, its own /tmp,
    and none of the notebook's files: not this test's, not the project's checkout.
    """
    (tmp_path / "beside_the_notebook.txt").write_text("here")
    check = py(f"""
        import json, os, pathlib, socket
        home = pathlib.Path.home()
        (home / "mine").write_text("x")
        print(json.dumps({{
            "uid": os.getuid(),
            "resolves": socket.gethostbyname(socket.gethostname()),
            "hostname": socket.gethostname(),
            "home": str(home),
            "tmp": sorted(os.listdir("/tmp")),
            "project": sorted(os.listdir({str(REPO)!r})),
            "notebook_file": os.path.exists({str(tmp_path / "beside_the_notebook.txt")!r}),
            "package": __import__("importlib.util").util.find_spec("skyward_jupyter") is not None,
        }}))
    """)

    async def go() -> list[dict[str, Any]]:
        out = []
        for i in range(len(hosts2)):
            async with asyncssh.connect(**hosts2.asyncssh_options(i)) as conn:
                done = await conn.run(check, check=True, timeout=60)
                out.append(json.loads(str(done.stdout)))
        return out

    for i, seen in enumerate(run(go())):
        assert seen["uid"] != 0 and hosts2.user != "root"
        assert seen["resolves"] == "127.0.1.1"
        assert seen["hostname"] == hosts2.hostnames[i]
        assert seen["home"] == f"/home/{hosts2.user}"
        # Only the way to the venv, which the ranks need, is in /tmp when the checkout is there.
        venv = Path(sys.prefix).resolve()
        kept = [venv.relative_to("/tmp").parts[0]] if venv.is_relative_to("/tmp") else []
        assert seen["tmp"] == kept
        assert seen["project"] == ([".venv"] if venv.parent == REPO else [])
        assert not seen["notebook_file"] and not seen["package"]
    assert not (Path("/home") / hosts2.user / "mine").exists()


def test_a_host_key_not_in_known_hosts_is_refused(hosts2: Hosts, tmp_path: Path) -> None:
    only_first = tmp_path / "known_hosts"
    only_first.write_text(hosts2.known_hosts.read_text().splitlines()[0] + "\n")
    options = {**hosts2.asyncssh_options(1), "known_hosts": str(only_first)}

    async def go() -> None:
        async with asyncssh.connect(**options):
            pass

    with pytest.raises(asyncssh.HostKeyNotVerifiable):
        run(go(), timeout=10)


def test_the_openssh_client_works_too(hosts2: Hosts) -> None:
    done = subprocess.run(
        hosts2.ssh_argv(1, "hostname -I"), capture_output=True, text=True, timeout=20
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [hosts2[1].address]


def test_ip_netns_exec_runs_the_venv(hosts2: Hosts) -> None:
    done = subprocess.run(
        hosts2.inside_argv(0, PYTHON, "-c", "import torch"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr


def test_a_process_on_host_a_reaches_host_b_over_tcp(hosts2: Hosts) -> None:
    a, b = hosts2[0], hosts2[1]
    server = py(f"""
        import socket
        s = socket.socket()
        s.bind(({b.address!r}, 0))
        s.listen(1)
        print(s.getsockname()[1], flush=True)
        c, peer = s.accept()
        c.sendall(c.recv(100).upper() + b" from " + peer[0].encode())
        c.close()
    """)

    async def go() -> tuple[str, int | None]:
        async with (
            asyncssh.connect(**hosts2.asyncssh_options(0)) as conn_a,
            asyncssh.connect(**hosts2.asyncssh_options(1)) as conn_b,
        ):
            proc = await conn_b.create_process(server)
            port = int(await asyncio.wait_for(proc.stdout.readline(), 30))
            client = py(f"""
                import socket
                with socket.create_connection(({b.address!r}, {port}), timeout=10) as s:
                    s.sendall(b"ping")
                    print(s.recv(100).decode())
            """)
            reply = await conn_a.run(client, check=True, timeout=30)
            done = await asyncio.wait_for(proc.wait(), 10)
            return str(reply.stdout).strip(), done.exit_status

    reply, status = run(go())
    assert reply == f"PING from {a.address}"
    assert status == 0


GLOO_RANK = """
    import sys
    from datetime import timedelta
    import torch
    import torch.distributed as dist
    rank, url = int(sys.argv[1]), sys.argv[2]
    dist.init_process_group(
        "gloo", init_method=url, rank=rank, world_size=2, timeout=timedelta(seconds=30)
    )
    t = torch.full((4,), float(rank + 1))
    dist.all_reduce(t)
    print(t.tolist(), flush=True)
    dist.destroy_process_group()
"""


def test_gloo_all_reduce_between_namespaces(hosts2: Hosts) -> None:
    """Both ranks launched over SSH. The hosts' hostnames resolve to 127.0.1.1, so, as on a
    real Debian host, gloo must be told the interface (GLOO_SOCKET_IFNAME).
    """
    a = hosts2[0]
    free_port = py(f"""
        import socket
        s = socket.socket()
        s.bind(({a.address!r}, 0))
        print(s.getsockname()[1])
    """)

    async def go() -> list[str]:
        async with (
            asyncssh.connect(**hosts2.asyncssh_options(0)) as conn_a,
            asyncssh.connect(**hosts2.asyncssh_options(1)) as conn_b,
        ):
            port = int(str((await conn_a.run(free_port, check=True, timeout=30)).stdout))
            url = f"tcp://{a.address}:{port}"
            ranks = [
                conn.run(
                    f"GLOO_SOCKET_IFNAME={hosts2.interface} {py(GLOO_RANK)} {rank} {url}",
                    timeout=90,
                )
                for rank, conn in enumerate([conn_a, conn_b])
            ]
            results = await asyncio.gather(*ranks)
            for r in results:
                assert r.exit_status == 0, r.stderr
            return [str(r.stdout).strip() for r in results]

    assert run(go(), timeout=120) == ["[3.0, 3.0, 3.0, 3.0]"] * 2


def test_kill_sshd_ends_the_host(tmp_path: Path) -> None:
    with ssh_hosts(1, tmp_path) as hosts:

        async def go() -> None:
            async with asyncssh.connect(**hosts.asyncssh_options(0)) as conn:
                # A session process, so there is more than sshd in the namespace.
                proc = await conn.create_process("echo $$; exec sleep 600")
                session_pid = int(await asyncio.wait_for(proc.stdout.readline(), 10))
                assert session_pid in hosts.pids(0)
                assert hosts[0].sshd_pid in hosts.pids(0)

                killed = hosts.kill_sshd(0)
                assert {hosts[0].sshd_pid, session_pid} <= killed
                assert not hosts.pids(0)
                # The open connection notices: the kernel resets the socket.
                await asyncio.wait_for(conn.wait_closed(), 10)

            started = time.monotonic()
            with pytest.raises(OSError):  # ConnectionRefusedError: nothing listens any more
                await asyncssh.connect(**hosts.asyncssh_options(0), connect_timeout=5)
            assert time.monotonic() - started < 2

        run(go(), timeout=30)
    assert not leftovers(hosts)


def test_down_link_partitions_and_up_link_heals(tmp_path: Path) -> None:
    with ssh_hosts(1, tmp_path) as hosts:

        async def go() -> None:
            hosts.down_link(0)
            started = time.monotonic()
            with pytest.raises((asyncio.TimeoutError, OSError)):
                await asyncssh.connect(**hosts.asyncssh_options(0), connect_timeout=1)
            assert time.monotonic() - started >= 0.9  # dropped silently, not refused
            assert hosts[0].sshd_pid in hosts.pids(0)  # the host itself is fine

            hosts.up_link(0)
            async with asyncssh.connect(**hosts.asyncssh_options(0), connect_timeout=10) as c:
                assert (await c.run("echo ok", check=True, timeout=10)).stdout == "ok\n"

        run(go(), timeout=30)
    assert not leftovers(hosts)


def test_nothing_is_left_after_an_exception(tmp_path: Path) -> None:
    with pytest.raises(ZeroDivisionError), ssh_hosts(2, tmp_path) as hosts:
        # a stray process in a namespace, not started by sshd
        subprocess.Popen(hosts.netns_argv(1, "sleep", "600"), start_new_session=True)
        wait_for(lambda: len(hosts.pids(1)) == 2, 10, "the stray process")
        1 / 0  # noqa: B018
    assert not leftovers(hosts)
    assert not netns_pids(hosts[1].namespace)


def test_a_killed_run_is_cleaned_up_by_the_next(tmp_path: Path) -> None:
    """A run SIGKILLed inside the context leaves its hosts; ``reap_stale`` (which every
    ``ssh_hosts`` calls first) removes them.
    """
    child = subprocess.Popen(
        [
            PYTHON,
            "-c",
            textwrap.dedent(f"""
                import sys
                from pathlib import Path
                from tests.hosts import ssh_hosts
                with ssh_hosts(1, Path({str(tmp_path)!r})) as hosts:
                    print(hosts[0].namespace, hosts.bridge, hosts[0].sshd_pid, flush=True)
                    sys.stdin.read()
            """),
        ],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        namespace, bridge, sshd_pid = child.stdout.readline().split()
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(10)
    assert (
        namespace in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    )
    assert os.path.exists(f"/proc/{sshd_pid}")
    tag = bridge[len("skb") :]
    assert (REGISTRY / f"{tag}.json").exists()

    assert tag in reap_stale()
    assert (
        namespace
        not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    )
    assert bridge not in subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert not netns_pids(namespace)
    assert not (REGISTRY / f"{tag}.json").exists()

"""A ``--secure`` pool's rank-to-rank traffic is the pool's: on SSH test hosts in network
namespaces (tests/hosts.py), what crosses the head host's link is captured as an observer of the
network would (a raw socket) and holds no cleartext of a tensor the ranks exchange, the ranks'
gloo listens on loopback only, and a host on the network that does not hold the pool's key gets
no connection through a rank's tunnel. The same capture of a pool without ``--secure`` sees the
tensor: the capture would notice.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from skyward_jupyter import Pool
from skyward_jupyter.agent import pool_tls
from skyward_jupyter.agent.gloo_tunnel import DIAL, MAX_HANDSHAKES, WAIT, GlooTunnel
from skyward_jupyter.relay_keys import RelaySecrets

from .conftest import ssh_hosts_fixture
from .hosts import Hosts, ssh_provider

SO_RCVBUFFORCE = 33  # linux/socket.h: a receive buffer beyond rmem_max, for root
MARK = b"cleartext-of-the-pool!"
SENDS_THE_MARK = (
    "import torch, torch.distributed as dist\n"
    f"mark = torch.frombuffer(bytearray({MARK!r} * 40000), dtype=torch.uint8).clone()\n"
    "got = mark if dist.get_rank() == 0 else torch.zeros_like(mark)\n"
    "dist.broadcast(got, src=0)\n"
    "group = dist.new_group([0, 1])\n"
    "total = torch.ones(3)\n"
    "dist.all_reduce(total, group=group)\n"
    "bool(torch.equal(got, mark)), total.tolist()"
)
LISTENING = (
    "import os\n"
    "from torch.distributed import distributed_c10d as c10d\n"
    "store = c10d._get_default_store()\n"
    "while hasattr(store, 'underlying_store'):\n"
    "    store = store.underlying_store\n"
    "mine = set()\n"
    "for fd in os.listdir('/proc/self/fd'):\n"
    "    target = os.readlink(f'/proc/self/fd/{fd}') if os.path.exists(f'/proc/self/fd/{fd}') "
    "else ''\n"
    "    if target.startswith('socket:['):\n"
    "        mine.add(target[8:-1])\n"
    "listening = []\n"
    "for line in open('/proc/net/tcp').read().splitlines()[1:]:\n"
    "    f = line.split()\n"
    "    if f[3] == '0A' and f[9] in mine:\n"
    "        ip, port = f[1].split(':')\n"
    "        address = '.'.join(str(int(ip[i:i + 2], 16)) for i in (6, 4, 2, 0))\n"
    "        listening.append((address, int(port, 16)))\n"
    "extra = {store.port} if store.server is not None else set()\n"
    "sorted(listening), store.tunnel.port, sorted(extra)"
)


class Capture:
    """Every frame that crosses ``interface`` (a raw socket: what an observer of the link sees)."""

    def __init__(self, interface: str) -> None:
        self._sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003))
        self._sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 64 << 20)  # drop none
        self._sock.bind((interface, 0))
        self._sock.settimeout(0.2)
        self.bytes = 0
        self.seen = False
        self._running = True
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while self._running:
            try:
                frame = self._sock.recv(1 << 18)  # offloads make frames of up to 64 KiB and more
            except TimeoutError:
                continue
            self.bytes += len(frame)
            self.seen = self.seen or MARK in frame

    def close(self) -> None:
        self._running = False
        self._thread.join(10)
        assert not self._thread.is_alive()
        self._sock.close()


hosts = ssh_hosts_fixture(3, "hosts")


@contextlib.contextmanager
def captured(hosts: Hosts) -> Iterator[Capture]:
    capture = Capture(hosts[0].veth)  # the head host's link, as its switch port sees it
    try:
        yield capture
    finally:
        capture.close()


def test_a_secure_pools_tensors_cross_the_network_encrypted(hosts: Hosts, tmp_path: Path) -> None:
    provider = ssh_provider(hosts, 2, tmp_path)
    with Pool(nodes=2, provider=provider, heartbeat_timeout=10, secure=True) as pool:
        with captured(hosts) as capture:
            result = pool.run(SENDS_THE_MARK)
            result.raise_for_errors()
        assert result.values == [(True, [2.0, 2.0, 2.0])] * 2
        assert capture.bytes > len(MARK) * 40000  # the broadcast crossed this link
        assert not capture.seen


def test_without_secure_the_capture_sees_the_tensor(hosts: Hosts, tmp_path: Path) -> None:
    """The capture above would have seen cleartext: the same exchange without ``--secure``."""
    provider = ssh_provider(hosts, 2, tmp_path)
    with Pool(nodes=2, provider=provider, heartbeat_timeout=10) as pool:
        with captured(hosts) as capture:
            pool.run(SENDS_THE_MARK).raise_for_errors()
        assert capture.seen


def test_gloo_listens_on_loopback_and_the_tunnel_admits_only_the_pools_key(
    hosts: Hosts, tmp_path: Path
) -> None:
    provider = ssh_provider(hosts, 2, tmp_path)
    with Pool(nodes=2, provider=provider, heartbeat_timeout=10, secure=True) as pool:
        result = pool.run(LISTENING)
        result.raise_for_errors()
        for rank, (listening, tunnel, store) in enumerate(result.values):
            host = hosts[rank].address
            outside = {port for address, port in listening if not address.startswith("127.")}
            # on the network: the tunnel, the node's relay (each node's first rank: here every
            # rank) and on the head the store, alone
            assert tunnel in outside
            hello = pool.ranks[rank].hello
            relay = {hello.relay_port} if hello and hello.relay_port else set()
            assert outside == {tunnel, *store, *relay}, (host, listening)
            assert any(address == "127.0.0.1" for address, _ in listening)  # gloo's
        tunnel = result.values[0][1]
        done = subprocess.run(
            [*hosts.netns_argv(2), sys.executable, "-c", ATTACK, hosts[0].address, str(tunnel)],
            capture_output=True,
            text=True,
            timeout=60,
            cwd="/",
            env={"PATH": os.environ["PATH"], "PYTHONPATH": str(Path(__file__).parents[1])},
        )
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.split() == ["refused", "refused", "refused"], done.stdout
        pool.run(SENDS_THE_MARK).raise_for_errors()  # the pool is unharmed


ATTACK = """
import socket, ssl, sys
from skyward_jupyter.relay_keys import RelaySecrets
from skyward_jupyter.agent import pool_tls
host, port = sys.argv[1], int(sys.argv[2])
def attempt(context):
    try:
        with socket.create_connection((host, port), timeout=10) as plain:
            if context is None:
                plain.sendall(b"\\x00\\x50" + b"garbage" * 100)
                print("refused" if plain.recv(1) == b"" else "answered")
                return
            conn = context.wrap_socket(plain)
            conn.sendall(b"\\x00\\x50")
            print("refused" if conn.recv(1) == b"" else "answered")
    except (OSError, ssl.SSLError):
        print("refused")
other = RelaySecrets.make(True)
no_cert = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
no_cert.check_hostname = False
no_cert.verify_mode = ssl.CERT_NONE
attempt(None)                                              # cleartext
attempt(no_cert)                                           # TLS, no certificate
attempt(pool_tls.client_context(other.cert, other.key))    # another pool's key
"""


# --------------------------------------------------- the records gloo reads, on their own


def _record(host: str, port: int, name: bytes = b"host") -> bytes:
    """gloo's ``Rank`` record as it publishes one: hostname, address, pair identifiers."""
    address = bytearray(136)
    address[0:2] = socket.AF_INET.to_bytes(2, sys.byteorder)
    address[2:4] = port.to_bytes(2, "big")
    address[4:8] = socket.inet_aton(host)
    address[128:136] = (-1).to_bytes(8, sys.byteorder, signed=True)
    length = len(name).to_bytes(8, sys.byteorder)
    return length + name + (136).to_bytes(8, sys.byteorder) + bytes(address) + bytes(16)


def _address(record: bytes) -> tuple[str, int]:
    at = 16 + 4  # the lengths and the 4-byte hostname "host"
    return socket.inet_ntoa(record[at + 4 : at + 8]), int.from_bytes(record[at + 2 : at + 4], "big")


def _dials(own: tuple[str, int], peer: tuple[str, int]) -> bool:
    """gloo's choice (``Device::isInitiator``): the side whose own address is larger dials."""
    return (socket.inet_aton(own[0]), own[1]) > (socket.inet_aton(peer[0]), peer[1])


@pytest.fixture
def tunnels() -> Iterator[list[GlooTunnel]]:
    keys = RelaySecrets.make(True)
    assert keys.cert and keys.key
    made = [GlooTunnel(f"127.0.0.{i}", keys.cert, keys.key) for i in (3, 4, 3)]
    try:
        yield made
    finally:
        for tunnel in made:
            tunnel.close()


@pytest.mark.parametrize("ports", [(40000, 50000), (50000, 40000), (40000, 40000)])
def test_exactly_one_side_of_a_pair_across_hosts_dials(
    tunnels: list[GlooTunnel], ports: tuple[int, int]
) -> None:
    a, b = tunnels[0], tunnels[1]
    key_a, key_b = "pg/0", "pg/1"
    stored_a = a.published(key_a, _record("127.0.0.1", ports[0]))
    stored_b = b.published(key_b, _record("127.0.0.1", ports[1]))
    assert _address(stored_a) == ("127.0.0.3", ports[0])  # what others see: the host
    seen_by_a = _address(a.fetched(key_b, stored_b))
    seen_by_b = _address(b.fetched(key_a, stored_a))
    a_dials = _dials(("127.0.0.1", ports[0]), seen_by_a)
    b_dials = _dials(("127.0.0.1", ports[1]), seen_by_b)
    assert a_dials != b_dials
    dialled = seen_by_a if a_dials else seen_by_b
    waited = seen_by_b if a_dials else seen_by_a
    assert dialled[0] == DIAL and dialled[1] != 0  # a tunnel port of the dialling rank
    assert waited[0] == WAIT


def test_a_peer_on_the_same_host_is_dialled_directly(tunnels: list[GlooTunnel]) -> None:
    a, same_host = tunnels[0], tunnels[2]
    stored = same_host.published("pg/2", _record("127.0.0.1", 41000))
    a.published("pg/0", _record("127.0.0.1", 42000))
    assert _address(a.fetched("pg/2", stored)) == ("127.0.0.1", 41000)


def test_a_tunnel_carries_to_its_own_ranks_gloo_ports_alone(tunnels: list[GlooTunnel]) -> None:
    """Even a holder of the pool's key reaches only the gloo listeners of the tunnel's rank."""
    keys = RelaySecrets.make(True)
    assert keys.cert and keys.key
    tunnel = GlooTunnel("127.0.0.5", keys.cert, keys.key)
    context = pool_tls.client_context(keys.cert, keys.key)
    try:
        with (
            socket.create_server(("127.0.0.1", 0)) as gloo,
            socket.create_server(("127.0.0.1", 0)) as other,
        ):
            gloo.settimeout(10)
            other.settimeout(0.5)
            tunnel.published("pg/0", _record("127.0.0.1", gloo.getsockname()[1]))
            for target, expect in ((other, False), (gloo, True)):
                plain = socket.create_connection(("127.0.0.5", tunnel.port), timeout=10)
                with context.wrap_socket(plain) as conn:
                    conn.sendall(target.getsockname()[1].to_bytes(2, "big") + b"hello")
                    if expect:
                        accepted, _ = target.accept()
                        with accepted:
                            assert accepted.recv(5) == b"hello"
                    else:
                        assert conn.recv(1) == b""  # closed without carrying anything
                        with pytest.raises(TimeoutError):
                            target.accept()
    finally:
        tunnel.close()


def test_a_tunnel_port_on_loopback_carries_its_own_ranks_gloo_alone(
    tunnels: list[GlooTunnel],
) -> None:
    """Loopback is open to every process of the host: the port a rank's gloo dials a peer on
    another host through refuses another process's connection (another user's would otherwise
    reach the peer's gloo with the pool's key), and carries the rank's own.
    """
    dialer, peer = tunnels[1], tunnels[0]  # 127.0.0.4 dials 127.0.0.3 (the larger address)
    with socket.create_server(("127.0.0.1", 0)) as peers_gloo:
        peers_gloo.settimeout(10)
        stored = peer.published("pg/0", _record("127.0.0.1", peers_gloo.getsockname()[1]))
        dialer.published("pg/1", _record("127.0.0.1", 50000))
        host, port = _address(dialer.fetched("pg/0", stored))
        assert host == DIAL
        intruder = subprocess.run(
            [sys.executable, "-c", INTRUDER, host, str(port)],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert intruder.stdout.strip() == "hung up", intruder
        with socket.create_connection((host, port), timeout=10) as own:
            own.sendall(b"gloo")
            accepted, _ = peers_gloo.accept()
            with accepted:
                assert accepted.recv(16) == b"gloo"  # the first and only bytes it was sent


INTRUDER = """
import socket, sys
with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10) as conn:
    conn.sendall(b"intruder")
    try:
        print("hung up" if conn.recv(16) == b"" else "carried")
    except ConnectionResetError:
        print("hung up")
"""


def test_what_is_not_a_gloo_record_is_left_alone(tunnels: list[GlooTunnel]) -> None:
    a = tunnels[0]
    for value in (b"", b"1", b"x" * 200, _record("10.0.0.5", 4000)):
        assert a.published("pg/0", value) == value
        assert a.fetched("pg/0", value) == value


HOLDS = """
import select, socket, sys, time
host, port, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
held = []
while True:  # until killed: keep `count` connections open that never start their handshake
    readable = select.select(held, [], [], 0)[0]
    for conn in readable:  # the tunnel hung up on it: open another
        held.remove(conn)
        conn.close()
    while len(held) < count:
        try:
            held.append(socket.create_connection((host, port), timeout=5))
        except OSError:
            break
    print(len(held), flush=True)
    time.sleep(0.05)
"""
FORMS_A_GROUP = (
    "import threading, torch, torch.distributed as dist\n"
    "total = torch.ones(3)\n"
    "dist.all_reduce(total, group=dist.new_group())\n"
    "total.tolist(), sum(t.name == 'tunnel' for t in threading.enumerate())"
)


@contextlib.contextmanager
def holding(hosts: Hosts, address: str, port: int, count: int) -> Iterator[None]:
    """From the third host, ``count`` connections to the tunnel at ``address:port`` held open
    without a handshake (renewed as the tunnel drops them), from when they are all open.
    """
    attacker = subprocess.Popen(
        [*hosts.netns_argv(2), sys.executable, "-c", HOLDS, address, str(port), str(count)],
        stdout=subprocess.PIPE,
        text=True,
        cwd="/",
    )
    try:
        assert attacker.stdout is not None
        deadline = time.monotonic() + 30
        while int(attacker.stdout.readline() or -1) < count:
            assert attacker.poll() is None and time.monotonic() < deadline, "the flood never held"
        yield
    finally:
        attacker.kill()
        attacker.communicate()


def test_connections_held_open_from_another_host_do_not_stop_groups_forming(
    hosts: Hosts, tmp_path: Path
) -> None:
    """More connections than may prove themselves at once, held by a host without the key
    (renewed as they are dropped): the ranks still form new groups, and the pool re-forms.
    """
    provider = ssh_provider(hosts, 2, tmp_path)
    with Pool(nodes=2, provider=provider, heartbeat_timeout=10, secure=True) as pool:
        ports = pool.run(LISTENING)
        ports.raise_for_errors()
        with contextlib.ExitStack() as floods:
            for rank, (_, tunnel, _) in enumerate(ports.values):
                floods.enter_context(
                    holding(hosts, hosts[rank].address, tunnel, 2 * MAX_HANDSHAKES)
                )
            result = pool.run(FORMS_A_GROUP, timeout=60)
            result.raise_for_errors()
            for total, threads in result.values:
                assert total == [2.0, 2.0, 2.0]
                assert threads <= MAX_HANDSHAKES + 16  # the flood's handshakes are bounded
            pool.restart()
            pool.run(FORMS_A_GROUP, timeout=60).raise_for_errors()


GROUPS_COME_AND_GO = (
    "import gc, threading, time, torch, torch.distributed as dist\n"
    "def tunnel_threads():\n"
    "    return sum(t.name == 'tunnel' for t in threading.enumerate())\n"
    "before = tunnel_threads()\n"
    "for _ in range(10):\n"
    "    group = dist.new_group()\n"
    "    dist.all_reduce(torch.ones(3), group=group)\n"
    "    dist.destroy_process_group(group)\n"
    "    del group\n"
    "    gc.collect()\n"
    "deadline = time.monotonic() + 20\n"
    "while tunnel_threads() > before and time.monotonic() < deadline:\n"
    "    time.sleep(0.05)\n"
    "before, tunnel_threads()"
)


def test_groups_the_code_forms_and_destroys_leave_no_tunnel_threads(
    hosts: Hosts, tmp_path: Path
) -> None:
    """A group formed and destroyed again and again (by the user's code, within a formation of
    the pool's group) leaves nothing of its own in the tunnels: no thread, no port.
    """
    provider = ssh_provider(hosts, 2, tmp_path)
    with Pool(nodes=2, provider=provider, heartbeat_timeout=10, secure=True) as pool:
        result = pool.run(GROUPS_COME_AND_GO, timeout=120)
        result.raise_for_errors()
        for before, after in result.values:
            assert after <= before

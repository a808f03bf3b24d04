"""The pool's rendezvous store serves only the pool's ranks: another user of the machine, or a
host on the pool's network, cannot read, write or list its keys, nor replay a captured exchange;
the pool still forms and trains. Attackers are real: ``nobody`` (setpriv), and a process in
another SSH test host's network namespace (tests/hosts.py), running tests/store_attacker.py."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
import torch.distributed as dist

from skyward_jupyter import Pool
from skyward_jupyter.agent import store_auth as auth
from skyward_jupyter.agent.pool_store import PoolStore
from skyward_jupyter.agent.store_server import StoreServer

from .conftest import wait_for
from .hosts import Hosts, available, ssh_hosts, ssh_provider

ATTACKER = Path(__file__).with_name("store_attacker.py")
AS_NOBODY = ("setpriv", "--reuid", "nobody", "--regid", "nogroup", "--clear-groups")
SECRET = b"s" * 32
MINUTE = datetime.timedelta(seconds=60)

THE_STORE = (
    "from torch.distributed import distributed_c10d as c10d\n"
    "rank = c10d.get_rank()\n"
    "store = c10d._get_default_store()\n"
    "while hasattr(store, 'underlying_store'):\n"
    "    store = store.underlying_store\n"
)
TRAINS = (
    "import torch, torch.nn as nn\n"
    "from torch.nn.parallel import DistributedDataParallel as DDP\n"
    "torch.manual_seed(dist.get_rank())\n"
    "model = DDP(nn.Linear(4, 2))\n"
    "model(torch.randn(8, 4) * (dist.get_rank() + 1)).sum().backward()\n"
    "torch.optim.SGD(model.parameters(), lr=0.1).step()\n"
    "[p.detach().tolist() for p in model.parameters()]"
)


class Tap:
    """A TCP relay that records what a client sends: what an observer of the network sees."""

    def __init__(self, listen: str, target: tuple[str, int]) -> None:
        self._listener = socket.create_server((listen, 0))
        self.address = (listen, self._listener.getsockname()[1])
        self._target = target
        self.sent = bytearray()
        self._threads: list[threading.Thread] = []
        self._sockets: list[socket.socket] = [self._listener]
        accept = threading.Thread(target=self._accept, daemon=True)
        self._threads.append(accept)
        accept.start()

    def _accept(self) -> None:
        try:
            client, _ = self._listener.accept()
        except OSError:
            return  # closed before anyone came
        server = socket.create_connection(self._target, timeout=30)
        self._sockets += [client, server]
        for source, sink, record in ((client, server, True), (server, client, False)):
            thread = threading.Thread(target=self._pump, args=(source, sink, record), daemon=True)
            self._threads.append(thread)
            thread.start()

    def _pump(self, source: socket.socket, sink: socket.socket, record: bool) -> None:
        try:
            while data := source.recv(65536):
                if record:
                    self.sent += data
                sink.sendall(data)
        except OSError:
            pass  # the other direction closed both
        for sock in (source, sink):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                continue

    def close(self) -> None:
        for sock in self._sockets:
            with contextlib.suppress(OSError):  # not connected
                sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked on it (accept too)
            sock.close()
        for thread in self._threads:
            thread.join(10)
            assert not thread.is_alive()


def _attack(prefix: Sequence[str], host: str, port: int, *captured: bytes) -> dict[str, object]:
    done = subprocess.run(
        [*prefix, sys.executable, str(ATTACKER), host, str(port), *(c.hex() for c in captured)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd="/",
        env={"PATH": os.environ["PATH"], "HOME": "/"},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report: dict[str, object] = json.loads(done.stdout)
    return report


def _captured_exchange(pool: Pool, tap_host: str) -> bytes:
    """Rank 1 sets a key through a tap: the bytes a real rank sent (handshake, then a frame)."""
    port = pool.master_port
    assert port is not None
    tap = Tap(tap_host, (pool.nodes[0].address, port))
    try:
        pool.run(
            THE_STORE + "from skyward_jupyter.agent.pool_store import PoolStore\n"
            "if rank == 1:\n"
            f"    tapped = PoolStore({tap.address[0]!r}, {tap.address[1]}, store._secret, "
            "store.timeout)\n"
            "    tapped.set('victim', 'from the capture')\n"
            "    tapped.close()"
        ).raise_for_errors()
    finally:
        tap.close()
    assert len(tap.sent) > auth.ANSWER
    return bytes(tap.sent)


def _assert_hung_up(seen: object) -> None:
    """The store's hello (its name and a nonce) and nothing more, then it hung up."""
    assert isinstance(seen, dict)
    assert seen["received"] == auth.HELLO, seen
    assert bytes.fromhex(str(seen["first"])) == auth.MAGIC, seen
    assert seen["closed"], seen


def _attacks_fail(pool: Pool, prefix: Sequence[str], attacker: str, tap_host: str) -> None:
    """The attacker gets nothing with torch's own client, a made-up proof or a replay of a real
    rank's exchange; what was replayed changed nothing; the head counted each refusal."""
    host, port = pool.nodes[0].address, pool.master_port
    assert port is not None
    report = _attack(prefix, host, port)
    torch_client = report["torch_client"]
    assert isinstance(torch_client, dict)
    learned = {k: v for k, v in torch_client.items() if str(v).startswith("ok")}
    assert learned == {}, f"torch's store client got through: {learned}"
    _assert_hung_up(report["made_up_proof"])

    captured = _captured_exchange(pool, tap_host)
    pool.run(
        THE_STORE + "if rank == 0:\n    store.set('victim', 'set since the capture')"
    ).raise_for_errors()
    _assert_hung_up(_attack(prefix, host, port, captured)["replay"])
    victim, refusals = pool.run(
        THE_STORE + "(store.get('victim'), store.server and list(store.server.refusals))"
    ).values[0]
    assert victim == b"set since the capture"
    from_attacker = [line for line in refusals if f"from {attacker}:" in line]
    assert len(from_attacker) >= 2, refusals
    assert all("proof does not carry the pool's secret" in line for line in from_attacker)


def _still_trains(pool: Pool) -> None:
    """Training works, and so does a formation after a destroyed group (a fresh secret)."""
    first = pool.run("import torch.distributed as dist\n" + TRAINS).raise_for_errors().values
    assert all(v == first[0] for v in first)
    pool.run("import torch.distributed as dist\ndist.destroy_process_group()").raise_for_errors()
    again = pool.run("import torch.distributed as dist\n" + TRAINS).raise_for_errors().values
    assert all(v == again[0] for v in again)


def test_another_user_of_the_machine_cannot_read_or_write_a_local_pools_store() -> None:
    with Pool(nodes=1, procs_per_node=2) as pool:
        _attacks_fail(pool, AS_NOBODY, "127.0.0.1", "127.0.0.1")
        _still_trains(pool)


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hosts]:
    if available() is not None:
        pytest.skip(str(available()))
    with ssh_hosts(3, tmp_path_factory.mktemp("hosts")) as made:
        yield made


def test_a_host_on_the_pools_network_cannot_read_write_list_or_replay(
    hosts: Hosts, tmp_path: Path
) -> None:
    provider = ssh_provider(hosts, 2, tmp_path)
    with Pool(nodes=2, provider=provider, heartbeat_timeout=10) as pool:
        _attacks_fail(pool, hosts.netns_argv(2), hosts[2].address, hosts.bridge_address)
        _still_trains(pool)


# ------------------------------------------------------ the store itself, on real sockets


@pytest.fixture
def server() -> Iterator[StoreServer]:
    made = StoreServer(socket.create_server(("127.0.0.1", 0)), SECRET)
    try:
        yield made
    finally:
        made.close()


def _session(port: int) -> tuple[socket.socket, auth.Session]:
    """A client that holds the secret, by hand (so a test can alter what it sends)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    hello = _receive(sock, auth.HELLO)
    server_nonce, client_nonce = hello[len(auth.MAGIC) :], auth.nonce()
    sock.sendall(client_nonce + auth.client_proof(SECRET, server_nonce, client_nonce))
    assert _receive(sock, auth.TAG) == auth.server_proof(SECRET, server_nonce, client_nonce)
    return sock, auth.Session(SECRET, server_nonce, client_nonce, client=True)


def _receive(sock: socket.socket, count: int) -> bytes:
    data = b""
    while len(data) < count and (chunk := sock.recv(count - len(data))):
        data += chunk
    return data


def _hung_up(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_a_frame_altered_or_replayed_on_the_way_is_refused(server: StoreServer) -> None:
    reader = PoolStore("127.0.0.1", server.port, SECRET, MINUTE)
    sock, session = _session(server.port)
    with sock:
        frame = bytearray(session.seal([b"set", b"key", b"good"]))
        frame[-auth.TAG - 1] ^= 1  # the value's last byte: "gooe"
        sock.sendall(frame)
        assert _hung_up(sock)
    wait_for(lambda: server.refused == 1, 10, "the altered frame's refusal")
    assert not reader.check(["key"])

    sock, session = _session(server.port)
    with sock:
        frame = bytearray(session.seal([b"add", b"counter", b"1"]))
        sock.sendall(frame)
        assert session.open(*_answer(sock)) == [b"ok", b"1"]
        sock.sendall(frame)  # the same frame again: its sequence number is spent
        assert _hung_up(sock)
    wait_for(lambda: server.refused == 2, 10, "the replayed frame's refusal")
    assert reader.get("counter") == b"1"
    assert "frame failed its authentication" in server.refusals[-1]


def _answer(sock: socket.socket) -> tuple[bytes, bytes, bytes]:
    head = _receive(sock, auth.HEAD)
    rest = _receive(sock, auth.frame_length(head) + auth.TAG)
    return head, rest[: -auth.TAG], rest[-auth.TAG :]


def test_a_client_without_the_secret_is_refused_with_a_clear_error(server: StoreServer) -> None:
    with pytest.raises(dist.DistStoreError, match=r"refused this rank .* run %sky restart"):
        PoolStore("127.0.0.1", server.port, b"not the secret: 32 bytes long..", MINUTE)
    wait_for(lambda: server.refused == 1, 10, "the refusal")


Ops = Callable[[dist.Store, dist.Store], list[object]]  # type: ignore[name-defined]


def _same_as_tcpstore(ops: Ops) -> None:
    """``ops`` give the same results on the pool's store as on torch's TCPStore."""
    tcp = dist.TCPStore("127.0.0.1", 0, 2, True, MINUTE, wait_for_workers=False)  # type: ignore[attr-defined]
    tcp_other = dist.TCPStore("127.0.0.1", tcp.port, 2, False, MINUTE)  # type: ignore[attr-defined]
    ours = StoreServer(socket.create_server(("127.0.0.1", 0)), SECRET)
    try:
        mine = PoolStore("127.0.0.1", ours.port, SECRET, MINUTE, server=ours)
        other = PoolStore("127.0.0.1", ours.port, SECRET, MINUTE)
        assert ops(mine, other) == ops(tcp, tcp_other)
        other.close()
        mine.close()
    finally:
        ours.close()


def test_the_store_answers_as_tcpstore_does() -> None:
    def ops(store: dist.Store, other: dist.Store) -> list[object]:  # type: ignore[name-defined]
        keys = store.num_keys()  # TCPStore counts a key of its own
        seen: list[object] = [store.add("n", 2), other.add("n", 3), store.get("n")]
        seen += [store.compare_set("c", "", "first"), store.compare_set("c", "x", "second")]
        seen += [store.compare_set("c", "first", "third"), other.get("c")]
        seen += [store.compare_set("absent", "x", "y"), store.check(["absent"])]
        store.set("a", b"\x00\xff")
        other.append("a", "z")
        seen += [store.multi_get(["a", "n"]), store.check(["a", "n"])]
        seen.append(store.num_keys() - keys)
        seen += [store.delete_key("a"), store.delete_key("a"), store.check(["a"])]
        # a get waits for a key another client sets
        setter = threading.Timer(0.2, other.set, ("later", "here"))
        setter.start()
        seen.append(store.get("later"))
        setter.join()
        with pytest.raises(dist.DistStoreError, match="timeout"):
            store.wait(["never"], datetime.timedelta(milliseconds=100))
        clone = store.clone()
        seen.append(clone.get("later"))
        return seen

    _same_as_tcpstore(ops)

"""The pool's rendezvous store serves only the pool's ranks: another user of the machine, or a
host on the pool's network, cannot read, write or list its keys, nor replay a captured exchange;
the pool still forms and trains. Attackers are real: ``nobody`` (setpriv), and a process in
another SSH test host's network namespace (tests/hosts.py), running tests/store_attacker.py.
"""

from __future__ import annotations

import collections
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

from .conftest import ssh_hosts_fixture, wait_for
from .hosts import Hosts, ssh_provider

ATTACKER = Path(__file__).with_name("store_attacker.py")
AS_NOBODY = ("setpriv", "--reuid", "nobody", "--regid", "nogroup", "--clear-groups")
SECRET = b"s" * 32
MINUTE = datetime.timedelta(seconds=60)
RANKS = 100
"""The pool the unit tests' server is sized for: more than 64, the cap on connections proving
the secret at once that a pool of any size once had."""

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
    """A TCP relay that records what its clients send: what an observer of the network sees.
    It hangs up on its first ``drop`` clients after the store's hello, as the store does on a
    connection it drops before its proof.
    """

    def __init__(self, listen: str, target: tuple[str, int], drop: int = 0) -> None:
        self._listener = socket.create_server((listen, 0))
        self.address = (listen, self._listener.getsockname()[1])
        self._target = target
        self._drop = drop
        self.connections = 0
        self.sent = bytearray()
        self._threads: list[threading.Thread] = []
        self._sockets: list[socket.socket] = []
        accept = threading.Thread(target=self._accept, daemon=True)
        self._threads.append(accept)
        accept.start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            server = socket.create_connection(self._target, timeout=30)
            self.connections += 1
            if self.connections <= self._drop:
                with client, server:
                    client.sendall(_receive(server, auth.HELLO))
                continue
            self._sockets += [client, server]
            for source, sink, record in ((client, server, True), (server, client, False)):
                thread = threading.Thread(
                    target=self._pump, args=(source, sink, record), daemon=True
                )
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
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in accept
        self._listener.close()
        self._threads[0].join(10)
        for sock in self._sockets:
            with contextlib.suppress(OSError):  # not connected
                sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked on it
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
    """The store's hello (its name and a nonce), its refusal of the proof and nothing more (the
    refusal may be lost to a reset when the attacker sent more than a proof), then it hung up.
    """
    assert isinstance(seen, dict)
    assert seen["received"] in (auth.HELLO, auth.HELLO + auth.TAG), seen
    assert bytes.fromhex(str(seen["first"])) == auth.MAGIC, seen
    assert bytes.fromhex(str(seen["rest"])) in (b"", auth.REFUSED), seen
    assert seen["closed"], seen


def _attacks_fail(pool: Pool, prefix: Sequence[str], attacker: str, tap_host: str) -> None:
    """The attacker gets nothing with torch's own client, a made-up proof or a replay of a real
    rank's exchange; what was replayed changed nothing; the head counted each refusal.
    """
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


def test_the_head_exits_loudly_when_its_store_thread_ends() -> None:
    """The store's thread is one of the agent's: should it end (here its selector is closed
    under it), the head rank exits saying so, rather than leave the next formation hanging.
    """
    with Pool(nodes=1, procs_per_node=2) as pool:
        result = pool.run(
            THE_STORE + "import time\n"
            "if rank == 0:\n"
            "    store.server._selector.close()\n"
            "    store.server._wake_w.send(b'x')\n"
            "    time.sleep(60)"
        )
        (error,) = [e for e in result.errors if e.rank == 0]
        assert error.type_name == "RankLost"
        assert "agent thread store failed" in error.traceback, error.traceback
        assert pool.run("1").values == [1, 1]


hosts = ssh_hosts_fixture(3, "hosts")


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
    made = StoreServer(socket.create_server(("127.0.0.1", 0), backlog=RANKS), SECRET, RANKS)
    try:
        yield made
    finally:
        made.close()


class _Handshake:
    """A client that holds the secret, by hand, in two steps: a test can hold it, accepted,
    between the store's hello and its own proof, or alter what it sends after.
    """

    def __init__(self, port: int, source: str = "127.0.0.1") -> None:
        self.sock = socket.create_connection(
            ("127.0.0.1", port), timeout=30, source_address=(source, 0)
        )
        hello = _receive(self.sock, auth.HELLO)
        assert hello[: len(auth.MAGIC)] == auth.MAGIC  # accepted: the store said hello
        self._server_nonce = hello[len(auth.MAGIC) :]
        self._client_nonce = auth.nonce()

    def prove(self) -> bool:
        """Whether the store proved itself in turn (False: it dropped the connection first)."""
        server_nonce, client_nonce = self._server_nonce, self._client_nonce
        try:
            self.sock.sendall(client_nonce + auth.client_proof(SECRET, server_nonce, client_nonce))
            proof = _receive(self.sock, auth.TAG)
        except (BrokenPipeError, ConnectionResetError):
            return False
        return proof == auth.server_proof(SECRET, server_nonce, client_nonce)

    def session(self) -> auth.Session:
        return auth.Session(SECRET, self._server_nonce, self._client_nonce, client=True)


def _session(port: int) -> tuple[socket.socket, auth.Session]:
    """A client that holds the secret, by hand (so a test can alter what it sends)."""
    made = _Handshake(port)
    assert made.prove()
    return made.sock, made.session()


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
    wrong = r"127.0.0.1:\d+ refused this rank's proof: the pool's secret did not match; run %sky"
    with pytest.raises(dist.DistStoreError, match=wrong):
        PoolStore("127.0.0.1", server.port, b"not the secret: 32 bytes long..", MINUTE)
    wait_for(lambda: server.refused == 1, 10, "the refusal")


Ops = Callable[[dist.Store, dist.Store], list[object]]  # type: ignore[name-defined]


def _same_as_tcpstore(ops: Ops) -> None:
    """``ops`` give the same results on the pool's store as on torch's TCPStore."""
    tcp = dist.TCPStore("127.0.0.1", 0, 2, True, MINUTE, wait_for_workers=False)  # type: ignore[attr-defined]
    tcp_other = dist.TCPStore("127.0.0.1", tcp.port, 2, False, MINUTE)  # type: ignore[attr-defined]
    ours = StoreServer(socket.create_server(("127.0.0.1", 0)), SECRET, 2)
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


# ------------------------------------------------- many ranks at once, and floods of connections


def _close_all(clients: Sequence[_Handshake]) -> None:
    for client in clients:
        client.sock.close()


def test_more_ranks_than_64_may_prove_the_secret_at_once(server: StoreServer) -> None:
    """Every rank connects as the group forms: each of a 100-rank pool's may be accepted, with
    its hello, before any has proved the secret, and none is dropped.
    """
    ranks = [_Handshake(server.port) for _ in range(RANKS)]
    try:
        assert [rank.prove() for rank in ranks] == [True] * RANKS
        assert server.refused == 0
    finally:
        _close_all(ranks)


def test_a_flood_of_connections_from_another_host_drops_no_rank(server: StoreServer) -> None:
    """Another host fills the connections proving the secret, and goes on while the ranks'
    are accepted and not yet proved: the store drops the flood's, not the ranks'.
    """
    cap = server.max_unproven
    flood = [_Handshake(server.port, "127.0.0.2") for _ in range(cap)]
    ranks: list[_Handshake] = []
    try:
        ranks += [_Handshake(server.port) for _ in range(RANKS)]
        flood += [_Handshake(server.port, "127.0.0.2") for _ in range(cap)]
        assert [rank.prove() for rank in ranks] == [True] * RANKS
        assert server.refused == RANKS + cap
        assert all("from 127.0.0.2:" in line for line in server.refusals), server.refusals
    finally:
        _close_all(flood + ranks)


def test_ranks_get_in_through_a_flood_of_connections_from_their_own_address(
    server: StoreServer,
) -> None:
    """A user of the machine floods the store from the ranks' own address (what a per-host
    share cannot tell apart): a rank whose connection is dropped connects again, and all get
    in.
    """
    stop = threading.Event()
    opened: collections.deque[socket.socket] = collections.deque()

    def flood() -> None:
        while not stop.is_set():
            with contextlib.suppress(OSError):  # the store is busy: try again
                opened.append(socket.create_connection(("127.0.0.1", server.port), timeout=5))
            while len(opened) > 2 * server.max_unproven:
                opened.popleft().close()

    flooder = threading.Thread(target=flood, daemon=True)
    flooder.start()
    stores: list[PoolStore] = []
    failed: list[BaseException] = []

    def rank(index: int) -> None:
        try:
            store = PoolStore("127.0.0.1", server.port, SECRET, MINUTE)
            store.set(f"rank {index}", "here")
            stores.append(store)
        except dist.DistStoreError as exc:
            failed.append(exc)

    try:
        wait_for(lambda: server.refused > 0, 30, "the flood to fill the connections proving")
        threads = [threading.Thread(target=rank, args=(i,)) for i in range(RANKS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(90)
        assert failed == []
        assert len(stores) == RANKS
        assert stores[0].check([f"rank {i}" for i in range(RANKS)])
    finally:
        stop.set()
        flooder.join(10)
        for sock in opened:
            sock.close()
        for store in stores:
            store.close()


def test_a_rank_dropped_before_its_proof_connects_again(server: StoreServer) -> None:
    tap = Tap("127.0.0.1", ("127.0.0.1", server.port), drop=3)
    try:
        store = PoolStore(*tap.address, SECRET, MINUTE)
        store.set("key", "value")
        assert store.get("key") == b"value"
        assert tap.connections == 4
        store.close()
    finally:
        tap.close()


def test_a_store_that_drops_every_connection_is_named_not_blamed_on_the_secret(
    server: StoreServer,
) -> None:
    tap = Tap("127.0.0.1", ("127.0.0.1", server.port), drop=1000)
    try:
        with pytest.raises(dist.DistStoreError) as raised:
            PoolStore(*tap.address, SECRET, datetime.timedelta(seconds=1))
        said = str(raised.value)
        assert f"127.0.0.1:{tap.address[1]} dropped every connection of this rank" in said
        assert "secret" not in said
        assert tap.connections > 1
    finally:
        tap.close()


# ------------------------------------------------------------- frames larger than the bound


def test_an_answer_announcing_more_than_the_bound_is_refused_before_it_is_read() -> None:
    """Before the HMAC can be checked, a frame's length is all a client has: a server without
    the secret's (here: one that proves it, then announces 100 MiB) gets no buffer that big.
    """
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            server_nonce = auth.nonce()
            conn.sendall(auth.MAGIC + server_nonce)
            client_nonce = _receive(conn, auth.ANSWER)[: auth.NONCE]
            conn.sendall(auth.server_proof(SECRET, server_nonce, client_nonce))
            conn.recv(1 << 16)  # the request
            conn.sendall((100 << 20).to_bytes(4, "big") + b"\0" * 1000)
            conn.shutdown(socket.SHUT_WR)
            with contextlib.suppress(ConnectionResetError):
                conn.recv(1)  # until the client hangs up

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        store = PoolStore("127.0.0.1", listener.getsockname()[1], SECRET, MINUTE)
        with pytest.raises(dist.DistStoreError, match=r"104857600 bytes announced .* 16 MiB"):
            store.set("key", "value")
    finally:
        thread.join(10)
        listener.close()
    assert not thread.is_alive()


def test_a_request_announcing_more_than_the_bound_is_refused_before_it_is_read(
    server: StoreServer,
) -> None:
    sock, _ = _session(server.port)
    with sock:
        sock.sendall((100 << 20).to_bytes(4, "big") + b"\0" * 1000)
        assert _hung_up(sock)
    wait_for(lambda: server.refused == 1, 10, "the refusal")
    assert (
        "104857600 bytes announced (the store's frames take at most 16 MiB)" in server.refusals[-1]
    )


def test_a_request_or_answer_over_the_bound_fails_that_call_alone(server: StoreServer) -> None:
    store = PoolStore("127.0.0.1", server.port, SECRET, MINUTE)
    with pytest.raises(dist.DistStoreError, match=r"cannot take a request of \d+ bytes"):
        store.set("big", b"x" * auth.MAX_FRAME)
    half = b"x" * (auth.MAX_FRAME // 2)
    store.set("a", half)
    store.set("b", half)
    with pytest.raises(dist.DistStoreError, match=r"the answer has \d+ bytes, more than"):
        store.multi_get(["a", "b"])
    assert store.get("a") == half  # the connection goes on
    store.close()


# ----------------------------------------------------------------------- nothing left behind


def test_answered_timed_out_and_abandoned_waits_leave_nothing_behind(server: StoreServer) -> None:
    store = PoolStore("127.0.0.1", server.port, SECRET, MINUTE)
    store.set("here", "1")
    for _ in range(1000):
        store.get("here")
    assert len(server._deadlines) <= 1  # the handshake's, at most
    with pytest.raises(dist.DistStoreError, match="timeout"):
        store.wait(["never"], datetime.timedelta(milliseconds=100))
    assert server._waiting == {}

    sock, session = _session(server.port)
    with sock:
        for i in range(1000):  # each waits, then is answered: its deadline goes stale
            sock.sendall(session.seal([b"get", b"60000", str(i).encode()]))
            store.set(str(i), "now")
            assert session.open(*_answer(sock)) == [b"ok", b"now"]
        assert len(server._deadlines) <= 2 * 256
        sock.sendall(session.seal([b"get", b"60000", b"absent"]))
        wait_for(lambda: b"absent" in server._waiting, 10, "the wait")
    wait_for(lambda: server._waiting == {}, 10, "the closed connection's wait to go")
    store.close()


PAUSED = """
import os, resource, socket, sys, time
from skyward_jupyter.agent.store_server import StoreServer

server = StoreServer(socket.create_server(("127.0.0.1", 0)), b"s" * 32, 1)
hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 8, hard))
print(server.port, flush=True)
while (asked := sys.stdin.readline().strip()) == "state":
    print("paused" if server._accept_again is not None else "accepting", flush=True)
deadline = time.monotonic() + 30
while server._accept_again is None and time.monotonic() < deadline:
    time.sleep(0.01)  # a pause ends after a while, and the next failed accept starts another
paused = server._accept_again is not None
server.close()
print("closed while paused" if paused else "never paused", flush=True)
sys.stdin.readline()
"""


def test_the_listener_closes_also_while_accepting_is_paused() -> None:
    """Out of descriptors, every connection proven, the store stops accepting a while (in a
    process of its own, with few descriptors); closed then, its port closes too.
    """
    store = subprocess.Popen(
        [sys.executable, "-c", PAUSED],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])},
    )
    assert store.stdin is not None and store.stdout is not None
    clients: list[socket.socket] = []

    def state() -> str:
        assert store.stdin is not None and store.stdout is not None
        store.stdin.write("state\n")
        store.stdin.flush()
        return store.stdout.readline().strip()

    try:
        port = int(store.stdout.readline())
        for _ in range(100):  # until one gets no hello: the store stopped accepting
            clients.append(socket.create_connection(("127.0.0.1", port), timeout=2))
            try:
                hello = _receive(clients[-1], auth.HELLO)
            except TimeoutError:
                if state() == "paused":
                    break
                continue  # a hello late on a loaded machine: not yet a pause
            server_nonce, client_nonce = hello[len(auth.MAGIC) :], auth.nonce()
            proof = auth.client_proof(b"s" * 32, server_nonce, client_nonce)
            clients[-1].sendall(client_nonce + proof)
            assert len(_receive(clients[-1], auth.TAG)) == auth.TAG
        else:
            raise AssertionError("the store never stopped accepting")
        store.stdin.write("close\n")
        store.stdin.flush()
        assert store.stdout.readline().strip() == "closed while paused"
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
    finally:
        store.stdin.close()
        assert store.wait(10) == 0
        for sock in clients:
            sock.close()


def test_no_secret_in_what_reprs_show() -> None:
    from skyward_jupyter import protocol as p

    secret = b"\x01" * 32
    assert repr(secret) not in repr(p.FormGroup(1, None, secret))


def test_a_listener_that_fails_to_accept_does_not_end_the_store() -> None:
    """accept(2) fails for reasons of its own (Linux passes a connection's network error this
    way; here the listener is shut down under the store): the store says so on the rank's
    diagnostics and goes on serving the connections it has.
    """
    said: list[str] = []
    server = StoreServer(socket.create_server(("127.0.0.1", 0)), SECRET, RANKS, said.append)
    try:
        store = PoolStore("127.0.0.1", server.port, SECRET, MINUTE)
        server._listener.shutdown(socket.SHUT_RDWR)
        wait_for(lambda: said, 10, "the store to say it could not accept")
        assert said[0].startswith("store could not accept a connection ("), said
        store.set("key", "value")
        assert store.get("key") == b"value"
        store.close()
    finally:
        server.close()

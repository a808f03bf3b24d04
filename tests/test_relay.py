"""The head's relay on a real network (SSH test hosts in network namespaces, one bridge).

A pool on hosts 0 and 1; host 2 is someone else on the pool's network. What a user meets: the
relay stays up under a flood of connections and garbage and when the head runs out of
descriptors, the next large global still arrives; a request without the pool's token, or a
recorded one played again, gets nothing; and what crosses the network is encrypted.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from skyward_jupyter import Pool
from skyward_jupyter.agent.relay import REQUEST_WITHIN
from skyward_jupyter.protocol import Pickled, Together
from skyward_jupyter.providers.ssh import Host, SSHOptions, SSHProvider

from .conftest import ssh_hosts_fixture, wait_for
from .hosts import Hosts, available

pytestmark = pytest.mark.skipif(available() is not None, reason=str(available()))

ATTACKER = 2


hosts = ssh_hosts_fixture(3, "relay-hosts")


@pytest.fixture(scope="module")
def pool(hosts: Hosts) -> Iterator[Pool]:
    options = SSHOptions(
        identity=str(hosts.client_key),
        known_hosts=str(hosts.known_hosts),
        python=hosts.python,
        connect_timeout=5,
    )
    provider = SSHProvider(
        [Host(hosts[i].address, hosts.user, hosts[i].port) for i in (0, 1)], options
    )
    with Pool(nodes=2, provider=provider, sync=()) as made:
        made.run("1").raise_for_errors()
        yield made


def _relay(pool: Pool) -> tuple[str, int]:
    relay = pool._transfer._relay()
    assert relay is not None, "the head has no relay"
    return relay


def _large_global_arrives(pool: Pool) -> None:
    value = np.random.default_rng().random(1 << 19)  # 4 MiB: relayed
    result = pool.run("float(x.sum())", {"x": value}, timeout=60)
    assert result.values == [float(value.sum())] * 2, result.errors


def test_a_large_torch_tensor_reaches_the_other_node_whole_and_writable(pool: Pool) -> None:
    torch = pytest.importorskip("torch")
    value = torch.rand(1 << 20).to(torch.bfloat16)  # 2 MiB, out of the pickle: relayed
    cell = "x[0] = -1.0\n(float(x[1:].double().sum()), str(x.dtype), tuple(x.shape))"
    result = pool.run(cell, {"x": value}, timeout=60)
    expected = (float(value[1:].double().sum()), "torch.bfloat16", (1 << 20,))
    assert result.values == [expected] * 2, result.errors


def test_globals_sent_together_share_their_objects_on_the_other_node(pool: Pool) -> None:
    """Two globals sharing a large array travel as one value (what the notebook sends for a
    model and its optimizer): relayed once, loaded once on each rank, still sharing it.
    """
    array = np.random.default_rng().random(1 << 19)  # 4 MiB: relayed
    together = Pickled.dump(Together({"a": array, "b": [array]}))
    result = pool.run("(b[0] is a, float(a.sum()))", {"a": together, "b": together}, timeout=60)
    assert result.values == [(True, float(array.sum()))] * 2, result.errors


def _head_pid(pool: Pool) -> int:
    return int(pool.run("__import__('os').getpid()").values[0])


def _attacker(hosts: Hosts, script: str, args: dict[str, object]) -> subprocess.Popen[str]:
    """``script`` run from the attacker's namespace; ``args`` on its first line of stdin."""
    proc = subprocess.Popen(
        hosts.netns_argv(ATTACKER, hosts.python, "-c", script),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdin is not None
    proc.stdin.write(json.dumps(args) + "\n")
    proc.stdin.flush()
    return proc


FLOOD = r"""
import json, resource, selectors, socket, ssl, struct, sys, time
args = json.loads(sys.stdin.readline())
address = (args["host"], args["port"])
_, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))

# An idle client, and one that does the TLS handshake, reads the nonce, then trickles its
# request a byte every 0.2 s: when does the relay drop each?
context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
context.check_hostname = False
context.verify_mode = ssl.CERT_NONE
idle = socket.create_connection(address)
trickle = context.wrap_socket(socket.create_connection(address))
trickle.recv(32)
opened, dropped, next_byte = time.monotonic(), {}, 0.0
while len(dropped) < 2 and time.monotonic() - opened < 30:
    for name, sock in (("idle", idle), ("trickle", trickle)):
        if name in dropped:
            continue
        sock.settimeout(0.05)
        try:
            if name == "trickle" and time.monotonic() > next_byte:
                sock.send(b"0")
                next_byte = time.monotonic() + 0.2
            if sock.recv(4096) == b"":
                dropped[name] = time.monotonic() - opened
        except socket.timeout:
            pass
        except OSError:
            dropped[name] = time.monotonic() - opened

# The flood: connections, a third of them sending garbage, all held open.
sel = selectors.DefaultSelector()
connecting = 0
for i in range(args["count"]):
    s = socket.socket()
    s.setblocking(False)
    s.connect_ex(address)
    sel.register(s, selectors.EVENT_WRITE, i)
    connecting += 1
print(json.dumps({"dropped": dropped}), flush=True)
established = closed = 0
end = time.monotonic() + args["seconds"]
while time.monotonic() < end:
    for key, events in sel.select(0.1):
        s = key.fileobj
        if events & selectors.EVENT_WRITE:
            if s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0:
                established += 1
                if key.data % 3 == 0:
                    try:
                        s.send(b"GET / HTTP/1.1\r\n" * 64)
                    except OSError:
                        pass
            sel.modify(s, selectors.EVENT_READ, key.data)
        elif events & selectors.EVENT_READ:
            try:
                gone = s.recv(65536) == b""
            except OSError:
                gone = True
            if gone:
                closed += 1
                sel.unregister(s)
                s.close()
# Reset what is left rather than close it: a closed socket whose handshake the relay's kernel
# completed by a SYN cookie but never queued (the queue was full) lingers in FIN-WAIT-1, and each
# FIN it sends again completes that handshake: connections would reach the relay's listen queue
# for a minute after the flood, in later tests.
for key in list(sel.get_map().values()):
    key.fileobj.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    key.fileobj.close()
print(json.dumps({"established": established, "closed": closed}), flush=True)
"""


def test_a_flood_of_connections_and_garbage_leaves_the_relay_serving(
    hosts: Hosts, pool: Pool
) -> None:
    """Thousands of connections from another machine, idle or sending garbage: the relay keeps
    one thread, drops the silent and the slow within seconds, and the next large global (sent
    while the flood holds its connections) still reaches the other rank.
    """
    host, port = _relay(pool)
    pid = _head_pid(pool)
    threads_before = len(os.listdir(f"/proc/{pid}/task"))
    flood = _attacker(hosts, FLOOD, {"host": host, "port": port, "count": 3000, "seconds": 25})
    try:
        assert flood.stdout is not None
        first = json.loads(flood.stdout.readline())
        assert set(first["dropped"]) == {"idle", "trickle"}, first
        assert max(first["dropped"].values()) < REQUEST_WITHIN + 2, first
        _large_global_arrives(pool)
        threads_during = len(os.listdir(f"/proc/{pid}/task"))
        assert threads_during <= threads_before + 1, (threads_before, threads_during)
        stats = json.loads(flood.stdout.readline())
    finally:
        flood.kill()
        flood.wait(10)
    assert stats["closed"] >= 1000, stats  # the relay took and let go of most of the flood
    _large_global_arrives(pool)


EXHAUST = """
import os, resource
_head = os.environ["RANK"] == "0"
if _head:
    _soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir('/proc/self/fd')) + 8, _hard))
    held = []
    try:
        while True:
            held.append(os.open('/dev/null', os.O_RDONLY))
    except OSError as exc:
        print('exhausted:', exc.strerror)
    relay_thread = next(t.native_id for t in threading.enumerate() if t.name == 'relay')
relay_thread if _head else None
"""

RELEASE = """
if _head:
    for fd in held:
        os.close(fd)
    resource.setrlimit(resource.RLIMIT_NOFILE, (_soft, _hard))
"""


def _connecting(hosts: Hosts, port: int) -> int:
    """The attacker's sockets to the relay's port (but those in TIME-WAIT, which send nothing):
    while any is left (a FIN sent again by a socket the flood closed), more connections can
    reach the listen queue.
    """
    sockets = subprocess.run(
        hosts.netns_argv(ATTACKER, "ss", "-Htn", "exclude", "time-wait", f"dport = :{port}"),
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return len(sockets.splitlines())


def _queued(hosts: Hosts, port: int) -> int:
    """Connections waiting in the head's listen queue for the relay to accept them."""
    listening = subprocess.run(
        hosts.netns_argv(0, "ss", "-Hltn", f"sport = :{port}"),
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return int(listening[1])


def _cpu(pid: int, tid: int) -> float:
    """Seconds of CPU the thread has used."""
    fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _switches(pid: int, tid: int) -> int:
    status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
    return int(status.split("voluntary_ctxt_switches:")[1].split()[0])


def test_the_relay_survives_running_out_of_descriptors(hosts: Hosts, pool: Pool) -> None:
    """A cell on the head takes every descriptor while a client connects: the relay cannot
    accept, keeps trying, and once the cell gives them back a large global arrives again.
    """
    host, port = _relay(pool)
    pid = _head_pid(pool)
    # Connections a flood left in the listen queue would leave no room for this test's client
    # (a full queue drops its SYN, and the relay cannot accept until the cell is over): none
    # queued, and none still to come from the attacker.
    wait_for(
        lambda: _connecting(hosts, port) == 0 and _queued(hosts, port) == 0,
        60,
        "the flood's connections to be gone and the relay's listen queue to drain",
    )
    result = pool.run("import threading\n" + EXHAUST)
    tid = result.values[0]
    assert isinstance(tid, int), result.errors
    try:
        before, cpu_before, started = _switches(pid, tid), _cpu(pid, tid), time.monotonic()
        with socket.create_connection((host, port), timeout=10):
            # Over at least a second, it woke for the waiting client and failed to accept it
            # (EMFILE) several times, pausing in between: alive, and not spinning.
            wait_for(
                lambda: time.monotonic() - started > 1.5 and _switches(pid, tid) >= before + 4,
                20,
                "the relay to retry accept",
            )
            spent = _cpu(pid, tid) - cpu_before
            assert spent < 0.05 + 0.25 * (time.monotonic() - started), spent
    finally:
        pool.run(RELEASE).raise_for_errors()
    _large_global_arrives(pool)


PROBE = r"""
import hashlib, hmac, json, socket, ssl, struct, sys
args = json.loads(sys.stdin.readline())
address, digest = (args["host"], args["port"]), args["digest"].encode()
context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
context.check_hostname = False
context.verify_mode = ssl.CERT_NONE  # an attacker checks nothing

def exchange(mac_of, tls=True):
    "(nonce, mac sent, what came back after the request)"
    plain = socket.create_connection(address, timeout=10)
    conn = context.wrap_socket(plain) if tls else plain
    with conn:
        conn.settimeout(10)
        nonce = mac = got = b""
        try:
            while len(nonce) < 32:
                chunk = conn.recv(32 - len(nonce))
                if not chunk:
                    break
                nonce += chunk
            mac = mac_of(nonce)
            conn.sendall(digest + mac)
            while len(got) < 8 + args["size"]:
                chunk = conn.recv(1 << 20)
                if not chunk:
                    break
                got += chunk
        except OSError:  # reset, or silence: what came before it is the answer
            pass
    return nonce, mac, got

token = args["token"].encode()
right = lambda nonce: hmac.new(token, nonce + digest, hashlib.sha256).digest()
wrong = lambda nonce: hmac.new(b"0" * 64, nonce + digest, hashlib.sha256).digest()
nonce, recorded, answer = exchange(right)
out = {"control": len(answer) >= 8 and struct.unpack("!q", answer[:8])[0] == args["size"]
       and hashlib.sha256(answer[8:]).hexdigest() == args["digest"]}
out["replayed"] = len(exchange(lambda _: recorded)[2])
out["wrong_token"] = len(exchange(wrong)[2])
out["no_tls"] = len(exchange(right, tls=False)[2])
print(json.dumps(out), flush=True)
"""

HOLD = """
import os, time
while not os.path.exists('/tmp/relay-probe-done'):
    time.sleep(0.02)
float(x.sum())
"""


def test_only_the_pools_ranks_get_a_value_and_a_recorded_request_is_worth_nothing(
    hosts: Hosts, pool: Pool
) -> None:
    """From another machine on the pool's network, while the head holds a large global: one
    who holds the token gets it (the control); the same request played again on a new
    connection, a request made with another token, and one without TLS get nothing.
    """
    host, port = _relay(pool)
    secrets = pool._ranks.settings.relay
    assert secrets is not None and secrets.cert is not None
    value = np.random.default_rng().random(1 << 19)
    blob = {}
    stash = pool._transfer.stash

    async def spy(data: bytes, readers: list[object]) -> object:
        ref = await stash(data, readers)  # type: ignore[arg-type]
        blob["ref"] = ref
        return ref

    pool._transfer.stash = spy  # type: ignore[method-assign]
    done: list[object] = []
    cell = threading.Thread(target=lambda: done.append(pool.run(HOLD, {"x": value}, timeout=90)))
    cell.start()
    try:
        wait_for(lambda: "ref" in blob, 30, "the global to be stashed on the head")
        ref = blob["ref"]
        probe = _attacker(
            hosts,
            PROBE,
            {
                "host": host,
                "port": port,
                "token": secrets.token,
                "digest": ref.digest,  # type: ignore[attr-defined]
                "size": ref.nbytes,  # type: ignore[attr-defined]
            },
        )
        out, _ = probe.communicate(timeout=60)
        found = json.loads(out)
    finally:
        pool._transfer.stash = stash  # type: ignore[method-assign]
        for i in (0, 1):
            subprocess.run(hosts.inside_argv(i, "touch", "/tmp/relay-probe-done"), check=True)
        cell.join(90)
    assert found == {"control": True, "replayed": 0, "wrong_token": 0, "no_tls": 0}, found
    assert done and done[0].values == [float(value.sum())] * 2  # type: ignore[attr-defined]
    for i in (0, 1):
        subprocess.run(hosts.inside_argv(i, "rm", "/tmp/relay-probe-done"), check=True)


def test_what_the_relay_sends_is_encrypted_on_the_network(hosts: Hosts, pool: Pool) -> None:
    """Every frame on the head's link during a large global's transfer: the value's bytes
    never show (the notebook's SSH channel and the relay's TLS carry them).
    """
    marker = os.urandom(64)
    value = marker * (64 << 10)  # 4 MiB
    capture = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003))
    capture.bind((hosts[0].veth, 0))
    capture.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 20)
    capture.settimeout(0.2)
    seen = {"bytes": 0, "clear": 0}
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            try:
                frame = capture.recv(1 << 17)
            except TimeoutError:
                continue
            seen["bytes"] += len(frame)
            seen["clear"] += marker in frame

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        result = pool.run("__import__('hashlib').sha256(x).hexdigest()", {"x": value}, timeout=60)
    finally:
        stop.set()
        watcher.join(5)
        capture.close()
    assert result.values == [hashlib.sha256(value).hexdigest()] * 2, result.errors
    assert seen["bytes"] > 2 * len(value), seen  # both trips crossed the head's link
    assert seen["clear"] == 0, seen

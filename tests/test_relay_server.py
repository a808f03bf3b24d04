"""The nodes' relays and their client in one process, on loopback: what a bug in the relay's
loop, a relay that lies about a value's size, or a parent relay that cannot serve does to a
rank, and what a secret's repr shows.

(The relay on a real network, under attack, is tests/test_relay.py.)
"""

from __future__ import annotations

import hashlib
import secrets
import socket
import threading
from collections.abc import Iterator

import pytest

from skyward_jupyter.agent.rank import AgentSettings
from skyward_jupyter.agent.relay import (
    BlobStore,
    RelayError,
    RelayKeys,
    RelayServer,
    Source,
    fetch,
)
from skyward_jupyter.relay_keys import RelaySecrets

from .conftest import wait_for

BLOB = secrets.token_bytes(3 << 20)
DIGEST = hashlib.sha256(BLOB).hexdigest()


class FaultyStore(BlobStore):
    """A store whose ``get`` raises on the given calls from the relay's thread: a bug in the
    relay's loop, wherever it would come from.
    """

    def __init__(self, failing: set[int]) -> None:
        super().__init__()
        self._failing = failing
        self.calls = 0
        self.broke = threading.Event()

    def get(self, digest: str, timeout: float = 0.0) -> memoryview | None:
        if threading.current_thread().name == "relay":
            self.calls += 1
            if self.calls in self._failing:
                self.broke.set()
                raise RuntimeError(f"injected failure in call {self.calls}")
        return super().get(digest, timeout)


@pytest.mark.parametrize(
    "failing",
    [
        pytest.param(1, id="while-answering-a-client"),
        pytest.param(2, id="between-rounds-for-a-parked-client"),
    ],
)
def test_an_unexpected_error_in_the_relay_is_said_and_it_goes_on_serving(failing: int) -> None:
    """Call 1 fails inside one client's exchange (that client is dropped and asks again); call 2
    fails in the round that looks for parked clients' values (the value is not there yet, so
    the first call parked the client). Either way the value arrives and the error is said.
    """
    said: list[str] = []
    store = FaultyStore({failing})
    keys = RelayKeys(secrets.token_hex(32))
    server = RelayServer(store, "127.0.0.1", keys, said.append)
    if failing == 1:
        store.put(DIGEST, BLOB)
    got: list[bytearray | Exception] = []

    def fetching() -> None:
        try:
            source = Source(0, "127.0.0.1", server.port)
            got.append(fetch((source,), keys, DIGEST, len(BLOB), timeout=5))
        except Exception as exc:  # noqa: BLE001 - the assertion below shows it
            got.append(exc)

    client = threading.Thread(target=fetching)
    client.start()
    if failing == 2:
        wait_for(store.broke.is_set, 10, "the relay's failure")
        store.put(DIGEST, BLOB)
    client.join(60)
    assert not client.is_alive(), "the fetch did not end"
    assert got == [bytearray(BLOB)], got
    assert len(said) == 1 and f"injected failure in call {failing}" in said[0], said
    assert "goes on" in said[0] if failing == 2 else "dropped a client" in said[0]


@pytest.fixture
def lying_relay(request: pytest.FixtureRequest) -> Iterator[int]:
    """A relay that takes a request, announces ``request.param`` bytes, and sends none."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.sendall(secrets.token_bytes(32))  # the nonce
            request_bytes = b""
            while len(request_bytes) < 96:
                chunk = conn.recv(96 - len(request_bytes))
                if not chunk:
                    return
                request_bytes += chunk
            conn.sendall(int(request.param).to_bytes(8, "big", signed=True))
            conn.recv(1)  # until the client hangs up

    server = threading.Thread(target=serve)
    server.start()
    try:
        yield int(listener.getsockname()[1])
    finally:
        server.join(30)
        listener.close()
        assert not server.is_alive()


@pytest.mark.parametrize(
    "lying_relay",
    [pytest.param(1 << 62, id="huge"), pytest.param(len(BLOB) + 1, id="one-more")],
    indirect=True,
)
def test_a_relay_announcing_another_size_than_the_values_is_refused(lying_relay: int) -> None:
    """The announced length is not authenticated: a rank makes room for the size the notebook
    sent it with the command, and for nothing else (1 << 62 bytes would be a MemoryError).
    """
    with pytest.raises(RelayError, match=rf"127\.0\.0\.1:{lying_relay}\) offered .* not fetched"):
        source = Source(1, "127.0.0.1", lying_relay)
        fetch((source,), RelayKeys("token"), DIGEST, len(BLOB), timeout=5)


def _half_then_gone() -> tuple[int, threading.Thread, socket.socket]:
    """A parent relay that dies mid-way: it answers, sends half the value, and is gone."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.sendall(secrets.token_bytes(32))
            request_bytes = b""
            while len(request_bytes) < 96:
                request_bytes += conn.recv(96 - len(request_bytes))
            conn.sendall(len(BLOB).to_bytes(8, "big", signed=True) + BLOB[: len(BLOB) // 2])

    server = threading.Thread(target=serve)
    server.start()
    return int(listener.getsockname()[1]), server, listener


@pytest.mark.parametrize("parent", ["gone", "failed", "died-mid-way"])
def test_a_node_whose_parent_cannot_serve_fetches_from_the_head_and_names_both(
    parent: str,
) -> None:
    """A node fetches from its parent first; when the parent is gone (nothing listens), says
    its own fetch failed (it was waiting for it) or dies mid-way, the node gets the value from
    the head; with the head gone too, the error names both nodes and what each did.
    """
    keys = RelayKeys(secrets.token_hex(32))
    server: threading.Thread | None = None
    if parent == "gone":
        with socket.create_server(("127.0.0.1", 0)) as closed:
            port = int(closed.getsockname()[1])
    elif parent == "failed":
        store = BlobStore()
        port = RelayServer(store, "127.0.0.1", keys, [].append).port
        # The child is parked at the parent until the parent's own fetch fails.
        threading.Timer(0.2, store.fail, (DIGEST,)).start()
    else:
        port, server, listener = _half_then_gone()
    head_store = BlobStore()
    head_store.put(DIGEST, BLOB)
    head = Source(0, "127.0.0.1", RelayServer(head_store, "127.0.0.1", keys, [].append).port)
    sources = (Source(1, "127.0.0.1", port), head)
    assert fetch(sources, keys, DIGEST, len(BLOB), timeout=10) == BLOB
    if server is not None:
        server.join(30)
        port, server, listener = _half_then_gone()
    with socket.create_server(("127.0.0.1", 0)) as closed:
        gone = Source(0, "127.0.0.1", int(closed.getsockname()[1]))
    if parent == "failed":
        store.fail(DIGEST)
    with pytest.raises(RelayError) as raised:
        fetch((Source(1, "127.0.0.1", port), gone), keys, DIGEST, len(BLOB), timeout=10)
    said = str(raised.value)
    assert f"node 1 (127.0.0.1:{port})" in said and f"node 0, the head ({gone.address}" in said
    what = {"gone": "refused", "failed": "does not have", "died-mid-way": "closed after"}
    assert what[parent] in said.split(";")[0], said
    if server is not None:
        server.join(30)
        listener.close()


def test_secrets_stay_out_of_reprs() -> None:
    made = RelaySecrets.make(encrypted=True)
    assert made.key is not None and made.cert is not None
    settings = AgentSettings(**made.agent_settings(serves=True))
    keys = RelayKeys(made.token, made.cert, made.key)
    for shown in (repr(made), repr(settings), repr(keys)):
        assert made.token not in shown and made.key not in shown, shown
        assert "PRIVATE KEY" not in shown

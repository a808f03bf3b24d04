"""The hosts' side of passing a bundle on (``agent/bundles.py``), run here as the hosts run
it: the first relay reads the bundle from its input, the others fetch it from a relay up the
tree, turning higher when a parent cannot serve, and each unpacks its copy whole or not at all.
"""

from __future__ import annotations

import hashlib
import io
import json
import socket
import subprocess
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from skyward_jupyter.relay_keys import RelaySecrets

KEYS = RelaySecrets.make(encrypted=True)


def _tarball(files: dict[str, bytes]) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


class Relay:
    """One host's relay process; its JSON lines as they come."""

    def __init__(self, target: Path, tarball: bytes, sources: list[list[Any]], digest: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "skyward_jupyter.agent.bundles"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        assert self.process.stdin is not None
        request = {
            "target": str(target),
            "digest": digest,
            "nbytes": len(tarball),
            "root": "127.0.0.1",
            "sources": sources,
            "token": KEYS.token,
            "cert": KEYS.cert,
            "key": KEYS.key,
        }
        self.process.stdin.write(json.dumps(request).encode() + b"\n")
        if not sources:
            self.process.stdin.write(tarball)
        self.process.stdin.flush()

    def line(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        read = self.process.stdout.readline()
        assert read, self.process.stderr.read() if self.process.stderr else b""
        return json.loads(read)  # type: ignore[no-any-return]

    def until(self, key: str) -> dict[str, Any]:
        while True:
            line = self.line()
            if key in line or "error" in line:
                return line

    def close(self) -> int:
        assert self.process.stdin is not None
        self.process.stdin.close()
        return self.process.wait(10)


@pytest.fixture
def relays() -> Iterator[list[Relay]]:
    started: list[Relay] = []
    yield started
    for relay in started:
        relay.process.kill()
        relay.process.wait()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_host_whose_parent_cannot_serve_fetches_from_the_root(
    relays: list[Relay], tmp_path: Path
) -> None:
    tarball = _tarball({"a.whl": b"A" * 3_000_000, "sub/b.txt": b"b"})
    digest = hashlib.sha256(tarball).hexdigest()
    relays.append(root := Relay(tmp_path / "root" / "wheels", tarball, [], digest))
    port = root.until("port")["port"]
    gone = [1, "127.0.0.1", _closed_port()]
    sources = [gone, [0, "127.0.0.1", port]]
    relays.append(child := Relay(tmp_path / "child" / "wheels", tarball, sources, digest))
    assert root.until("done") == {"done": True}
    assert child.until("done") == {"done": True}
    for where in ("root", "child"):
        got = tmp_path / where / "wheels"
        assert (got / "a.whl").read_bytes() == b"A" * 3_000_000 and (got / "sub/b.txt").exists()
        assert sorted(p.name for p in got.parent.iterdir()) == ["wheels"]  # no staging left
    assert root.close() == 0 and child.close() == 0


def test_bytes_that_do_not_match_the_digest_are_not_unpacked_nor_passed_on(
    relays: list[Relay], tmp_path: Path
) -> None:
    tarball = _tarball({"a.whl": b"A"})
    digest = hashlib.sha256(b"something else").hexdigest()
    relays.append(root := Relay(tmp_path / "root" / "wheels", tarball, [], digest))
    port = root.until("port")["port"]
    relays.append(child := Relay(tmp_path / "child" / "wheels", tarball, [[0, "127.0.0.1", port]],
                                 digest))  # fmt: skip
    assert "does not match its digest" in root.until("done")["error"]
    failed = child.until("done")["error"]
    assert "the relay of node 0, the head (127.0.0.1:" in failed, failed
    assert not (tmp_path / "root").exists() or not any((tmp_path / "root").iterdir())
    assert not (tmp_path / "child").exists()

"""The hosts' side of passing a bundle on (``agent/bundles.py``), run here as the hosts run
it: the first relay reads the bundle from its input, the others fetch it from a relay up the
tree, turning higher when a parent cannot serve, and each unpacks its copy whole or not at all.
"""

from __future__ import annotations

import asyncio
import gzip
import hashlib
import json
import re
import shlex
import socket
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from subprocess import PIPE
from typing import Any

import pytest

from skyward_jupyter.agent.bundles import unpack
from skyward_jupyter.agent.environments import SENT_LOCK
from skyward_jupyter.relay_keys import RelaySecrets

from .test_workdir import tar_of

KEYS = RelaySecrets.make(encrypted=True)


def _tarball(files: dict[str, bytes]) -> bytes:
    """A bundle as the notebook makes one: a gzipped tar."""
    return gzip.compress(tar_of(files))


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


@contextmanager
def _closed_port() -> Iterator[int]:
    """A loopback port that refuses connections: bound and never listening, and held until the
    block ends, so that nothing else can listen there meanwhile.
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield int(s.getsockname()[1])


def test_a_host_whose_parent_cannot_serve_fetches_from_the_root(
    relays: list[Relay], tmp_path: Path
) -> None:
    tarball = _tarball({"a.whl": b"A" * 3_000_000, "sub/b.txt": b"b"})
    digest = hashlib.sha256(tarball).hexdigest()
    relays.append(root := Relay(tmp_path / "root" / "wheels", tarball, [], digest))
    assert root.line()["progress"][0] == "receiving"  # at once: the notebook sees it alive
    port = root.until("serving")["serving"]
    with _closed_port() as closed:
        sources = [[1, "127.0.0.1", closed], [0, "127.0.0.1", port]]
        relays.append(child := Relay(tmp_path / "child" / "wheels", tarball, sources, digest))
        assert root.until("done") == {"done": True}
        assert child.until("done") == {"done": True}
    for where in ("root", "child"):
        got = tmp_path / where / "wheels"
        assert (got / "a.whl").read_bytes() == b"A" * 3_000_000 and (got / "sub/b.txt").exists()
        assert sorted(p.name for p in got.parent.iterdir()) == [SENT_LOCK, "wheels"]  # no staging
    assert root.close() == 0 and child.close() == 0


def test_a_relay_still_fetching_ends_when_the_notebook_closes_its_input(
    relays: list[Relay], tmp_path: Path
) -> None:
    """The notebook gave up (interrupted, or gone): a host's relay waiting on a parent that
    accepts and never answers ends at once, rather than after its fetch's own limits.
    """
    with socket.create_server(("127.0.0.1", 0)) as silent:
        port = silent.getsockname()[1]
        relays.append(child := Relay(tmp_path / "wheels", b"x", [[0, "127.0.0.1", port]], "0" * 64))
        assert child.line() == {"fetching": 0}
        assert child.close() == 0  # within Relay.close's 10 s; the fetch alone would take 30 s
        assert not (tmp_path / "wheels").exists()


def test_sky_clean_leaves_a_folder_alone_while_a_bundle_is_passed_into_it(
    relays: list[Relay], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``%sky clean`` on a host while another kernel's pool passes it wheels: the folder they
    go to is kept (with the bundle an earlier pool left there) until the relay has ended.
    """
    from skyward_jupyter.agent import environments

    monkeypatch.setenv("SKYWARD_ENVS", str(tmp_path / "envs"))
    wheels = tmp_path / "wheels"
    (wheels / "earlier").mkdir(parents=True)
    with socket.create_server(("127.0.0.1", 0)) as silent:
        port = silent.getsockname()[1]
        sources = [[0, "127.0.0.1", port]]
        relays.append(child := Relay(wheels / "new", b"x", sources, "0" * 64))
        assert child.line() == {"fetching": 0}
        removed, kept = environments.clean([wheels])
        assert removed == [] and kept == [str(wheels / "earlier")], (removed, kept)
        assert child.close() == 0
    removed, kept = environments.clean([wheels])
    assert [path for path, _ in removed] == [wheels / "earlier"] and kept == []


def test_bytes_that_do_not_match_the_digest_are_neither_served_nor_unpacked(
    relays: list[Relay], tmp_path: Path
) -> None:
    tarball = _tarball({"a.whl": b"A"})
    digest = hashlib.sha256(b"something else").hexdigest()
    relays.append(root := Relay(tmp_path / "root" / "wheels", tarball, [], digest))
    said = root.until("serving")
    assert "does not match its digest" in said["error"], said  # it never served
    assert root.process.wait(10) == 1
    assert [p.name for p in (tmp_path / "root").iterdir()] == [SENT_LOCK]


class _Local:
    """A process here with the face of an SSH session's (what ``Receiver.open`` gives)."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self._process = process
        self.stdin, self.stdout, self.stderr = process.stdin, process.stdout, process.stderr

    async def wait_closed(self) -> None:
        await self._process.wait()

    def close(self) -> None:
        if self._process.returncode is None:
            self._process.kill()


class _Notebook:
    """The notebook's side of a pass, over hosts that are processes here: each host's
    ``python`` as given, its cache a folder of its own.
    """

    def __init__(self, tmp_path: Path, pythons: list[list[str]]) -> None:
        from skyward_jupyter.providers.base import Node
        from skyward_jupyter.providers.ssh_bundles import Bundle, Receiver

        self.tmp_path = tmp_path
        self.sent_here: list[str] = []
        self.said: list[str] = []
        tarball = _tarball({"a.whl": WHEEL})
        self.bundle = Bundle("wheels", "wheels/x", lambda: tarball)
        self.hosts = [
            Receiver(
                Node(i, "127.0.0.1"),
                f"host{i}",
                self._open,
                self._run,
                self._send,
                python,
                str(tmp_path / f"host{i}"),
            )
            for i, python in enumerate(pythons)
        ]

    def run(self) -> None:
        """One pass; every host has the bundle after it."""
        from skyward_jupyter.providers.ssh_bundles import pass_bundle

        def progress(text: str, node: int | None = None, state: object = None) -> None:
            self.said.append(text)

        asyncio.run(pass_bundle(self.bundle, self.hosts, progress))
        for i in range(len(self.hosts)):
            assert (self.tmp_path / f"host{i}" / "wheels/x" / "a.whl").read_bytes() == WHEEL

    async def _open(self, command: str) -> _Local:
        argv = shlex.split(command)
        made = await asyncio.create_subprocess_exec(*argv, stdin=PIPE, stdout=PIPE, stderr=PIPE)
        return _Local(made)

    async def _run(self, argv: Sequence[str]) -> int:
        return await asyncio.wait_for((await asyncio.create_subprocess_exec(*argv)).wait(), 30)

    async def _send(self, target: str, data: bytes) -> None:
        self.sent_here.append(target)
        unpack(data, Path(target))


WHEEL = b"W" * 2_000_000


def test_the_notebook_passes_a_bundle_along_the_tree_and_sends_it_itself_where_no_relay_can(
    tmp_path: Path,
) -> None:
    """Three hosts lack the bundle: the first gets it from the notebook and serves it; the
    second's relay cannot start (its Python is broken), so the notebook sends it the bundle
    itself; the third fetches it from the first. The notebook sent it twice, not three times.
    """
    notebook = _Notebook(tmp_path, [[sys.executable], ["false"], [sys.executable]])
    notebook.run()
    said = notebook.said
    assert notebook.sent_here == [str(tmp_path / "host1" / "wheels/x")], said
    assert sum("packages: sending wheels" in line for line in said) == 2, said
    assert any("from node 0" in line for line in said), said
    # a second pass finds every host's copy and sends nothing
    said.clear()
    notebook.run()
    assert said == [] and len(notebook.sent_here) == 1


def test_a_host_whose_relay_stops_moving_gets_the_bundle_from_the_notebook(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The second host's relay starts and then says nothing (its disk or Python hangs): the
    notebook gives up on it after the stall limit and sends it the bundle itself, while the
    third host fetches from the first as before; the start does not wait on it forever.
    """
    from skyward_jupyter.providers import ssh_bundles

    monkeypatch.setattr(ssh_bundles, "STALL_WITHIN", 1.0)
    silent = [sys.executable, "-c", "import sys; sys.stdin.buffer.read()"]
    notebook = _Notebook(tmp_path, [[sys.executable], silent, [sys.executable]])
    notebook.run()
    said = notebook.said
    assert notebook.sent_here == [str(tmp_path / "host1" / "wheels/x")], said
    assert any("made no progress for 1 s" in line for line in said), said
    assert any("from node 0" in line for line in said), said


def test_a_relay_that_keeps_moving_is_not_given_up_on_however_long_it_takes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stall limit counts from the relay's last line, not from its start: one that says
    its progress for longer than the limit is waited for, and how far it is shown, paced (here
    it then ends without the bundle, and the notebook names that).
    """
    from skyward_jupyter.providers import ssh_bundles

    monkeypatch.setattr(ssh_bundles, "STALL_WITHIN", 1.0)
    monkeypatch.setattr(ssh_bundles, "SAY_EVERY", 1.0)
    moving = (
        "import json, time\n"
        "for i in range(12):\n"
        "    print(json.dumps({'progress': ['fetching', i]}), flush=True)\n"
        "    time.sleep(0.25)\n"
    )
    notebook = _Notebook(tmp_path, [[sys.executable], [sys.executable, "-c", moving]])
    notebook.run()
    said = notebook.said
    assert notebook.sent_here == [str(tmp_path / "host1" / "wheels/x")], said
    assert any("its relay ended before it had them" in line for line in said), said
    assert not any("made no progress" in line for line in said), said
    shown = [line for line in said if line.startswith("packages: fetching wheels: ")]
    assert 1 <= len(shown) <= 4, said  # about a line a second over 3 s of moving
    assert all(re.fullmatch(r"packages: fetching wheels: \d+ B of [\d.]+ KiB", x) for x in shown)

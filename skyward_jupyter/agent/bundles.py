"""What the notebook sends a pool's hosts before their ranks start (the wheels of
``--ship-wheels``, the uv binary): it crosses the notebook's uplink once, and the hosts pass it
on among themselves.

The notebook sends a bundle (a gzipped tar) to the first host that lacks it. Each host, once it
has the bundle whole, serves it to two others in a binary tree, with the ranks' relay server
(:mod:`.relay`): the same checks, so a host takes only the bytes whose sha256 the notebook named
in its request, and serves only clients that prove they hold the token the notebook made for
this pass, over TLS with a certificate made for it too. A host starts fetching only once its
parent serves (it never waits on a relay for bytes still coming); one whose parent cannot serve
(gone, unreachable) fetches from the parent's ancestors, the first host last, and the notebook
sends the bundle itself to a host that got it from none. Each host unpacks the bundle into its
cache folder (in a fresh folder, renamed into place, so no reader sees it half-written), says
so, and serves until the notebook closes its input, once every host has its copy.

Run as ``python -m skyward_jupyter.agent.bundles`` with one JSON line on stdin (``{"target",
"digest", "nbytes", "root", "sources", "token", "cert", "key"}``: ``sources``, the relays to
fetch from, parent first, as ``[node, address, port]``; none for the first host, which then
reads the ``nbytes`` bytes from stdin; ``root``, the first host's address, which it listens on,
the others on their route to it). It prints JSON lines: ``{"fetching": NODE}``, ``{"serving":
PORT}`` once it has the bundle (``null`` where it cannot listen), then ``{"done": true}``; or
``{"error": WHY}``. Meanwhile, each second in which it moved on, ``{"progress": [STEP, BYTES]}``
(``receiving``, ``fetching`` or ``unpacking``, and how far), which the notebook takes as signs
of life: it gives up on a relay that stops moving (a host whose disk or Python hangs) and
sends that host the bundle itself.

Standard library only: this runs on the hosts.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import secrets
import shutil
import sys
import tarfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .environments import hold_sent
from .network import route_to
from .relay import BlobStore, RelayError, RelayKeys, RelayServer, Source, fetch

TICK = 1.0
"""Seconds between two progress lines, at most one each (none when nothing moved)."""
_said = threading.Lock()


def _say(**line: Any) -> None:
    with _said:  # the ticker's thread says its lines too
        sys.stdout.write(json.dumps(line) + "\n")
        sys.stdout.flush()


class _Ticker:
    """Where this relay is (a step, and the bytes it has come through), said once a tick when
    it moved on.
    """

    def __init__(self, step: str) -> None:
        self.now = (step, 0)
        """The step and its bytes, set together (one tuple: the ticker never pairs a step with
        another's count)."""

    def at(self, step: str) -> Callable[[int], None]:
        """What a step calls with its bytes so far."""

        def moved(count: int) -> None:
            self.now = (step, count)

        return moved

    def start(self) -> None:
        threading.Thread(target=self._tick, name="ticker", daemon=True).start()

    def _tick(self) -> None:
        said = None
        while True:
            now = self.now
            if now != said:
                _say(progress=list(now))
                said = now
            time.sleep(TICK)


def unpack(
    tarball: bytes | bytearray, target: Path, progress: Callable[[int], None] | None = None
) -> None:
    """``tarball`` unpacked into ``target``, through a fresh folder renamed into place; another
    pool that put it there first wins (what it unpacked is the same bundle). ``progress`` is
    told the tarball's bytes read so far.
    """
    staging = target.with_name(f"{target.name}.{secrets.token_hex(4)}")
    staging.mkdir(parents=True)
    try:
        with tarfile.open(fileobj=_Reader(tarball, progress), mode="r|gz") as tar:
            if hasattr(tarfile, "data_filter"):  # Pythons before 3.11.4 have no filters
                tar.extractall(staging, filter="data")
            else:
                tar.extractall(staging)  # the notebook's bundle, its digest checked
        try:
            staging.rename(target)
        except OSError:
            if not target.is_dir():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


class _Reader(io.RawIOBase):
    """The bundle read in place (``io.BytesIO`` would copy it: wheels may be gigabytes)."""

    def __init__(self, data: bytes | bytearray, progress: Callable[[int], None] | None) -> None:
        self._view = memoryview(data)
        self._at = 0
        self._progress = progress

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        n = min(len(buffer), len(self._view) - self._at)
        buffer[:n] = self._view[self._at : self._at + n]
        self._at += n
        if self._progress is not None:
            self._progress(self._at)
        return n


def _read_exact(
    stream: io.BufferedReader, nbytes: int, progress: Callable[[int], None]
) -> bytearray:
    data = bytearray()
    while len(data) < nbytes:
        # What has come (read1): a slow uplink still shows its progress, not in whole megabytes
        chunk = stream.read1(min(1 << 20, nbytes - len(data)))
        if not chunk:
            raise OSError(f"the notebook's input ended after {len(data)} of {nbytes} bytes")
        data += chunk
        progress(len(data))
    return data


def serve(request: dict[str, Any], stdin: io.BufferedReader) -> int:
    """Receive or fetch the bundle, serve it (where this host can listen), unpack it, and go on
    serving until ``stdin`` closes; the exit status (1 when this host could not get it).
    """
    keys = RelayKeys(request["token"], request["cert"], request["key"])
    digest, nbytes = request["digest"], request["nbytes"]
    sources = tuple(Source(*source) for source in request["sources"])
    target = Path(request["target"])
    try:
        hold_sent(target.parent)  # %sky clean keeps the folder while this lives
    except OSError as exc:
        _say(error=f"cannot make {target.parent}: {exc}")
        return 1
    if sources:
        _say(fetching=sources[0].node)
    ticker = _Ticker("fetching" if sources else "receiving")
    ticker.start()
    try:
        if not sources:
            blob = _read_exact(stdin, nbytes, ticker.at("receiving"))
        ended = threading.Thread(target=_end_at_eof, args=(stdin,), name="eof", daemon=True)
        ended.start()
        if sources:
            blob = fetch(sources, keys, digest, nbytes, progress=ticker.at("fetching"))
        elif hashlib.sha256(blob).hexdigest() != digest:
            raise RelayError("the bundle from the notebook does not match its digest")
    except (RelayError, OSError) as exc:
        _say(error=str(exc))
        return 1
    # Only now does this host serve: a host that asks it finds the bundle whole, never waits.
    store = BlobStore()
    store.put(digest, blob)
    root = request["root"]
    try:
        address = root if not sources else route_to(root).address
        port: int | None = RelayServer(store, address, keys, _diagnose).port
    except OSError as exc:  # the others then fetch higher up, or from the notebook
        _diagnose(f"cannot listen for the other hosts (on the route to {root}): {exc}")
        port = None
    _say(serving=port)
    try:
        unpack(blob, target, ticker.at("unpacking"))
    except (OSError, tarfile.TarError) as exc:
        _say(error=f"cannot unpack into {request['target']}: {exc}")
        return 1
    _say(done=True)
    ended.join()  # serving until the notebook closes the input: every host has its copy
    return 0


def _end_at_eof(stdin: io.BufferedReader) -> None:
    """End this relay once the notebook closes its input, whatever it is doing: at the end of
    the pass, or mid-fetch when the notebook gave up or went away (nothing then waits for it).
    """
    while stdin.read(1 << 16):
        pass
    sys.stdout.flush()
    os._exit(0)


def _diagnose(line: str) -> None:
    sys.stderr.write(f"skyward_jupyter bundle relay: {line}\n")
    sys.stderr.flush()


def main() -> None:
    with open(0, "rb", closefd=False) as stdin:  # a reader of its own: read1, typed
        request = json.loads(stdin.readline())
        code = serve(request, stdin)
        sys.stdout.flush()
        os._exit(code)  # the thread still reading stdin would stop an orderly exit


if __name__ == "__main__":
    main()

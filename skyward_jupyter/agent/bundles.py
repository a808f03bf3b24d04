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
``{"error": WHY}``.

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
from pathlib import Path
from typing import Any, BinaryIO

from .network import route_to
from .relay import BlobStore, RelayError, RelayKeys, RelayServer, Source, fetch


def _say(**line: Any) -> None:
    sys.stdout.write(json.dumps(line) + "\n")
    sys.stdout.flush()


def unpack(tarball: bytes | bytearray, target: Path) -> None:
    """``tarball`` unpacked into ``target``, through a fresh folder renamed into place; another
    pool that put it there first wins (what it unpacked is the same bundle).
    """
    staging = target.with_name(f"{target.name}.{secrets.token_hex(4)}")
    staging.mkdir(parents=True)
    try:
        with tarfile.open(fileobj=_Reader(tarball), mode="r|gz") as tar:
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

    def __init__(self, data: bytes | bytearray) -> None:
        self._view = memoryview(data)
        self._at = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        n = min(len(buffer), len(self._view) - self._at)
        buffer[:n] = self._view[self._at : self._at + n]
        self._at += n
        return n


def _read_exact(stream: BinaryIO, nbytes: int) -> bytearray:
    data = bytearray()
    while len(data) < nbytes:
        chunk = stream.read(min(1 << 20, nbytes - len(data)))
        if not chunk:
            raise OSError(f"the notebook's input ended after {len(data)} of {nbytes} bytes")
        data += chunk
    return data


def serve(request: dict[str, Any], stdin: BinaryIO) -> int:
    """Receive or fetch the bundle, serve it (where this host can listen), unpack it, and go on
    serving until ``stdin`` closes; the exit status (1 when this host could not get it).
    """
    keys = RelayKeys(request["token"], request["cert"], request["key"])
    digest, nbytes = request["digest"], request["nbytes"]
    sources = tuple(Source(*source) for source in request["sources"])
    try:
        if not sources:
            blob = _read_exact(stdin, nbytes)
        ended = threading.Thread(target=_end_at_eof, args=(stdin,), name="eof", daemon=True)
        ended.start()
        if sources:
            _say(fetching=sources[0].node)
            blob = fetch(sources, keys, digest, nbytes)
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
        unpack(blob, Path(request["target"]))
    except (OSError, tarfile.TarError) as exc:
        _say(error=f"cannot unpack into {request['target']}: {exc}")
        return 1
    _say(done=True)
    ended.join()  # serving until the notebook closes the input: every host has its copy
    return 0


def _end_at_eof(stdin: BinaryIO) -> None:
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
    stdin = sys.stdin.buffer
    request = json.loads(stdin.readline())
    code = serve(request, stdin)
    sys.stdout.flush()
    os._exit(code)  # the thread still reading stdin would stop an orderly exit


if __name__ == "__main__":
    main()

"""What the notebook sends a pool's hosts before their ranks start (the wheels of
``--ship-wheels``, the uv binary): it crosses the notebook's uplink once, and the hosts pass it
on among themselves.

The notebook sends a bundle (a gzipped tar) to the first host that lacks it. Every host that
needs it serves it to two others in a binary tree, with the ranks' relay server
(:mod:`.relay`): the same checks, so a host takes only the bytes whose sha256 the notebook named
in its request, and serves only clients that prove they hold the token the notebook made for
this pass, over TLS with a certificate made for it too. A host whose parent cannot serve (gone,
or its own fetch failed) fetches from the parent's ancestors, the first host last. Each host
unpacks the bundle into its cache folder (in a fresh folder, renamed into place, so no reader
sees it half-written), says so, and serves until the notebook closes its input, once every
host has its copy.

Run as ``python -m skyward_jupyter.agent.bundles`` with one JSON line on stdin (``{"target",
"digest", "nbytes", "node", "root", "sources", "token", "cert", "key"}``: ``sources``, the relays
to fetch from, parent first, as ``[node, address, port]``; none for the first host, which then
reads the ``nbytes`` bytes from stdin; ``root``, the first host's address, which it listens on
and the others' route to which they listen on). It prints JSON lines: ``{"port": N}`` once it
serves, ``{"fetching": NODE}``, then ``{"done": true}`` or ``{"error": WHY}``.

Standard library only: this runs on the hosts.
"""

from __future__ import annotations

import hashlib
import io
import json
import secrets
import shutil
import sys
import tarfile
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
        with tarfile.open(fileobj=io.BytesIO(tarball), mode="r:gz") as tar:
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


def _read_exact(stream: BinaryIO, nbytes: int) -> bytearray:
    data = bytearray()
    while len(data) < nbytes:
        chunk = stream.read(min(1 << 20, nbytes - len(data)))
        if not chunk:
            raise OSError(f"the notebook's input ended after {len(data)} of {nbytes} bytes")
        data += chunk
    return data


def serve(request: dict[str, Any], stdin: BinaryIO) -> int:
    """Receive or fetch the bundle, unpack it and serve it until ``stdin`` closes; the exit
    status (1 when this host could not get it: its children then ask higher up).
    """
    keys = RelayKeys(request["token"], request["cert"], request["key"])
    digest, nbytes = request["digest"], request["nbytes"]
    sources = tuple(Source(*source) for source in request["sources"])
    store = BlobStore()
    root = request["root"]
    address = root if not sources else route_to(root).address

    def diagnose(line: str) -> None:
        sys.stderr.write(f"skyward_jupyter bundle relay: {line}\n")

    server = RelayServer(store, address, keys, diagnose)
    _say(port=server.port)
    try:
        if sources:
            _say(fetching=sources[0].node)
            blob = fetch(sources, keys, digest, nbytes)
        else:
            blob = _read_exact(stdin, nbytes)
            if hashlib.sha256(blob).hexdigest() != digest:
                raise RelayError("the bundle from the notebook does not match its digest")
        store.put(digest, blob)
        unpack(blob, Path(request["target"]))
    except (RelayError, OSError, tarfile.TarError) as exc:
        store.fail(digest)
        _say(error=str(exc))
        return 1
    _say(done=True)
    while stdin.read(1 << 16):  # the notebook closes it once every host has its copy
        pass
    return 0


def main() -> None:
    stdin = sys.stdin.buffer
    request = json.loads(stdin.readline())
    sys.exit(serve(request, stdin))


if __name__ == "__main__":
    main()

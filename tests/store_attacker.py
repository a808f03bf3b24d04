"""Someone without the pool's secret, at the pool's rendezvous store: run by tests/test_store.py
as another user of the machine, or from another host's network namespace.

``store_attacker.py HOST PORT`` tries torch's own store client (set, get, list, count keys) and
a made-up proof; ``store_attacker.py HOST PORT CAPTURED_HEX`` replays bytes captured from a real
rank's exchange with the store. Prints as JSON what each attempt got. Nothing here knows the
secret.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import sys

TIMEOUT = 15.0


def with_torchs_client(host: str, port: int) -> dict[str, str]:
    """What torch's TCPStore client learns or changes: each operation's result, or its error."""
    import torch.distributed as dist

    got: dict[str, str] = {}
    try:
        store = dist.TCPStore(  # type: ignore[attr-defined]
            host, port, is_master=False, timeout=datetime.timedelta(seconds=2)
        )
    except Exception as exc:  # noqa: BLE001 - what failed is the finding
        return {"connect": f"refused: {type(exc).__name__}"}
    got["connect"] = "ok"
    attempts = {
        "set": lambda: store.set("skyward/attacker", "1"),
        "get": lambda: store.get("skyward/reach/addr/0"),
        "list_keys": store.list_keys,
        "num_keys": store.num_keys,
    }
    for name, attempt in attempts.items():
        try:
            got[name] = f"ok: {attempt()!r}"
        except Exception as exc:  # noqa: BLE001
            got[name] = f"refused: {type(exc).__name__}"
    return got


def raw(host: str, port: int, payload: bytes) -> dict[str, object]:
    """Send ``payload`` on a fresh connection; what came back, and whether the store hung up."""
    received = bytearray()
    with socket.create_connection((host, port), timeout=TIMEOUT) as sock:
        sock.sendall(payload)
        try:
            while chunk := sock.recv(65536):
                received += chunk
            closed = True
        except TimeoutError:
            closed = False
        except ConnectionResetError:
            closed = True
    return {
        "received": len(received),
        "first": received[:16].hex(),
        "rest": received[48:].hex(),
        "closed": closed,
    }


def main() -> None:
    host, port, captured = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    if captured:
        report: dict[str, object] = {"replay": raw(host, port, bytes.fromhex(captured[0]))}
    else:
        report = {
            "torch_client": with_torchs_client(host, port),
            "made_up_proof": raw(host, port, os.urandom(64)),
        }
    print(json.dumps(report))


if __name__ == "__main__":
    main()

"""Start a rank from the node's warm template (:mod:`.node_template`), on this SSH channel.

Run as a file (``python -I -S node_spawn.py SOCKET``), standard library only, so it starts in
milliseconds: it reads the rank's environment (one JSON line: it may hold tokens, so never an
argument), hands it and this process's descriptors 0, 1 and 2 to the template, and stays until
the rank ends, with the rank's exit status (or signal) as its own, so the channel reports how the
rank ended as a directly started one does. Exit status 70: the template could not be reached.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys


def _env_line() -> bytes:
    """One line from descriptor 0, byte by byte: what follows belongs to the rank."""
    line = b""
    while not line.endswith(b"\n"):
        byte = os.read(0, 1)
        if not byte:
            raise SystemExit(70)
        line += byte
    return line


def main(path: str) -> int:
    env = json.loads(_env_line())
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        conn.connect(path)
        socket.send_fds(conn, [json.dumps({"env": env}).encode()], [0, 1, 2])
    except OSError as exc:
        os.write(2, f"skyward_jupyter: the node's template is gone ({exc})\n".encode())
        return 70
    for fd in (0, 1, 2):  # the rank holds them now; the channel ends when it does
        os.close(fd)
    while data := conn.recv(1 << 16):
        message = json.loads(data)
        if "exited" in message:
            status = int(message["status"])
            if status < 0:
                if -status != signal.SIGKILL:  # (whose action is fixed: setting it raises)
                    signal.signal(-status, signal.SIG_DFL)
                os.kill(os.getpid(), -status)
            return status
    return 70


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))

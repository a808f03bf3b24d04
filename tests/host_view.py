"""A test host's own view of the machine, then its sshd: run as ``python host_view.py CONFIG``.

``tests/hosts.py`` starts this under ``ip netns exec NS unshare --uts``: the process is already in
the host's network namespace, a mount namespace of its own (``ip netns exec`` makes one whose
mounts do not propagate back) and a UTS namespace. Here it sets the host's hostname, hides what a
real machine would not see (tmpfs over each hidden path), brings back the paths the ranks need
(bind mounts, read-only), gives the login a home of its own, and finally becomes the sshd, so
every session of that sshd sees this view. CONFIG is JSON:

``{"hostname", "sshd_files" (a directory with sshd.conf and keys), "user", "hide": [...],
"keep": [...], "home_size" (tmpfs size of /home, e.g. "2m", or null), "shm_size" (of /dev/shm,
likewise)}``
"""

from __future__ import annotations

import json
import os
import pwd
import socket
import subprocess
import sys
from pathlib import Path

STAGE = Path("/mnt")
SSHD = "/usr/sbin/sshd"


def _mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True)


def main(config: dict[str, object]) -> None:
    socket.sethostname(str(config["hostname"]))
    _mount("-t", "tmpfs", "-o", "mode=755", "sky-stage", str(STAGE))
    # Bound, not copied: a key the test authorises later (the AWS stand does) reaches sshd.
    (STAGE / "sshd").mkdir()
    _mount("--bind", str(config["sshd_files"]), str(STAGE / "sshd"))
    keep = [str(k) for k in config["keep"]]  # type: ignore[attr-defined]
    for i, path in enumerate(keep):
        (STAGE / "keep" / str(i)).mkdir(parents=True)
        _mount("--bind", path, str(STAGE / "keep" / str(i)))
    for path in sorted(str(h) for h in config["hide"]):  # type: ignore[attr-defined]
        if os.path.isdir(path):  # not if a hidden parent already took it away
            mode = "1777" if path == "/tmp" else "755"
            _mount("-t", "tmpfs", "-o", f"mode={mode}", "sky-hidden", path)
    for i, path in enumerate(keep):
        os.makedirs(path, exist_ok=True)
        _mount("--bind", str(STAGE / "keep" / str(i)), path)
        _mount("-o", "remount,bind,ro", path)
    user = pwd.getpwnam(str(config["user"]))
    size = f",size={config['home_size']}" if config.get("home_size") else ""
    _mount("-t", "tmpfs", "-o", f"mode=755{size}", "sky-home", "/home")
    if config.get("shm_size"):
        _mount("-t", "tmpfs", "-o", f"mode=1777,size={config['shm_size']}", "sky-shm", "/dev/shm")
    os.makedirs(user.pw_dir, mode=0o700)
    os.chown(user.pw_dir, user.pw_uid, user.pw_gid)
    os.execv(SSHD, [SSHD, "-D", "-e", "-f", str(STAGE / "sshd" / "sshd.conf")])


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))

"""A node's packages: the environment ``--pip``/``--requirements`` ask for, built once per
content and reused by later pools and kernels, layered over the node's own Python.

An environment is ``~/.cache/skyward_jupyter/envs/<key>/``: a venv made by the node's Python
with ``--system-site-packages``, whose site directory also names (in a ``.pth``) the site
directories of that Python, so the installer counts what the node already has (a cloud image's
CUDA torch) as installed and adds only what is missing or asked in another version. ``<key>`` is
the requirements' hash and the interpreter's. It is built in ``<key>.building-<pid>`` under an
exclusive lock on ``<key>.lock`` (two kernels asking for the same packages build once) and
renamed into place when whole: a pool never starts on a half-built environment.

torch is pinned for every install (the node's own version, else the notebook's), so no
requirement pulls a torch of its choosing from an index (gigabytes of CUDA wheels).

A rank puts the environment's site directory first on ``sys.path`` (:func:`use`) and holds a
shared lock on it, which ``%sky clean`` (:func:`clean`) respects.

Run as ``python -m skyward_jupyter.agent.environments build`` with one JSON line on stdin
(``{"hash", "requirements", "torch", "wheels"}``: ``wheels``, a folder sent from the notebook,
then the only source); it prints JSON lines ``{"step", "detail"}`` as the install goes, then
``{"ready": SITE, "packages": N, "cached": BOOL}`` or ``{"error": WHY}``.

Standard library only: this runs on the nodes.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata as metadata
import json
import os
import re
import shutil
import site
import subprocess
import sys
import sysconfig
from collections.abc import Callable, Iterator
from pathlib import Path

ENVS = "~/.cache/skyward_jupyter/envs"
_KEY = re.compile(r"[0-9a-f]{16}-[0-9a-f]{8}")
_IN_USE = ".in-use"
_PINNED = ("torch",)
"""Distributions an install may never choose a version of: the node's (or the notebook's)."""
_held: list[int] = []
"""Descriptors of the shared locks this rank holds on the environments it uses."""

Say = Callable[[str, str], None]


class BuildError(Exception):
    """The installer failed; the message is its reason, in one line."""


def root() -> Path:
    """Where this node keeps its environments (``SKYWARD_ENVS`` names another place)."""
    return Path(os.path.expanduser(os.environ.get("SKYWARD_ENVS") or ENVS))


def key(digest: str) -> str:
    """The environment's directory name: the requirements' hash and this interpreter's."""
    python = hashlib.sha256(f"{sys.executable}\0{sys.version}".encode()).hexdigest()
    return f"{digest[:16]}-{python[:8]}"


def _site_of(env: Path) -> Path:
    paths = sysconfig.get_paths(vars={"base": str(env), "platbase": str(env)})
    return Path(paths["purelib"])


def _count(site_dir: Path) -> int:
    return sum(1 for _ in site_dir.glob("*.dist-info"))


@contextlib.contextmanager
def _locked(path: Path, mode: int) -> Iterator[int]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, mode)
        yield fd
    finally:
        os.close(fd)


def cached(digest: str) -> dict[str, object] | None:
    """The builder's answer for an environment already built here, or None."""
    env = root() / key(digest)
    if not (env / _IN_USE).exists():
        return None
    site_dir = _site_of(env)
    return {"ready": str(site_dir), "packages": _count(site_dir), "cached": True}


def build(
    digest: str,
    requirements: list[str],
    torch: str | None,
    say: Say,
    wheels: str | None = None,
) -> dict[str, object]:
    """The environment for ``requirements`` on this node, built unless a whole one is cached;
    from the folder ``wheels`` alone (no index) when given.
    """
    base = root()
    base.mkdir(parents=True, exist_ok=True)
    name = key(digest)
    final = base / name
    if found := cached(digest):
        return found
    with _locked(base / f"{name}.lock", fcntl.LOCK_EX):
        if found := cached(digest):  # another kernel built it while this one waited
            return found
        staging = base / f"{name}.building-{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        try:
            sources = ["--no-index", f"--find-links {wheels}"] if wheels else []
            _make(staging, [*sources, *requirements], torch, say)
            (staging / _IN_USE).touch()
            os.rename(staging, final)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    site_dir = _site_of(final)
    return {"ready": str(site_dir), "packages": _count(site_dir), "cached": False}


def _make(env: Path, requirements: list[str], torch: str | None, say: Say) -> None:
    say("resolving", f"{len(requirements)} requirement{'s' * (len(requirements) != 1)}")
    made = subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(env)],
        capture_output=True,
        text=True,
    )
    if made.returncode != 0:
        raise BuildError(f"python -m venv failed: {_last_line(made.stderr)}")
    site_dir = _site_of(env)
    # What this Python sees (a venv's own site-packages too, which the new venv's
    # --system-site-packages would not show): the installer counts it as installed.
    ours = [p for p in [*site.getsitepackages(), site.getusersitepackages()] if os.path.isdir(p)]
    # As site directories, so that their own .pth files count (a path file, an editable install).
    (site_dir / "_skyward_node.pth").write_text(
        f"import site; [site.addsitedir(p) for p in {ours!r}]\n"
    )
    (env / "constraints.txt").write_text("".join(f"{p}\n" for p in _pins(torch)))
    # The pins as a line of the file, not pip's -c: that would replace the constraints pip's
    # configuration names (a machine's own cap on torch).
    lines = [*requirements, f"-c {env / 'constraints.txt'}"]
    (env / "requirements.txt").write_text("".join(f"{line}\n" for line in lines))
    _install(env, say)


def _pins(torch: str | None) -> list[str]:
    """torch at the node's version, else the notebook's (``torch``)."""
    pins = []
    for name in _PINNED:
        try:
            pins.append(f"{name}=={metadata.version(name)}")
        except metadata.PackageNotFoundError:
            if name == "torch" and torch:
                pins.append(f"torch=={torch}")
    return pins


def _install(env: Path, say: Say) -> None:
    python = env / "bin" / "python"
    command = [
        str(python),
        "-m",
        "pip",
        "install",
        "--progress-bar",
        "off",
        "--disable-pip-version-check",
        "--no-input",
        "-r",
        str(env / "requirements.txt"),
    ]
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1
    )
    assert process.stdout is not None and process.stderr is not None
    for line in process.stdout:
        _progress(line.strip(), say)
    errors = process.stderr.read()
    if process.wait() != 0:
        if "No module named pip" in errors:
            raise BuildError(
                f"the node's Python ({sys.executable}) has no pip to install with; install "
                "pip there"
            )
        raise BuildError(installer_reason(errors))


_DOWNLOAD = re.compile(r"Downloading (\S+?)(?:-\d[^ ]*)? \(([^)]*)\)")


def _progress(line: str, say: Say) -> None:
    if line.startswith("Collecting "):
        say("resolving", line.split()[1])
    elif match := _DOWNLOAD.search(line):
        say("downloading", f"{os.path.basename(match.group(1))} ({match.group(2)})")
    elif line.startswith("Installing collected packages:"):
        say("installing", line.split(":", 1)[1].strip())


def installer_reason(stderr: str) -> str:
    """pip's reason in one line: its last ``ERROR:`` line, else its last line."""
    lines = stderr.splitlines()
    errors = [line[len("ERROR:") :].strip() for line in lines if line.startswith("ERROR:")]
    # pip says "Could not find a version ..." then "No matching distribution found for X":
    # the first names what was asked and what exists.
    reason = (errors[0] if errors else _last_line(stderr)) or "the installer failed"
    # pip retries an index it cannot reach, saying why: "... [Errno -3] Temporary failure in
    # name resolution)", "... [Errno 101] Network is unreachable')"
    unreachable = re.search(r"WARNING: Retrying .*\[Errno -?\d+\] ([^)\"']+)", stderr)
    if unreachable:
        reason += (
            f"; no package index answered from this node ({unreachable.group(1)}): name one it "
            "reaches (--index-url, --find-links in --requirements)"
        )
    return reason


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def use(site_dir: str) -> None:
    """Put the environment's site directory (and what its ``.pth`` files add) first on
    ``sys.path``, for this rank and the Python processes it starts; hold it against
    ``%sky clean`` for the rank's life.
    """
    before = list(sys.path)
    site.addsitedir(site_dir)
    sys.path[:] = [p for p in sys.path if p not in before] + before
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (site_dir, os.environ.get("PYTHONPATH", "")) if p
    )
    env = Path(site_dir)
    while env.parent != env and not (env / _IN_USE).exists():
        env = env.parent
    if (env / _IN_USE).exists():
        fd = os.open(env / _IN_USE, os.O_RDONLY)
        fcntl.flock(fd, fcntl.LOCK_SH)
        _held.append(fd)


def clean(wheels: Path | None = None) -> tuple[list[tuple[Path, int]], list[str]]:
    """Remove the cached environments no rank uses (and builds that were cut off), and the
    folders of wheels in ``wheels`` while no build runs; what is removed (and its bytes), and
    what is kept as in use.
    """
    base = root()
    removed: list[tuple[Path, int]] = []
    kept: list[str] = []
    if wheels is not None and wheels.is_dir():
        building = base.is_dir() and any(_held_by_other(lock) for lock in base.glob("*.lock"))
        for item in sorted(wheels.iterdir()):
            if not item.is_dir() or item.is_symlink():
                continue
            if building:
                kept.append(str(item))
                continue
            size = sum(f.lstat().st_size for f in item.rglob("*"))
            shutil.rmtree(item)
            removed.append((item, size))
    if not base.is_dir():
        return removed, kept
    for item in sorted(base.iterdir()):
        name = item.name.split(".", 1)[0]
        if not _KEY.fullmatch(name) or not item.is_dir() or item.is_symlink():
            continue
        size = sum(f.lstat().st_size for f in item.rglob("*"))
        if item.name == name:  # a whole environment: in use while a rank holds its lock
            try:
                with _locked(item / _IN_USE, fcntl.LOCK_EX | fcntl.LOCK_NB):
                    shutil.rmtree(item)
            except BlockingIOError:
                kept.append(str(item))
                continue
        else:  # a build: cut off unless its builder holds the lock
            try:
                with _locked(base / f"{name}.lock", fcntl.LOCK_EX | fcntl.LOCK_NB):
                    shutil.rmtree(item)
            except BlockingIOError:
                kept.append(str(item))
                continue
        removed.append((item, size))
    return removed, kept


def _held_by_other(lock: Path) -> bool:
    try:
        with _locked(lock, fcntl.LOCK_EX | fcntl.LOCK_NB):
            return False
    except BlockingIOError:
        return True


def main() -> int:
    if sys.argv[1:] != ["build"]:
        print("usage: python -m skyward_jupyter.agent.environments build", file=sys.stderr)
        return 2
    request = json.loads(sys.stdin.readline())

    def say(step: str, detail: str) -> None:
        print(json.dumps({"step": step, "detail": detail}), flush=True)

    try:
        result = build(
            request["hash"],
            list(request["requirements"]),
            request.get("torch"),
            say,
            request.get("wheels"),
        )
    except (BuildError, OSError) as exc:
        print(json.dumps({"error": str(exc)}), flush=True)
        return 1
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

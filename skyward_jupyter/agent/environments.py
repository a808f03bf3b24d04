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
requirement pulls a torch of its choosing from an index (gigabytes of CUDA wheels). A node
without torch gets the notebook's version; with ``variant`` (``--mirror``) a node whose torch is
another version or build gets the notebook's version in the build its accelerator takes: the CPU
build without an NVIDIA driver, else the CUDA build the driver supports (:func:`torch_build`).

The installer is uv where it runs here (the node's own ``uv``, else the binary the notebook
sent), pip otherwise (:func:`installer`). uv counts only its target environment's own
distributions as installed, so the node's are stood in for by copies of their metadata, removed
once the install is done.

A rank puts the environment's site directory first on ``sys.path`` (:func:`use`) and holds a
shared lock on it, which ``%sky clean`` (:func:`clean`) respects.

Run as ``python -m skyward_jupyter.agent.environments build`` with one JSON line on stdin
(``{"hash", "requirements", "torch", "wheels", "uv", "variant"}``: ``wheels``, a folder sent
from the notebook, then the only source; ``uv``, the uv binary sent from the notebook); it prints
JSON lines ``{"step", "detail"}`` as the install goes, then ``{"ready": SITE, "packages": N,
"cached": BOOL, "installer": NAME, "torch": NOTE, "own_torch": BOOL}`` or ``{"error": WHY}``
(``own_torch``: the environment holds a torch of its own, over the node's). With
``torch-wanted`` (``{"torch", "variant"}`` on stdin) it prints ``{"wanted": VERSION}``
(:func:`torch_wanted`) or ``{"error": WHY}``: the torch the notebook downloads for a node
without an index.

Standard library only: this runs on the nodes.
"""

from __future__ import annotations

import configparser
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
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

ENVS = "~/.cache/skyward_jupyter/envs"
_KEY = re.compile(r"[0-9a-f]{16}-[0-9a-f]{8}")
_IN_USE = ".in-use"
_ABOUT = ".skyward.json"
"""What built the environment (installer, torch's choice), read back when it is found cached."""
_STAND_IN = "skyward-stand-in"
"""The INSTALLER of the metadata copies that stand in for the node's own distributions."""
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
CUDA_BUILDS = (
    ("cu130", (13, 0)),
    ("cu129", (12, 9)),
    ("cu128", (12, 8)),
    ("cu126", (12, 6)),
    ("cu124", (12, 4)),
    ("cu121", (12, 1)),
    ("cu118", (11, 8)),
)
"""torch's CUDA builds (their index's name under download.pytorch.org/whl) and the CUDA version
each needs of the driver, newest first."""
_held: list[int] = []
"""Descriptors of the shared locks this rank holds on the environments it uses."""

Say = Callable[[str, str], None]


class BuildError(Exception):
    """The installer failed; the message is its reason, in one line."""


SENT_LOCK = ".lock"
"""In a folder the notebook sends bundles into: held shared while one is passed in."""


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
    return _answer(env, cached=True)


def _answer(env: Path, cached: bool) -> dict[str, object]:
    site_dir = _site_of(env)
    about = json.loads((env / _ABOUT).read_text()) if (env / _ABOUT).exists() else {}
    return {
        "ready": str(site_dir),
        "packages": _count(site_dir),
        "cached": cached,
        "installer": about.get("installer", "pip"),
        "torch": about.get("torch"),
        "own_torch": bool(about.get("own_torch")),
    }


def build(
    digest: str,
    requirements: list[str],
    torch: str | None,
    say: Say,
    wheels: str | None = None,
    uv: str | None = None,
    variant: bool = False,
) -> dict[str, object]:
    """The environment for ``requirements`` on this node, built unless a whole one is cached;
    from the folder ``wheels`` alone (no index) when given; with uv where it runs (``uv``: the
    binary sent from the notebook), else pip; torch's build chosen by the node's accelerator
    with ``variant``.
    """
    base = root()
    base.mkdir(parents=True, exist_ok=True)
    name = key(digest)
    final = base / name
    if found := cached(digest):
        return found
    with contextlib.ExitStack() as held:
        if wheels:  # the wheels it installs from stay while it runs (``%sky clean`` waits)
            held.callback(os.close, hold_sent(Path(wheels).parent))
        held.enter_context(_locked(base / f"{name}.lock", fcntl.LOCK_EX))
        if found := cached(digest):  # another kernel built it while this one waited
            return found
        if wheels and not Path(wheels).is_dir():
            raise BuildError(
                f"the wheels sent for these packages are gone from {wheels} (removed by "
                "%sky clean from another notebook?): run the cell again to send them"
            )
        staging = base / f"{name}.building-{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        try:
            sources = ["--no-index", f"--find-links {wheels}"] if wheels else []
            wanted, pins, note = _torch_plan(installed_torch(), torch, variant, bool(wheels))
            tool = installer(uv)
            _make(staging, [*sources, *wanted, *requirements], pins, tool, say)
            own_torch = any(line.startswith("torch==") for line in wanted)
            about = {"installer": tool.name, "torch": note, "own_torch": own_torch}
            (staging / _ABOUT).write_text(json.dumps(about))
            (staging / _IN_USE).touch()
            os.rename(staging, final)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return _answer(final, cached=False)


@dataclass(frozen=True, slots=True)
class Installer:
    """What installs into an environment: uv (``path``, the binary) or pip (``path`` None)."""

    name: str
    path: str | None = None


def installer(sent: str | None) -> Installer:
    """uv where it runs here (the node's own on ``PATH``, else the binary the notebook sent),
    else pip.
    """
    for path in (shutil.which("uv"), sent):
        if not path:
            continue
        try:
            found = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            continue  # another platform's binary, or none
        if found.returncode == 0 and found.stdout.startswith("uv "):
            return Installer(" ".join(found.stdout.split()[:2]), path)
    return Installer("pip")


def installed_torch() -> tuple[str, str | None] | None:
    """This Python's torch (version, the CUDA version it is built for), read without importing
    it; None without one.
    """
    try:
        dist = metadata.distribution("torch")
    except metadata.PackageNotFoundError:
        return None
    local = dist.version.split("+", 1)[1] if "+" in dist.version else ""
    if local == "cpu":
        return dist.version, None
    if local.startswith("cu") and local[2:].isdigit():
        return dist.version, f"{local[2:-1]}.{local[-1]}"
    built = Path(str(dist.locate_file("torch/version.py")))
    text = built.read_text() if built.is_file() else ""
    found = re.search(r"^cuda\b[^=]*=\s*'([\d.]+)'", text, re.M)
    return dist.version, found.group(1) if found else None


def driver_cuda() -> tuple[int, int] | None:
    """The CUDA version this node's NVIDIA driver supports (``nvidia-smi``), None without one."""
    try:
        found = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    version = re.search(r"CUDA Version:\s*(\d+)\.(\d+)", found.stdout)
    return (int(version.group(1)), int(version.group(2))) if version else None


def build_index(build: str) -> str:
    """PyTorch's package index of ``build`` (``cpu``, ``cu126``)."""
    return CPU_INDEX.replace("/cpu", f"/{build}")


def torch_build(cuda: tuple[int, int] | None) -> str:
    """torch's build for a node whose driver supports CUDA ``cuda`` (None: no driver): ``cpu``,
    else the newest CUDA build (``cu126``) the driver runs.
    """
    if cuda is None:
        return "cpu"
    for build, needs in CUDA_BUILDS:
        if needs <= cuda:
            return build
    oldest = ".".join(map(str, CUDA_BUILDS[-1][1]))
    raise BuildError(
        f"the NVIDIA driver here supports CUDA {cuda[0]}.{cuda[1]}, older than torch's oldest "
        f"CUDA build ({oldest}); update the driver"
    )


def _suits(cuda: str | None, build: str) -> bool:
    """Whether a torch built for CUDA ``cuda`` (None: the CPU build) is of ``build``'s kind and
    runs there.
    """
    if build == "cpu" or cuda is None:
        return build == "cpu" and cuda is None
    needs = dict(CUDA_BUILDS)[build]
    return tuple(int(p) for p in cuda.split(".")[:2]) <= needs


def _torch_plan(
    node: tuple[str, str | None] | None, notebook: str | None, variant: bool, wheels: bool
) -> tuple[list[str], list[str], str | None]:
    """Requirement lines that give this node torch (none: its own stays), the pins every install
    keeps, and what was chosen, said once per pool (None: nothing to say).
    """
    if node is not None and not (variant and notebook):
        return [], [f"torch=={node[0]}"], None
    if notebook is None:
        return [], [], None
    build = torch_build(driver_cuda())
    base = notebook.split("+", 1)[0]
    if node is not None and node[0].split("+", 1)[0] == base and _suits(node[1], build):
        return [], [f"torch=={node[0]}"], f"torch {node[0]} kept (the {build} build suits it)"
    wanted = f"torch=={base}+{build}"
    sources = [] if wheels else [f"--extra-index-url {build_index(build)}"]
    reason = "no NVIDIA driver" if build == "cpu" else f"{build} for its driver"
    had = f", over {node[0]}" if node is not None else ""
    return [*sources, wanted], [wanted], f"torch {base}+{build} installed ({reason}{had})"


def torch_wanted(notebook: str | None, variant: bool) -> str | None:
    """The torch this node's build will install (``2.13.0+cu126``), None where it keeps its
    own: the one decision (:func:`_torch_plan`), asked by the notebook before it downloads the
    wheels for a node without an index.
    """
    wanted, _, _ = _torch_plan(installed_torch(), notebook, variant, True)
    line = next((line for line in wanted if line.startswith("torch==")), None)
    return line.removeprefix("torch==") if line else None


def _make(env: Path, requirements: list[str], pins: list[str], tool: Installer, say: Say) -> None:
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
    (env / "constraints.txt").write_text("".join(f"{p}\n" for p in pins))
    # The pins as a line of the file, not pip's -c: that would replace the constraints pip's
    # configuration names (a machine's own cap on torch).
    lines = [*requirements, f"-c {env / 'constraints.txt'}"]
    (env / "requirements.txt").write_text("".join(f"{line}\n" for line in lines))
    if tool.path is None:
        _install(env, say)
        return
    _stand_in(site_dir, env)
    try:
        _install_uv(env, tool.path, say)
    finally:
        for copy in site_dir.glob("*.dist-info"):
            if (copy / "INSTALLER").is_file() and (copy / "INSTALLER").read_text() == _STAND_IN:
                shutil.rmtree(copy)


def _stand_in(site_dir: Path, env: Path) -> None:
    """Copies of the metadata of the distributions this Python has, in the new environment:
    uv counts them as installed, as pip counts the node's own. Each names only its own files,
    so that uv replacing one (another version asked) removes the copy, never the node's files.
    Read from the folders' names and copied unparsed: a node has hundreds.
    """
    seen: set[str] = set()
    for entry in [str(site_dir), *sys.path]:
        folder = Path(entry or os.curdir)
        if folder != site_dir and (folder == env or env in folder.parents):
            continue
        for info in sorted(folder.glob("*.dist-info")) if folder.is_dir() else ():
            name = re.sub(r"[-_.]+", "_", info.name.split("-", 1)[0]).lower()
            if name in seen or not (info / "METADATA").is_file():
                continue  # an earlier one on the path shadows it, as at import
            seen.add(name)
            if folder == site_dir:
                continue  # the environment's own
            copy = site_dir / info.name
            copy.mkdir()
            shutil.copyfile(info / "METADATA", copy / "METADATA")
            (copy / "INSTALLER").write_text(_STAND_IN)
            files = ("METADATA", "INSTALLER", "RECORD")
            (copy / "RECORD").write_text("".join(f"{info.name}/{f},,\n" for f in files))


_UV_NAMES = {
    "index-url": "UV_INDEX_URL",
    "extra-index-url": "UV_EXTRA_INDEX_URL",
    "find-links": "UV_FIND_LINKS",
    "constraint": "UV_CONSTRAINT",
    "cert": "SSL_CERT_FILE",
}
"""pip's settings that say where packages come from, and uv's names for them."""


def _pip_config_files() -> list[Path]:
    """pip's configuration files, in the order pip reads them (a later one wins)."""
    xdg = os.environ.get("XDG_CONFIG_DIRS", "/etc/xdg").split(os.pathsep)
    home = Path(os.path.expanduser("~"))
    user = Path(os.environ.get("XDG_CONFIG_HOME") or home / ".config")
    files = [*(Path(d) / "pip" / "pip.conf" for d in reversed(xdg)), Path("/etc/pip.conf")]
    files += [Path(sys.prefix) / "pip.conf", home / ".pip" / "pip.conf", user / "pip" / "pip.conf"]
    given = os.environ.get("PIP_CONFIG_FILE")
    return [*files, *([Path(given)] if given and given != os.devnull else [])]


def uv_settings() -> dict[str, str]:
    """The node's pip configuration (its files' ``[global]`` and ``[install]``, then ``PIP_``
    variables) for indexes, wheel folders, constraints and certificates, as uv's environment,
    so that uv installs from where pip would (read here: pip itself takes seconds to start).
    """
    found: dict[str, list[str]] = {}

    def add(setting: str, value: str) -> None:
        uv_name = _UV_NAMES.get(setting)
        if uv_name and value.strip():
            values = value.split()
            # one index replaces another; the other settings add up
            found[uv_name] = (
                values if uv_name == "UV_INDEX_URL" else [*found.get(uv_name, []), *values]
            )

    for path in _pip_config_files():
        parser = configparser.RawConfigParser()
        with contextlib.suppress(OSError, configparser.Error):
            parser.read(path)
        for section in ("global", "install"):
            if parser.has_section(section):
                for setting, value in parser.items(section):
                    add(setting, value)
    for setting in _UV_NAMES:
        add(setting, os.environ.get("PIP_" + setting.upper().replace("-", "_"), ""))
    # uv reads a list of wheel folders comma-separated, the others space-separated.
    return {
        name: ("," if name == "UV_FIND_LINKS" else " ").join(dict.fromkeys(values))
        for name, values in found.items()
    }


def _install_uv(env: Path, uv: str, say: Say) -> None:
    command = [
        uv, "pip", "install", "--index-strategy", "unsafe-best-match",
        "-r", str(env / "requirements.txt"),
    ]  # fmt: skip
    # UV_PYTHON: the interpreter uv installs for, the environment's (as its --python option).
    settings = {**os.environ, **uv_settings(), "UV_PYTHON": str(env / "bin" / "python")}
    settings["NO_COLOR"] = "1"
    process = subprocess.Popen(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, bufsize=1,
        env=settings,
    )  # fmt: skip
    assert process.stderr is not None
    said = []
    for line in process.stderr:
        said.append(line)
        _uv_progress(line.strip(), say)
    if process.wait() != 0:
        raise BuildError(installer_reason("".join(said)))


_UV_DOWNLOAD = re.compile(r"Downloading (\S+) \(([^)]*)\)")


def _uv_progress(line: str, say: Say) -> None:
    if line.startswith("Resolved "):
        say("resolving", line.split(" in ")[0].removeprefix("Resolved "))
    elif match := _UV_DOWNLOAD.match(line):
        say("downloading", f"{match.group(1)} ({match.group(2)})")
    elif line.startswith("+ "):
        say("installing", line[2:])


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
    """The installer's reason in one line: pip's first ``ERROR:`` line, uv's ``error:`` with
    its causes, else the last line.
    """
    lines = stderr.splitlines()
    errors = [line[len("ERROR:") :].strip() for line in lines if line.startswith("ERROR:")]
    # pip says "Could not find a version ..." then "No matching distribution found for X":
    # the first names what was asked and what exists.
    reason = (errors[0] if errors else _uv_reason(lines)) or "the installer failed"
    # pip retries an index it cannot reach, saying why: "... [Errno -3] Temporary failure in
    # name resolution)", "... [Errno 101] Network is unreachable')"; uv gives the cause last in
    # its chain: "... dns error: ...: Temporary failure in name resolution"
    pip_said = re.search(r"WARNING: Retrying .*\[Errno -?\d+\] ([^)\"']+)", stderr)
    uv_said = re.search(r"(?:dns error|tcp connect error|Network is unreachable).*", reason)
    cause = pip_said.group(1) if pip_said else uv_said and uv_said.group(0).rsplit(": ", 1)[-1]
    if cause:
        reason += (
            f"; no package index answered from this node ({cause.strip()}): name one it "
            "reaches (--index-url, --find-links in --requirements)"
        )
    return reason


def _uv_reason(lines: list[str]) -> str:
    """uv's ``error:`` line with the causes it gives below it (``Caused by:``, ``╰─▶``), or
    the last line.
    """
    start = next((i for i, line in enumerate(lines) if line.startswith("error:")), None)
    if start is None:
        return _last_line("\n".join(lines))
    parts = [lines[start].removeprefix("error:").strip()]
    for line in lines[start + 1 :]:
        text = re.sub(r"^\s*(?:Caused by:|cause:|╰─▶|help:)\s*", "", line).strip()
        if text:
            parts.append(text)
    return ": ".join(parts)


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


def hold_sent(folder: Path) -> int:
    """Hold ``folder`` (of the wheels, of uv) while a bundle is passed into it: ``%sky clean``
    leaves it alone meanwhile. The descriptor holds it until it is closed, or the process ends.
    """
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder / SENT_LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_SH)
    return fd


def clean(sent: Sequence[Path] = ()) -> tuple[list[tuple[Path, int]], list[str]]:
    """Remove the cached environments no rank uses (and builds that were cut off), and the
    folders in ``sent`` (of the wheels, of uv: what the notebook sent for the builds) while no
    build runs and no bundle is passed into them; what is removed (and its bytes), and what is
    kept as in use.
    """
    base = root()
    removed: list[tuple[Path, int]] = []
    kept: list[str] = []
    building = base.is_dir() and any(_held_by_other(lock) for lock in base.glob("*.lock"))
    for folder in sent:
        if not folder.is_dir():
            continue
        items = [i for i in sorted(folder.iterdir()) if i.is_dir() and not i.is_symlink()]
        if building:
            kept.extend(str(item) for item in items)
            continue
        try:
            # Held for the whole removal: a pass or a build that starts meanwhile waits for it.
            with _locked(folder / SENT_LOCK, fcntl.LOCK_EX | fcntl.LOCK_NB):
                for item in items:
                    size = sum(f.lstat().st_size for f in item.rglob("*"))
                    shutil.rmtree(item)
                    removed.append((item, size))
        except BlockingIOError:  # a bundle is passed in, or a build reads from it
            kept.extend(str(item) for item in items)
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
    if sys.argv[1:] == ["torch-wanted"]:  # what the notebook sends a node without an index
        asked = json.loads(sys.stdin.readline())
        try:
            wanted = torch_wanted(asked.get("torch"), bool(asked.get("variant")))
        except BuildError as exc:
            print(json.dumps({"error": str(exc)}), flush=True)
            return 1
        print(json.dumps({"wanted": wanted}), flush=True)
        return 0
    if sys.argv[1:] != ["build"]:
        print(
            "usage: python -m skyward_jupyter.agent.environments build|torch-wanted",
            file=sys.stderr,
        )
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
            request.get("uv"),
            bool(request.get("variant")),
        )
    except (BuildError, OSError) as exc:
        print(json.dumps({"error": str(exc)}), flush=True)
        return 1
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

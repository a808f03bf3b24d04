"""The notebook's side of the nodes' packages: what ``--pip``/``--requirements`` ask for, as one
hashed request, and the builder's report read as it goes (progress, the environment, or the
installer's reason in one line).

Each provider runs the builder (:mod:`skyward_jupyter.agent.environments`) on its nodes its own
way (a process here, a command over SSH) and hands its output lines to :func:`follow`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import importlib.metadata
import io
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from .agent.environments import build_index, installer_reason
from .providers.base import ProviderError

BUILDER = ("-m", "skyward_jupyter.agent.environments", "build")
"""The builder's arguments after the node's Python."""
TORCH_WANTED = ("-m", "skyward_jupyter.agent.environments", "torch-wanted")
"""The arguments that ask a node which torch its build will install."""
WHEELS = "~/.cache/skyward_jupyter/wheels"
"""Where the notebook keeps the wheels it downloads for nodes without an index."""
UV = "~/.cache/skyward_jupyter/uv"
"""Where the notebook keeps the uv binary it sends to nodes that have none."""


class PackagesError(ProviderError):
    """An environment could not be built on a node: one line naming the node and the reason."""


@dataclass(frozen=True, slots=True)
class Packages:
    """The requirements a pool's nodes install (``--pip`` specs, then ``--requirements``
    lines), in the order given.
    """

    requirements: tuple[str, ...]
    wheels: bool = False
    """The nodes install from wheels the notebook downloads and sends (``--ship-wheels``)."""
    variant: bool = False
    """Each node gets the notebook's torch in the build for its accelerator (``--mirror``)."""

    @classmethod
    def from_options(
        cls,
        pip: Sequence[str],
        requirements: Sequence[str],
        wheels: bool = False,
        variant: bool = False,
    ) -> Packages | None:
        """``--pip`` specs, then the ``--requirements`` file's lines; None when nothing is
        asked.
        """
        lines = (*pip, *requirements)
        return cls(lines, wheels, variant) if lines or variant else None

    @property
    def digest(self) -> str:
        """The content hash: equal requirements share an environment on a node."""
        lines = (*self.requirements, *(["# torch's build per node"] if self.variant else []))
        return hashlib.sha256("\n".join(lines).encode()).hexdigest()

    def request(self, wheels: str | None = None, uv: str | None = None) -> bytes:
        """The builder's input line (torch pinned to the notebook's, where a node has none;
        ``wheels``: the node's folder of wheels sent from here, its only source; ``uv``: the uv
        binary sent there).
        """
        given = {
            "hash": self.digest,
            "requirements": list(self.requirements),
            "torch": notebook_torch(),
            "wheels": wheels,
            "uv": uv,
            "variant": self.variant,
        }
        return json.dumps(given).encode() + b"\n"

    def download(self, torch: str | None = None) -> Path:
        """The wheels of these packages and of all they need, downloaded here once per content
        (``pip download``, binary only, torch pinned to the notebook's version); with ``torch``
        (``2.13.0+cu126``: what a node without torch, or with another, will install), that
        torch too: what nodes without an index install from. They are this machine's
        platform's: nodes must share it.
        """
        root = wheels_root()
        target = root / f"{self.digest[:16]}{f'-torch-{torch}' if torch else ''}"
        if target.is_dir():
            return target
        root.mkdir(parents=True, exist_ok=True)
        staging = root / f"{target.name}.{secrets.token_hex(4)}"
        pinned = torch or notebook_torch()
        with tempfile.TemporaryDirectory(prefix="sky-wheels-") as scratch:
            pins = Path(scratch) / "constraints.txt"
            pins.write_text(f"torch=={pinned}\n" if pinned else "")
            wanted = Path(scratch) / "requirements.txt"
            extra = [*torch_sources(torch), f"torch=={torch}"] if torch else []
            asked = (*self.requirements, *extra)
            wanted.write_text("".join(f"{line}\n" for line in (*asked, f"-c {pins}")))
            done = subprocess.run(
                [sys.executable, "-m", "pip", "download", "--only-binary=:all:", "--no-input",
                 "--progress-bar", "off", "-d", str(staging), "-r", str(wanted)],
                capture_output=True,
                text=True,
            )  # fmt: skip
        if done.returncode != 0:
            shutil.rmtree(staging, ignore_errors=True)
            raise PackagesError(
                "this notebook could not download the wheels to send: "
                + installer_reason(done.stderr)
            )
        try:
            os.rename(staging, target)
        except OSError:  # another kernel downloaded them meanwhile
            shutil.rmtree(staging, ignore_errors=True)
        return target


def torch_sources(torch: str) -> list[str]:
    """Where to download ``torch`` (``2.13.0+cu126``) from besides this machine's own sources:
    none for the notebook's own version, else PyTorch's index of its build.
    """
    if torch == notebook_torch() or "+" not in torch:
        return []
    return [f"--extra-index-url {build_index(torch.split('+', 1)[1])}"]


def wheels_root() -> Path:
    """Where this notebook keeps the wheels it downloaded (``SKYWARD_WHEELS`` names another
    place).
    """
    return Path(os.path.expanduser(os.environ.get("SKYWARD_WHEELS") or WHEELS))


@functools.cache
def notebook_uv() -> Path | None:
    """uv for the nodes: this machine's (on ``PATH``), else the binary in uv's wheel, downloaded
    once (``pip download uv``); None where neither is had (the nodes then install with pip).
    Decided once per process: a notebook that reaches no index does not wait on it again.
    """
    on_path = shutil.which("uv")
    if on_path:
        return Path(on_path)
    folder = Path(os.path.expanduser(os.environ.get("SKYWARD_UV") or UV))
    binary = folder / "uv"
    if binary.is_file():
        return binary
    folder.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="sky-uv-", dir=folder.parent) as scratch:
        done = subprocess.run(
            [sys.executable, "-m", "pip", "download", "uv", "--only-binary=:all:", "--no-deps",
             "--no-input", "--progress-bar", "off", "--retries", "1", "--timeout", "15",
             "-d", scratch],
            capture_output=True,
            text=True,
        )  # fmt: skip
        wheel = next(Path(scratch).glob("uv-*.whl"), None)
        if done.returncode != 0 or wheel is None:
            return None
        staging = Path(scratch) / "uv"
        staging.mkdir()
        with zipfile.ZipFile(wheel) as unzipped:
            inside = next((n for n in unzipped.namelist() if n.endswith(".data/scripts/uv")), None)
            if inside is None:
                return None
            (staging / "uv").write_bytes(unzipped.read(inside))
        (staging / "uv").chmod(0o755)
        with contextlib.suppress(OSError):  # another kernel put it there meanwhile
            os.rename(staging, folder)
    return binary


@functools.cache
def uv_tarball(binary: Path) -> tuple[str, bytes]:
    """The uv binary as a gzipped tar for a node, and its content's name (a node keeps each
    once); made once per process.
    """
    data = binary.read_bytes()
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz", compresslevel=1) as tar:
        info = tarfile.TarInfo("uv")
        info.size, info.mode = len(data), 0o755
        tar.addfile(info, io.BytesIO(data))
    return hashlib.sha256(data).hexdigest()[:16], buffer.getvalue()


def notebook_torch() -> str | None:
    """The notebook's torch version, None without one."""
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


def wheels_tarball(folder: Path) -> bytes:
    """The folder's wheels as a gzipped tar (stored: wheels are compressed already)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz", compresslevel=0) as tar:
        for wheel in sorted(folder.glob("*.whl")):
            tar.add(wheel, arcname=wheel.name)
    return buffer.getvalue()


def requirement_lines(text: str) -> list[str]:
    """A requirements file's requirements (comments and blank lines left out)."""
    lines = (line.split(" #", 1)[0].strip() for line in text.splitlines())
    return [line for line in lines if line and not line.startswith("#")]


@dataclass(frozen=True, slots=True)
class NodeEnvironment:
    """A node's built environment."""

    digest: str
    site: str
    """Its site directory on the node, which the ranks put first on ``sys.path``."""
    packages: int
    """Distributions installed in it (over what the node's Python has)."""
    cached: bool
    """Found built (no install ran)."""
    installer: str = "pip"
    """What built it (``uv 0.13.9``, ``pip``)."""
    torch: str | None = None
    """torch's build chosen for the node, where one was (``--mirror``, or a node without)."""
    own_torch: bool = False
    """The environment holds a torch of its own (what a process imported before is stale)."""

    @classmethod
    def from_report(cls, digest: str, report: Mapping[str, object]) -> NodeEnvironment:
        """From the builder's last line (``{"ready", "packages", "cached", ...}``)."""
        torch = report.get("torch")
        return cls(
            digest,
            str(report["ready"]),
            int(str(report["packages"])),
            bool(report["cached"]),
            str(report.get("installer") or "pip"),
            str(torch) if torch else None,
            bool(report.get("own_torch")),
        )

    def describe(self) -> str:
        count = f"{self.packages} package{'s' * (self.packages != 1)}"
        return (
            f"env {self.digest[:12]} ({count}, {self.installer}{', cached' if self.cached else ''})"
        )


def torch_choices(envs: Mapping[str, NodeEnvironment]) -> str | None:
    """The line said once per pool on torch's build per node (``envs`` by the node's name),
    None when no node had one chosen.
    """
    chosen = [f"{name}: {env.torch}" for name, env in envs.items() if env.torch]
    return "torch per node: " + "; ".join(chosen) if chosen else None


async def follow(
    lines: AsyncIterator[str], digest: str, where: str, say: Callable[[str], None]
) -> NodeEnvironment:
    """Read the builder's report on ``where``: each step said, then its environment; raises
    PackagesError with the installer's reason.
    """
    async for line in lines:
        try:
            message = json.loads(line)
        except ValueError:
            continue  # not the builder's (a login banner)
        if "step" in message:
            say(f"packages: {message['step']} {message.get('detail', '')}".strip())
        elif "error" in message:
            raise PackagesError(f"{where}: could not install the packages: {message['error']}")
        elif "ready" in message:
            return NodeEnvironment.from_report(digest, message)
    raise PackagesError(f"{where}: the package installer ended without a word")


async def run_builder(
    argv: Sequence[str],
    env: Mapping[str, str],
    request: bytes,
    digest: str,
    where: str,
    say: Callable[[str], None],
) -> NodeEnvironment:
    """Start the builder here (``argv``: this machine's Python, or a command that runs it on a
    node, as ``srun`` does), hand it ``request`` and read its report (:func:`follow`); its last
    word on stderr joins a failure. Interrupted, the builder and its installer end with it.
    """
    process = await asyncio.create_subprocess_exec(
        *argv,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=dict(env),
        start_new_session=True,
    )
    assert process.stdin is not None and process.stdout is not None
    assert process.stderr is not None
    process.stdin.write(request)
    process.stdin.close()
    stdout, stderr = process.stdout, process.stderr

    async def lines() -> AsyncIterator[str]:
        async for raw in stdout:
            yield raw.decode(errors="replace")

    try:
        return await follow(lines(), digest, where, say)
    except PackagesError as exc:
        said = (await stderr.read()).decode(errors="replace").strip().splitlines()
        raise PackagesError(f"{exc}: {said[-1]}" if said else str(exc)) from None
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        raise
    finally:
        await process.wait()

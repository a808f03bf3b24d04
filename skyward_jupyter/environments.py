"""The notebook's side of the nodes' packages: what ``--pip``/``--requirements`` ask for, as one
hashed request, and the builder's report read as it goes (progress, the environment, or the
installer's reason in one line).

Each provider runs the builder (:mod:`skyward_jupyter.agent.environments`) on its nodes its own
way (a process here, a command over SSH) and hands its output lines to :func:`follow`.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import io
import json
import os
import secrets
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from .agent.environments import installer_reason
from .providers.base import ProviderError

BUILDER = ("-m", "skyward_jupyter.agent.environments", "build")
"""The builder's arguments after the node's Python."""
WHEELS = "~/.cache/skyward_jupyter/wheels"
"""Where the notebook keeps the wheels it downloads for nodes without an index."""


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

    @classmethod
    def from_options(
        cls, pip: Sequence[str], requirements: Sequence[str], wheels: bool = False
    ) -> Packages | None:
        """``--pip`` specs, then the ``--requirements`` file's lines; None when nothing is
        asked.
        """
        lines = (*pip, *requirements)
        return cls(lines, wheels) if lines else None

    @property
    def digest(self) -> str:
        """The content hash: equal requirements share an environment on a node."""
        return hashlib.sha256("\n".join(self.requirements).encode()).hexdigest()

    def request(self, wheels: str | None = None) -> bytes:
        """The builder's input line (torch pinned to the notebook's, where a node has none;
        ``wheels``: the node's folder of wheels sent from here, its only source).
        """
        given = {
            "hash": self.digest,
            "requirements": list(self.requirements),
            "torch": _notebook_torch(),
            "wheels": wheels,
        }
        return json.dumps(given).encode() + b"\n"

    def download(self) -> Path:
        """The wheels of these packages and of all they need, downloaded here once per content
        (``pip download``, binary only, torch pinned to the notebook's): what nodes without an
        index install from. They are this machine's platform's: nodes must share it.
        """
        root = wheels_root()
        target = root / self.digest[:16]
        if target.is_dir():
            return target
        root.mkdir(parents=True, exist_ok=True)
        staging = root / f"{target.name}.{secrets.token_hex(4)}"
        with tempfile.TemporaryDirectory(prefix="sky-wheels-") as scratch:
            pins = Path(scratch) / "constraints.txt"
            torch = _notebook_torch()
            pins.write_text(f"torch=={torch}\n" if torch else "")
            wanted = Path(scratch) / "requirements.txt"
            wanted.write_text("".join(f"{line}\n" for line in (*self.requirements, f"-c {pins}")))
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


def wheels_root() -> Path:
    """Where this notebook keeps the wheels it downloaded (``SKYWARD_WHEELS`` names another
    place).
    """
    return Path(os.path.expanduser(os.environ.get("SKYWARD_WHEELS") or WHEELS))


def _notebook_torch() -> str | None:
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


def wheels_tarball(folder: Path) -> bytes:
    """The folder's wheels as a gzipped tar (stored: wheels are compressed already)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz", compresslevel=1) as tar:
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

    @classmethod
    def from_report(cls, digest: str, report: Mapping[str, object]) -> NodeEnvironment:
        """From the builder's last line (``{"ready", "packages", "cached"}``)."""
        return cls(
            digest, str(report["ready"]), int(str(report["packages"])), bool(report["cached"])
        )

    def describe(self) -> str:
        count = f"{self.packages} package{'s' * (self.packages != 1)}"
        return f"env {self.digest[:12]} ({count}{', cached' if self.cached else ''})"


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

"""The notebook's side of the nodes' packages: what ``--pip``/``--requirements`` ask for, as one
hashed request, and the builder's report read as it goes (progress, the environment, or the
installer's reason in one line).

Each provider runs the builder (:mod:`skyward_jupyter.agent.environments`) on its nodes its own
way (a process here, a command over SSH) and hands its output lines to :func:`follow`.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass

from .providers.base import ProviderError

BUILDER = ("-m", "skyward_jupyter.agent.environments", "build")
"""The builder's arguments after the node's Python."""


class PackagesError(ProviderError):
    """An environment could not be built on a node: one line naming the node and the reason."""


@dataclass(frozen=True, slots=True)
class Packages:
    """The requirements a pool's nodes install (``--pip`` specs, then ``--requirements``
    lines), in the order given."""

    requirements: tuple[str, ...]

    @classmethod
    def from_options(cls, pip: Sequence[str], requirements: Sequence[str]) -> Packages | None:
        """``--pip`` specs, then the ``--requirements`` file's lines; None when nothing is
        asked."""
        lines = (*pip, *requirements)
        return cls(lines) if lines else None

    @property
    def digest(self) -> str:
        """The content hash: equal requirements share an environment on a node."""
        return hashlib.sha256("\n".join(self.requirements).encode()).hexdigest()

    def request(self) -> bytes:
        """The builder's input line (torch pinned to the notebook's, where a node has none)."""
        try:
            torch: str | None = importlib.metadata.version("torch")
        except importlib.metadata.PackageNotFoundError:
            torch = None
        given = {"hash": self.digest, "requirements": list(self.requirements), "torch": torch}
        return json.dumps(given).encode() + b"\n"


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
    PackagesError with the installer's reason."""
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

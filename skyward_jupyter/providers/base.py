"""What the pool needs from a provider: hosts, and a rank process started on one of them.

A provider knows how to get machines (this one, SSH hosts, EC2 instances) and how to start the
agent there with a byte stream back to the notebook. It knows nothing of cells, torch or
failure policy: that is the pool's job.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from ..events import RankState
from ..wire import AsyncByteReader, AsyncByteWriter


class ProviderError(Exception):
    """The provider could not supply what was asked (bad input, no capacity, unreachable host)."""


@dataclass(frozen=True, slots=True)
class Node:
    """One machine of a pool, as the provider found it."""

    index: int
    address: str
    """How the other nodes reach this one (the rendezvous address when it is the head)."""
    gpus: tuple[str, ...] = ()
    """The GPU ids this node's ranks may use."""
    gpu_type: str | None = None
    instance_type: str | None = None
    labels: Mapping[str, str] = field(default_factory=dict)


class RankProcess(Protocol):
    """A started agent: its wire, and ways to end it that do not depend on its cooperation."""

    @property
    def reader(self) -> AsyncByteReader: ...

    @property
    def writer(self) -> AsyncByteWriter: ...

    def describe(self) -> str:
        """Where it runs, for error messages ("local pid 1234", "alice@gpu1 pid 99")."""
        ...

    async def kill(self) -> None:
        """End the process now (SIGKILL or the transport's equivalent)."""
        ...

    async def wait(self) -> str:
        """Wait for it to end; say how it ended ("exited with status 1", "killed by SIGKILL")."""
        ...

    def diagnostics(self) -> str:
        """The last lines the agent wrote outside the wire (start-up failures, watchdog exits)."""
        ...


class Progress(Protocol):
    """How provisioning goes, for the panel: a step of the pool (``node`` None) or of one node
    (``state``: provisioning, booting, connecting). Callable from any thread."""

    def __call__(
        self, text: str, node: int | None = None, state: RankState | None = None
    ) -> None: ...


def no_progress(text: str, node: int | None = None, state: RankState | None = None) -> None:
    """The :class:`Progress` of a caller that shows none."""


class Provider(Protocol):
    name: str

    async def provision(self, nodes: int, progress: Progress = no_progress) -> list[Node]: ...

    async def start_rank(self, node: Node, env: Mapping[str, str]) -> RankProcess: ...

    async def release(self) -> None: ...

"""``%%sky --provider fake --fake-hosts N``: ranks on this machine, one node per fake host.

A provider is a :class:`~skyward_jupyter.providers.base.Provider` subclass named by an entry
point of the group ``skyward_jupyter.providers``; its options are a
:class:`~skyward_jupyter.providers.base.ProviderOptions` dataclass whose fields made with
:func:`~skyward_jupyter.providers.base.option` are its ``--flags``. This one starts its ranks as
the local provider does, and only says that each node is a host of its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from skyward_jupyter.providers.base import Node, Progress, ProviderOptions, no_progress, option
from skyward_jupyter.providers.local import LocalProvider

if TYPE_CHECKING:
    from skyward_jupyter.spec import PoolSpec

MOST = 8


def _count(text: str) -> int:
    """``--fake-hosts``: a whole number of hosts, 1 to 8 (a ValueError names the fix)."""
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"expected a whole number of hosts, got {text!r}") from None
    if not 1 <= value <= MOST:
        raise ValueError(f"must be from 1 to {MOST} hosts, got {value}")
    return value


@dataclass(frozen=True, slots=True)
class FakeHostsOptions(ProviderOptions):
    fake_hosts: int = option("fake hosts, one node each", default=1, type=_count, metavar="N")


class FakeHostsProvider(LocalProvider):
    """The local provider's ranks, a fake host per node."""

    name = "fake"
    Options = FakeHostsOptions
    examples = (("--provider fake --fake-hosts 2", "two fake hosts on this machine"),)

    @classmethod
    def settle(cls, spec: PoolSpec) -> PoolSpec:
        """One node per fake host."""
        assert isinstance(spec.options, FakeHostsOptions)
        return replace(spec, nodes=spec.options.fake_hosts)

    @classmethod
    def where(cls, spec: PoolSpec) -> str:
        assert isinstance(spec.options, FakeHostsOptions)
        return f"{spec.options.fake_hosts} fake hosts"

    async def provision(self, nodes: int, progress: Progress = no_progress) -> list[Node]:
        found: Sequence[Node] = await super().provision(nodes, progress)
        return [replace(node, labels={"host": f"fake{node.index}"}) for node in found]

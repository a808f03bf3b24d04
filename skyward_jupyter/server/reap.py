"""Ending what a pool left running after its owner died, from its registry record alone.

The record's ``teardown`` names the pool's provider (found by its entry point, so a plugin's
pool is reaped too) and holds what that provider's
:meth:`~skyward_jupyter.providers.base.Provider.record` kept; the provider's
:meth:`~skyward_jupyter.providers.base.Provider.reap` does the rest. The local provider signals
only processes that are provably the pool's; SSH ranks end with their channel; an AWS pool's
instances and resources are removed by its tag.
"""

from __future__ import annotations

from typing import Any

from ..providers import UnknownProvider, provider_class
from ..providers.base import ReapReport


def reap(record: dict[str, Any]) -> ReapReport:
    """End what ``record``'s pool left running. Call only when its owner is dead."""
    teardown = record.get("teardown") or {}
    name = str(teardown.get("provider", record.get("provider")))
    try:
        cls = provider_class(name)
    except (UnknownProvider, ImportError) as exc:
        return ReapReport(notes=[f"cannot reap a {name!r} pool from this server: {exc}"])
    return cls.reap(teardown)

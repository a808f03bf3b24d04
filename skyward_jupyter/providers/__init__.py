"""Where the nodes come from: one module per provider, found here by name.

The built-in providers are named here with the module that defines them, and imported only
when a pool asks for one (the AWS provider brings boto3). A provider defined elsewhere (a plugin,
a test) joins with :func:`register`; everything the rest of the package needs from a provider
goes through :class:`~skyward_jupyter.providers.base.Provider`, never through its name.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .base import Provider

_BUILT_IN = {
    "local": "skyward_jupyter.providers.local:LocalProvider",
    "ssh": "skyward_jupyter.providers.ssh:SSHProvider",
    "aws": "skyward_jupyter.providers.aws:AWSProvider",
    "slurm": "skyward_jupyter.providers.slurm:SlurmProvider",
    "ray": "skyward_jupyter.providers.ray:RayProvider",
}
_registered: dict[str, type[Provider]] = {}


class UnknownProvider(LookupError):
    """No provider of that name is built in or registered."""


def register(cls: type[Provider]) -> type[Provider]:
    """Make ``cls`` available as ``--provider cls.name`` (usable as a class decorator)."""
    _registered[cls.name] = cls
    return cls


def names() -> tuple[str, ...]:
    return tuple(dict.fromkeys([*_BUILT_IN, *_registered]))


def provider_class(name: str, module: str | None = None) -> type[Provider]:
    """The provider called ``name``; ``module`` is imported first when it is not known yet
    (a registry record names the module that defined its provider, so the server can reap a
    plugin's pool)."""
    if name not in _registered and module and name not in _BUILT_IN:
        importlib.import_module(module)
    if name in _registered:
        return _registered[name]
    if name not in _BUILT_IN:
        raise UnknownProvider(f"unknown provider {name!r}; known: {', '.join(names())}")
    module_name, _, attr = _BUILT_IN[name].partition(":")
    cls: type[Provider] = getattr(importlib.import_module(module_name), attr)
    _registered[name] = cls
    return cls


def sweep_all(
    providers: Iterable[Provider],
    records: Iterable[Mapping[str, Any]],
    *,
    yes: bool,
    region: str | None,
    all_owners: bool,
    extra: Mapping[str, Mapping[str, Any]],
) -> str:
    """``%sky sweep`` across every provider: what each made that no live pool owns.

    ``providers``: this kernel's live pools' providers; ``records``: the registry teardowns of
    every live pool on this machine. Each provider is told the records of its own pools."""
    providers, records = list(providers), list(records)
    reports = []
    for name in names():
        cls = provider_class(name)
        live: list[Mapping[str, Any]] = [p.record({}) for p in providers if isinstance(p, cls)]
        live += [r for r in records if r.get("provider") == name]
        report = cls.sweep(
            live=live, yes=yes, region=region, all_owners=all_owners, extra=extra.get(name, {})
        )
        if report is not None:
            reports.append(report)
    return "\n".join(reports) or "no provider has anything to sweep"

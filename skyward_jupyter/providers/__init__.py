"""Where the nodes come from: the providers, found by name through entry points.

Every provider, built in or from another package, is an entry point of the group
``skyward_jupyter.providers`` (``name = "package.module:ProviderClass"`` in its package's
``pyproject.toml``), imported only when a pool, the magics' options or the server need it (the
AWS provider brings boto3). Everything the rest of the package needs from a provider goes
through :class:`~skyward_jupyter.providers.base.Provider`, never through its name.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Iterable, Mapping
from importlib.metadata import EntryPoint, entry_points
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .base import Provider, ProviderOptions

GROUP = "skyward_jupyter.providers"
DEFAULT = "local"
"""The provider of a pool that names none."""

BUILT_IN = {
    "local": "skyward_jupyter.providers.local:LocalProvider",
    "ssh": "skyward_jupyter.providers.ssh:SSHProvider",
    "aws": "skyward_jupyter.providers.aws:AWSProvider",
    "slurm": "skyward_jupyter.providers.slurm:SlurmProvider",
    "ray": "skyward_jupyter.providers.ray:RayProvider",
}
"""This package's own entry points, as its ``pyproject.toml`` declares them: read from here
too while the installed metadata predates them (an editable install made before they were
added); a test holds the two the same."""

_loaded: dict[str, type[Provider]] = {}
_broken: set[str] = set()
_left_out: dict[str, str] = {}
"""Providers that load but whose options clash with the pool's or another provider's, with
why (:func:`leave_out`)."""


class UnknownProvider(LookupError):
    """No provider of that name is installed."""


@functools.cache
def _entry_points() -> dict[str, EntryPoint]:
    """Read once per process: reading entry points scans every installed distribution, and
    each cell's options ask for the providers. A provider installed later is found after a
    restart of the kernel, as Jupyter finds its own plugins.
    """
    found = {name: EntryPoint(name, value, GROUP) for name, value in BUILT_IN.items()}
    found.update({point.name: point for point in entry_points(group=GROUP)})
    return found


def names() -> tuple[str, ...]:
    """Every provider's name, the default first (nothing is imported)."""
    return tuple(sorted(_entry_points(), key=lambda name: (name != DEFAULT, name)))


def provider_class(name: str) -> type[Provider]:
    """The provider called ``name``, its module imported the first time."""
    if name in _left_out:
        raise UnknownProvider(_left_out[name])
    if name not in _loaded:
        point = _entry_points().get(name)
        if point is None:
            raise UnknownProvider(f"unknown provider {name!r}; known: {', '.join(names())}")
        try:
            cls = point.load()
        except (ImportError, AttributeError) as exc:
            raise UnknownProvider(
                f"the {name} provider cannot be loaded from {point.value} ({exc}); "
                f"reinstall its package, or uninstall it"
            ) from None
        if getattr(cls, "name", None) != name:
            raise UnknownProvider(
                f"the entry point {name} = {point.value!r} of {GROUP} is a "
                f"{getattr(cls, 'name', type(cls).__name__)!r} provider, not {name!r}"
            )
        _loaded[name] = cls
    return _loaded[name]


def leave_out(name: str, why: str) -> None:
    """Leave the provider ``name`` out from here on (said once, as a warning): its options
    would break every pool's (a flag the pool has, or another provider's taken otherwise).
    """
    if name not in _left_out:
        _left_out[name] = why
        _broken.add(name)  # said here: provider_classes() leaves it out without a word
        warnings.warn(why, stacklevel=2)


def provider_classes() -> list[type[Provider]]:
    """Every provider that loads, in :func:`names`' order (each module is imported); one that
    does not is said once, as a warning, and left out (``--provider NAME`` then says why).
    """
    found = []
    for name in names():
        try:
            found.append(provider_class(name))
        except UnknownProvider as exc:
            if name not in _broken:
                _broken.add(name)
                warnings.warn(str(exc), stacklevel=2)
    return found


def sweep_all(
    providers: Iterable[Provider],
    records: Iterable[Mapping[str, Any]],
    *,
    yes: bool,
    all_owners: bool,
    given: Mapping[str, Any],
    defaults: Mapping[str, ProviderOptions],
    extra: Mapping[str, Mapping[str, Any]],
) -> str:
    """``%sky sweep`` across every provider: what each made that no live pool owns.

    ``providers``: this kernel's live pools' providers; ``records``: the registry teardowns of
    every live pool on this machine. Each provider is told the records of its own pools, and
    its own options from ``given`` (a flag's dest -> its text) over ``defaults`` (per provider
    name, its configured options).
    """
    providers, records = list(providers), list(records)
    reports = []
    for cls in provider_classes():
        live: list[Mapping[str, Any]] = [p.record({}) for p in providers if p.name == cls.name]
        live += [r for r in records if r.get("provider") == cls.name]
        report = cls.sweep(
            live=live,
            yes=yes,
            all_owners=all_owners,
            options=cls.Options.from_given(given, defaults.get(cls.name)),
            extra=extra.get(cls.name, {}),
        )
        if report is not None:
            reports.append(report)
    return "\n".join(reports) or "no provider has anything to sweep"

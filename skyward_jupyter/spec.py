"""What a pool is: the options a cell or ``%sky up`` gives, as one frozen value.

Two cells asking for equal specs share a pool; a different spec replaces it. The spec holds what
every pool has, and its provider's own options object
(:class:`~skyward_jupyter.providers.base.ProviderOptions`); the provider reads it
(:meth:`~skyward_jupyter.providers.base.Provider.from_spec`) and says how the pool is described
and what it implies, so nothing here knows a provider by name.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from . import limits
from .environments import Packages
from .flags import Option
from .frameworks import FrameworkError, Frameworks
from .gpus import NO_GPU, check_gpu_layout
from .providers import DEFAULT, provider_class, provider_classes
from .providers.base import ProviderOptions


class SpecError(ValueError):
    """An option that cannot describe a pool (options that clash, a provider that does not
    exist).
    """


_PROVIDER_DEFAULTS = ProviderOptions()
"""What a spec made without its provider's options holds until it holds their defaults."""


@dataclass(frozen=True, slots=True)
class PoolSpec:
    provider: str = DEFAULT
    nodes: int = 1
    procs_per_node: int | None = None
    gpu: str | None = None
    backend: str | None = None
    secure: bool | None = None
    """gloo's traffic between hosts through TLS tunnels, gloo on loopback only."""
    env: tuple[tuple[str, str], ...] = ()
    idle_timeout: float | None = None
    """Minutes without a cell after which the pool stops; 0: never; None: the provider's default."""
    heartbeat_timeout: float | None = None
    desync_after: float | None = None
    sync: tuple[str, ...] = ()
    """Directories (absolute) the nodes get; () the working directory, unless ``no_sync``."""
    no_sync: bool | None = None
    sync_cap: float | None = None
    """Megabytes a synced directory may hold (None: the default)."""
    pip: tuple[str, ...] = ()
    """``--pip`` specs every node installs."""
    requirements: tuple[str, ...] = ()
    """The requirements of the ``--requirements`` file, as read when it was given."""
    ship_wheels: bool | None = None
    """The nodes install from wheels downloaded here and sent (nodes without an index)."""
    mirror: bool | None = None
    """The nodes get the notebook's versions of what its cells use (:mod:`..mirror`)."""
    frameworks: tuple[str, ...] = ()
    """``--framework`` names (): torch, when the ranks have it."""
    keras_backend: str | None = None
    hf_token_env: str | None = None
    """The notebook's variable holding the Hugging Face token (its name only, never its value)."""
    options: ProviderOptions = _PROVIDER_DEFAULTS
    """The provider's own options (when made without: its defaults)."""

    def __post_init__(self) -> None:
        """Every number in range (finite, within bounds) whichever way the spec was made, so
        that nothing is started, replaced or torn down for a ``nan`` or a typo's 100000.
        """
        options_class = provider_class(self.provider).Options
        if self.options is _PROVIDER_DEFAULTS:
            object.__setattr__(self, "options", options_class())
        elif type(self.options) is not options_class:
            raise SpecError(
                f"--provider {self.provider} takes {options_class.__name__}, not "
                f"{type(self.options).__name__}"
            )
        for name, limit in _RANGES.items():
            value = getattr(self, name)
            if value is not None:
                limit.check(value)
        if self.procs_per_node:
            limits.check_layout(self.nodes, self.procs_per_node)
        if self.secure and self.backend == "nccl":
            raise SpecError(
                "--secure carries gloo's traffic only: NCCL's cannot go through its tunnels; "
                "use --backend gloo, or leave out --secure on a network you trust"
            )
        if self.secure and "jax" in self.frameworks:
            raise SpecError(
                "--secure covers torch's gloo traffic only, not JAX's coordinator and "
                "collectives: leave out --framework jax, or --secure"
            )
        check_gpu_layout((), self.procs_per_node, self.backend, self.gpu)  # what needs no GPUs
        asked = self.pip or self.requirements or self.mirror
        provider = provider_class(self.provider)
        if asked and not provider.installs_packages:
            able = ", ".join(sorted(c.name for c in provider_classes() if c.installs_packages))
            otherwise = f"{provider.packages_otherwise}, " if provider.packages_otherwise else ""
            raise SpecError(
                f"--pip/--requirements/--mirror: the {self.provider} provider cannot install "
                f"packages on its nodes; {otherwise}install them there, or use a provider that "
                f"can ({able})"
            )

    @classmethod
    def from_options(cls, given: Mapping[str, Any], base: PoolSpec) -> PoolSpec:
        """``base`` overlaid with the options given (a dest -> its value, None: not given;
        a provider's options as their text, which its parser reads). Without ``--provider``,
        the provider is ``base``'s when it takes every provider option given, else the one
        provider that does (``--hosts`` alone chooses the one that has ``--hosts``).
        """
        flags = {o.dest: o for c in provider_classes() for o in c.Options.declared().values()}
        common = {k: v for k, v in given.items() if v is not None and k not in flags}
        own = {k: v for k, v in given.items() if v is not None and k in flags}
        if "env" in common:
            common["env"] = tuple(sorted(dict(common["env"]).items()))  # the last of a key wins
        if "frameworks" in common:
            common["frameworks"] = tuple(sorted(set(common["frameworks"])))
        common = {k: tuple(v) if isinstance(v, list) else v for k, v in common.items()}
        provider = common.get("provider") or _chosen(own, base.provider, flags)
        options_class = provider_class(provider).Options
        taken = {o.dest for o in options_class.declared().values()}
        if set(own) - taken:
            wrong = sorted(set(own) - taken)
            raise SpecError(
                f"--provider {provider} does not take "
                f"{', '.join(flags[d].flag for d in wrong)} ({_owners(wrong)})"
            )
        kept = base.options if provider == base.provider else None
        options = options_class.from_given(own, kept)
        spec = replace(base, **{**common, "provider": provider, "options": options})
        return spec.settled()

    def pool_arguments(
        self, cwd: str, notebook_env: Mapping[str, str], mirrored: Sequence[str] = ()
    ) -> dict[str, Any]:
        """The Pool's keyword arguments for the synced directories, the frameworks, the GPU
        asked for, the packages (``mirrored``: the notebook's versions, with ``--mirror``) and
        the hang doctor's limits (the pool's defaults stand for what was not given).
        """
        given: dict[str, Any] = {
            "sync": () if self.no_sync else (self.sync or (cwd,)),
            "sync_chosen": bool(self.sync),
            "sync_cap_bytes": int(self.sync_cap * 2**20) if self.sync_cap else None,
            "heartbeat_timeout": self.heartbeat_timeout,
            "desync_after": self.desync_after,
            "secure": self.secure,
            "frameworks": self.framework_setup(notebook_env),
            "gpu": self.gpu,
            "packages": Packages.from_options(
                (*mirrored, *self.pip),
                self.requirements,
                bool(self.ship_wheels),
                bool(self.mirror),
            ),
        }
        return {k: v for k, v in given.items() if v is not None}

    def framework_setup(self, notebook_env: Mapping[str, str]) -> Frameworks:
        """The frameworks the ranks set up; raises SpecError for options that clash."""
        try:
            return Frameworks.from_options(
                self.frameworks, self.keras_backend, self.hf_token_env, dict(self.env), notebook_env
            )
        except FrameworkError as exc:
            raise SpecError(str(exc)) from None

    def describe(self) -> str:
        per = self.procs_per_node
        ranks = f"{per} rank{'s' * (per != 1)}" if per else "1 rank per GPU or CPU"
        gpu = ", no GPU (--gpu none)" if self.gpu == NO_GPU else f", {self.gpu}" if self.gpu else ""
        where = provider_class(self.provider).where(self)
        setup = [n for n in self.frameworks if n != "torch"]
        setup += [f"keras on {self.keras_backend}"] if self.keras_backend else []
        frameworks = f", {' + '.join(setup)}" if setup else ""
        return f"{self.nodes} node{'s' * (self.nodes != 1)} x {ranks}, {where}{gpu}{frameworks}"

    def differences(self, other: PoolSpec) -> str:
        """What ``other`` changes, as options (``--env A=1 -> A=2``), for "replacing" messages."""
        changed = [
            f"{flag} {_shown(mine)} -> {_shown(theirs)}"
            for flag, mine, theirs in self._changed_to(other)
        ]
        return ", ".join(changed) or "nothing"

    def given_over(self, base: PoolSpec) -> str:
        """The options that make this description out of ``base`` (``--nodes 2``), as a user
        gives them: for a pool that did not start, what to give again.
        """
        given = [
            flag if theirs is True else f"{flag} {_shown(theirs)}"
            for flag, _, theirs in base._changed_to(self)
        ]
        return ", ".join(given) or "the defaults"

    def _changed_to(self, other: PoolSpec) -> list[tuple[str, Any, Any]]:
        """Each option ``other`` sets otherwise: (``--flag``, this value, ``other``'s)."""
        mine, theirs = self._flags(), other._flags()
        return [
            (flag, mine.get(flag), theirs.get(flag))
            for flag in dict.fromkeys([*mine, *theirs])
            if mine.get(flag) != theirs.get(flag)
        ]

    def _flags(self) -> dict[str, Any]:
        """``--flag`` -> value, the provider's options included."""
        common = {
            _FLAG_OF.get(name, f"--{name.replace('_', '-')}"): getattr(self, name)
            for name in self.__dataclass_fields__
            if name != "options"
        }
        return {**common, **self.options.shown()}

    def idle_minutes(self) -> float | None:
        """The idle stop that applies to this pool (None: it never stops for being idle)."""
        minutes = self.idle_timeout
        if minutes is None:
            minutes = provider_class(self.provider).default_idle_minutes
        return minutes or None

    def settled(self) -> PoolSpec:
        """The spec as its provider completes it (one node per named host)."""
        return provider_class(self.provider).settle(self)


_FLAG_OF = {"frameworks": "--framework"}
"""The fields whose option is not named after them (``--framework`` may be given again)."""


def _chosen(own: Mapping[str, Any], current: str, flags: Mapping[str, Option]) -> str:
    """The provider that the provider options given choose: ``current`` when it takes them
    all, else the one provider that does.
    """
    if set(own) <= _dests(current):
        return current
    takers = [c.name for c in provider_classes() if set(own) <= _dests(c.name)]
    if len(takers) == 1:
        return takers[0]
    given = ", ".join(flags[d].flag for d in sorted(own))
    if takers:
        raise SpecError(
            f"{given}: an option of the {', '.join(takers)} providers; name one with --provider"
        )
    raise SpecError(f"no one provider takes {given} ({_owners(own)}): give one provider's only")


def _dests(provider: str) -> set[str]:
    return {o.dest for o in provider_class(provider).Options.declared().values()}


def _owners(dests: Iterable[str]) -> str:
    """Whose options ``dests`` are ("--ray-address is ray's; --partition is slurm's")."""
    parts = []
    for cls in provider_classes():
        theirs = {o.dest: o.flag for o in cls.Options.declared().values()}
        mine = [theirs[d] for d in sorted(dests) if d in theirs]
        if mine:
            parts.append(f"{', '.join(mine)} {'are' if len(mine) > 1 else 'is'} {cls.name}'s")
    return "; ".join(parts)


_RANGES = {
    "nodes": limits.NODES,
    "procs_per_node": limits.PROCS_PER_NODE,
    "heartbeat_timeout": limits.HEARTBEAT_TIMEOUT,
    "desync_after": limits.DESYNC_AFTER,
    "sync_cap": limits.SYNC_CAP,
    "idle_timeout": limits.IDLE_TIMEOUT,
}
"""The spec's numbers and the ranges they must be in."""


def backend_problem(
    backend: str | None, where: str, torch: str | None, nccl: bool | None, gpus: int
) -> str | None:
    """Why ``--backend`` cannot run on ranks ``where`` torch ``torch`` is (``nccl``: whether it
    has NCCL) and ``gpus`` GPUs are visible; None when it can, or when torch is missing (that is
    named on its own). The notebook asks before starting ranks that run its own torch; every
    rank's hello answers it for the others, before the group forms.
    """
    if backend != "nccl" or torch is None or nccl is None:
        return None
    if not nccl:
        return (
            f"--backend nccl: {where} has torch {torch}, which is built without NCCL; "
            "use --backend gloo, or a CUDA build of torch"
        )
    if gpus == 0:
        return (
            f"--backend nccl: {where} has no GPU that torch can use, and NCCL runs on GPUs "
            "only; use --backend gloo"
        )
    return None


_SECRET = re.compile(r"TOKEN|SECRET|PASSW|KEY|CREDENTIAL", re.I)
"""Names whose ``--env`` values a message never shows."""


def _shown(value: object) -> str:
    if value is None or value == ():
        return "(default)"
    if isinstance(value, tuple):
        return ",".join(_pair(v) if isinstance(v, tuple) else str(v) for v in value)
    return str(value)


def _pair(pair: tuple[str, ...]) -> str:
    name, text = pair
    return f"{name}=***" if _SECRET.search(name) else f"{name}={text}"

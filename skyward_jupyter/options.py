"""Every option of ``%%sky`` and ``%sky``, declared once: the pool's here, each provider's in its
own :class:`~skyward_jupyter.providers.base.ProviderOptions`.

The magics build their parsers, ``%%sky?``/``%sky?`` and their one-line errors from these
tables and from the providers installed. An option's parser checks its form only (a whole
number, KEY=VALUE); a provider's options are kept as their text until the pool's provider is
known, which parses them (:meth:`~skyward_jupyter.spec.PoolSpec.from_options`).
"""

from __future__ import annotations

import argparse
import difflib
import functools
import os
import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from . import limits
from .environments import requirement_lines
from .flags import Option as Option  # the magics read the rows' type from here
from .flags import (
    identifier,
    int_at_least,
    ranged,
    rank_set,
    result_name,
    switch,
    variable_name,
)
from .frameworks import FRAMEWORKS, KERAS_BACKENDS
from .gpus import parse_gpu
from .launch_env import check_user_env
from .providers import (
    BUILT_IN,
    DEFAULT,
    UnknownProvider,
    leave_out,
    names,
    provider_class,
    provider_classes,
)


def _env(text: str) -> tuple[str, str]:
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", text, re.S):
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    key, value = text.split("=", 1)
    try:
        check_user_env([key])
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return key, value


def _directory(text: str) -> str:
    path = os.path.abspath(os.path.expanduser(text))
    if not os.path.isdir(path):
        where = "" if path == text else f" ({path})"
        raise argparse.ArgumentTypeError(f"no such directory: {text}{where}")
    return path


def _requirements(text: str) -> tuple[str, ...]:
    """A requirements file's requirements, read now: the pool is described by what it holds."""
    try:
        content = Path(text).expanduser().read_text()
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot read {text}: {exc.strerror or exc}") from None
    lines = requirement_lines(content)
    if not lines:
        raise argparse.ArgumentTypeError(f"{text} names no requirement")
    return tuple(lines)


def _frameworks(text: str) -> list[str]:
    names = [n.strip().lower() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in FRAMEWORKS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown framework {', '.join(unknown) or text!r}; known: {', '.join(FRAMEWORKS)}"
        )
    return names


def _variable(text: str) -> str:
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", text):
        raise argparse.ArgumentTypeError(f"expected an environment variable's name, got {text!r}")
    return text


def _gpu(text: str) -> str:
    try:
        return parse_gpu(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _provider(text: str) -> str:
    if text not in names():
        raise argparse.ArgumentTypeError(f"unknown provider {text!r}; known: {', '.join(names())}")
    provider_groups()  # leaves out the providers whose options clash
    try:
        provider_class(text)
    except UnknownProvider as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


@functools.cache
def provider_groups() -> tuple[tuple[str, tuple[Option, ...]], ...]:
    """Each installed provider's own options, under its name, as the magics take them (their
    text, which the provider parses once it is known). A flag several providers declare is
    shown once, under all their names, with what it means to each. A provider that declares a
    pool's flag, or one another provider declared first with another action, is left out with
    a warning: the others' cells must still run. Made once per process, as the providers are
    found once (every cell's options read it).
    """
    owners: dict[str, list[tuple[str, Option]]] = {}
    pool = {o.flag for o in POOL_OPTIONS}
    # This package's own first: a plugin cannot take a flag from them by its name's order.
    for cls in sorted(provider_classes(), key=lambda c: c.name not in BUILT_IN):
        own = list(cls.Options.declared().values())
        clash = _clash(cls.name, own, pool, owners)
        if clash is not None:
            leave_out(cls.name, clash)
            continue
        for option in own:
            owners.setdefault(option.flag, []).append((cls.name, option))
    groups: dict[str, list[Option]] = {}
    for flag, declared in owners.items():
        first = declared[0][1]
        helps = dict.fromkeys(o.help for _, o in declared)
        help = first.help
        if len(helps) > 1:
            help = "; ".join(f"{name}: {o.help}" for name, o in declared)
        title = f"{', '.join(name for name, _ in declared)} provider"
        text = first.as_text()
        groups.setdefault(title, []).append(Option(flag, help, text.kwargs))
    return tuple((title, tuple(found)) for title, found in groups.items())


def _clash(
    name: str,
    declared: Iterable[Option],
    pool: set[str],
    owners: Mapping[str, list[tuple[str, Option]]],
) -> str | None:
    """Why provider ``name``'s options cannot join the others' (None: they can)."""
    for option in declared:
        if option.flag in pool:
            return (
                f"the {name} provider declares {option.flag}, which every pool has: a "
                "provider's options need names of their own; it is left out (update or "
                "uninstall its package)"
            )
        earlier = owners.get(option.flag)
        action = str(option.kwargs.get("action"))
        if earlier and str(earlier[0][1].kwargs.get("action")) != action:
            return (
                f"the {name} provider declares {option.flag} differently from the "
                f"{earlier[0][0]} provider: a flag providers share takes its values alike; it "
                "is left out (update or uninstall its package)"
            )
    return None


POOL_EXAMPLES = (("--nodes 2", "two ranks, torch.distributed ready"),)
"""``%%sky`` lines for the help, with what they do; each provider adds its own."""


def examples() -> list[tuple[str, str]]:
    """The help's examples: the pool's, then each provider's (:attr:`Provider.examples`)."""
    return [*POOL_EXAMPLES, *(e for cls in provider_classes() for e in cls.examples)]


def grouped(
    options: Sequence[Option], cell: Sequence[Option] = (), providers: bool = True
) -> list[tuple[str, list[Option]]]:
    """Options under the headings ``%%sky?`` shows: the pool's, the cell's output, then each
    provider's own (the help stays generated from the tables).
    """
    groups = [("pool", list(options))]
    if cell:
        groups.append(("output", list(cell)))
    if providers:
        groups += [(title, list(found)) for title, found in provider_groups()]
    return [(title, found) for title, found in groups if found]


POOL_OPTIONS: tuple[Option, ...] = (
    Option("--nodes", "nodes in the pool (default 1)", {"type": ranged(limits.NODES)}),
    Option(
        "--procs-per-node",
        "ranks per node (default: one per GPU, or 1)",
        {"type": ranged(limits.PROCS_PER_NODE)},
    ),
    Option(
        "--provider",
        f"where the nodes come from: {', '.join(names())} (default {DEFAULT}); a provider's own "
        "options below choose it by themselves",
        {"type": _provider},
    ),
    Option(
        "--gpu",
        "GPU model as the machines report it (H100, H200, B200, RTX 4090, ...; compared by "
        "model), or none for CPU ranks on GPU machines",
        {"type": _gpu},
    ),
    Option("--name", "pool name (several pools per kernel)", {"type": identifier}),
    Option("--backend", "torch.distributed backend (auto)", {"choices": ("gloo", "nccl")}),
    Option(
        "--secure",
        "gloo's traffic between hosts through TLS tunnels proving the pool's key, gloo "
        "listening on loopback only (for networks shared with others; slower, see "
        "BENCHMARKS.md; gloo only)",
        switch(),
    ),
    Option(
        "--env",
        "environment variable for every rank, set before torch starts (repeatable)",
        {"type": _env, "action": "append", "metavar": "KEY=VALUE"},
    ),
    Option(
        "--framework",
        "what the ranks set up: torch (default, when installed), jax (jax.distributed), "
        "none; repeatable or comma-separated",
        {"type": _frameworks, "action": "extend", "metavar": "NAME", "dest": "frameworks"},
    ),
    Option(
        "--keras-backend",
        "KERAS_BACKEND on every rank, before Keras is imported (jax also sets up JAX)",
        {"choices": KERAS_BACKENDS},
    ),
    Option(
        "--hf-token-env",
        "the notebook's variable holding the Hugging Face token that the ranks get as "
        "HF_TOKEN (default: HF_TOKEN, when set); it travels over the ranks' channel only",
        {"type": _variable, "metavar": "VAR"},
    ),
    Option(
        "--heartbeat-timeout",
        "declare a rank lost after S seconds without its heartbeat (default 5)",
        {"type": ranged(limits.HEARTBEAT_TIMEOUT), "metavar": "S"},
    ),
    Option(
        "--desync-after",
        "fail a cell when ranks wait S seconds in a collective that finished ranks will not "
        "join (default 1.5)",
        {"type": ranged(limits.DESYNC_AFTER), "metavar": "S"},
    ),
    Option(
        "--sync",
        "directory whose files the nodes get, kept in step before every cell (repeatable; "
        "default: the notebook's working directory, where nodes do not share it)",
        {"type": _directory, "action": "append", "metavar": "DIR"},
    ),
    Option("--no-sync", "send no directory to the nodes", switch()),
    Option(
        "--pip",
        "packages every node installs before its ranks start, as pip reads them (several per "
        "flag, repeatable; built once per node and cached, over what the node's Python has)",
        {"nargs": "+", "action": "extend", "metavar": "SPEC"},
    ),
    Option(
        "--requirements",
        "a requirements file whose packages every node installs, as --pip (read when given)",
        {"type": _requirements, "metavar": "FILE"},
    ),
    Option(
        "--mirror",
        "every node also installs the notebook's versions of the packages behind the modules "
        "bound in the notebook (where it lacks them or has others; torch stays the node's)",
        switch(),
    ),
    Option(
        "--ship-wheels",
        "the nodes install --pip/--requirements from wheels this notebook downloads and sends "
        "(nodes that reach no package index; they must share this machine's platform)",
        switch(),
    ),
    Option(
        "--sync-cap",
        "the most a synced directory may hold, in MB (default 200)",
        {"type": ranged(limits.SYNC_CAP), "metavar": "MB"},
    ),
    Option(
        "--idle-timeout",
        "stop the pool after MIN minutes without a cell (0: never; default: the provider's, "
        "30 for paid machines, else never)",
        {"type": ranged(limits.IDLE_TIMEOUT), "metavar": "MIN"},
    ),
)
"""What every pool has (:class:`~skyward_jupyter.spec.PoolSpec`, ``--name`` aside): one
``Option(flag, help, argparse keywords)`` a row; a provider's own options are its own."""

StdoutMode = Literal["head", "all", "none"]
STDOUT = Option(
    "--stdout",
    "whose stdout the cell shows: the head's (default), every rank's, or none",
    {"choices": ("head", "all", "none")},
)
TIMEOUT = Option(
    "--timeout", "stop the cell (or script) after SECONDS", {"type": ranged(limits.TIMEOUT)}
)
CELL_OPTIONS: tuple[Option, ...] = (
    Option(
        "--ranks",
        "run the cell on these ranks only (0, 0,2-3); the others keep their state and are not "
        "blocked; a collective there fails in seconds",
        {"type": rank_set, "metavar": "RANKS"},
    ),
    Option("--head", "run the cell on the head only (--ranks 0)", {"action": "store_true"}),
    STDOUT,
    Option("--all", "display every rank's last value", {"action": "store_true"}),
    Option("--out", "store the per-rank result in NAME", {"type": result_name}),
    TIMEOUT,
)


TORCHRUN: dict[str, str] = {
    "--nproc-per-node": "--procs-per-node",
    "--nnodes": "--nodes",
    "--master-addr": "the pool's head is its provider's to choose (its options: %%sky?)",
    "--node-rank": "the pool numbers its nodes itself: give --nodes N",
    "--master-port": "the pool chooses a free port itself",
    "--standalone": "every pool has its own rendezvous",
    "--rdzv-backend": "the pool runs its own rendezvous",
    "--rdzv-endpoint": "the pool runs its own rendezvous",
    "--rdzv-id": "the pool runs its own rendezvous",
}
"""torchrun's options (``_`` spellings too): the option that says the same here, or why none
is needed."""


_CELLS_OWN = {o.flag: f"%%sky {o.flag} ..." for o in CELL_OPTIONS}
"""A cell's options, named as such where another command is given one (``%sky config
--timeout`` is no default: a cell's timeout is its own)."""


def unknown_option(given: str, known: Collection[str]) -> str:
    """Why ``given`` is refused among the ``known`` options, in one line: torchrun's spelling
    with ours, or the options it is near (none is ever taken for it: no abbreviation expands).
    """
    flag = given.split("=", 1)[0]
    ours = TORCHRUN.get(flag.replace("_", "-")) if flag.startswith("--") else None
    if ours is not None and "--nodes" in known:
        if ours in known:
            return f"unknown option {flag}: that is torchrun's spelling; here it is {ours}"
        if not ours.startswith("--"):
            return f"unknown option {flag}: that is torchrun's; {ours}"
    near = difflib.get_close_matches(flag, known, n=2, cutoff=0.8)
    near += [k for k in sorted(known) if len(flag) > 2 and k.startswith(flag) and k not in near]
    hint = f"; did you mean {' or '.join(near[:3])}?" if near else ""
    if flag in _CELLS_OWN and flag not in known:  # (with what is near: --ranks is near --rank)
        return f"unknown option {flag}: it is a %%sky cell's own option ({_CELLS_OWN[flag]}){hint}"
    return f"unknown option {flag}{hint}"


def provider_given(args: argparse.Namespace) -> dict[str, Any]:
    """The providers' options given in ``args``: a flag's dest -> its text (None: not given)."""
    return {o.dest: getattr(args, o.dest) for _, group in provider_groups() for o in group}


def pool_options(args: argparse.Namespace) -> dict[str, Any]:
    """The pool options given in ``args`` (None where not given), ``--name`` aside, the
    providers' own included.
    """
    common = {o.dest: getattr(args, o.dest) for o in POOL_OPTIONS if o.dest != "name"}
    return {**common, **provider_given(args)}


@dataclass(frozen=True, slots=True)
class Command:
    """A ``%sky`` line command: its arguments beyond the shared option groups, and its help.

    ``pool``: it takes the pool's options (and the providers'); ``providers``: the providers'
    own options only.
    """

    name: str
    usage: str
    help: str
    pool: bool = False
    providers: bool = False
    extra: Sequence[Option] = ()
    positionals: Sequence[tuple[str, dict[str, Any]]] = ()


COMMANDS: tuple[Command, ...] = (
    Command("up", "[pool options]", "start a pool without running code", pool=True),
    Command(
        "run",
        "[pool options] [--stdout M] [--timeout S] SCRIPT [ARGS ...]",
        "run a torchrun script on every rank as __main__, with sys.argv = [SCRIPT, *ARGS], "
        "in its own directory",
        pool=True,
        extra=(STDOUT, TIMEOUT),
        positionals=(
            ("script", {"nargs": "?", "metavar": "SCRIPT", "help": "the script to run"}),
            (
                "args",
                {
                    "nargs": argparse.REMAINDER,
                    "metavar": "ARGS",
                    "help": "the script's arguments: all that follows SCRIPT (--help too) is "
                    "the script's, as with torchrun",
                },
            ),
        ),
    ),
    Command(
        "down",
        "[NAME | --all] [--keep-files]",
        "shut a pool down (the current one by default); its nodes remove their copy of the "
        "synced directories unless --keep-files",
        extra=(
            Option("--all", "every pool of this kernel", {"action": "store_true"}),
            Option(
                "--keep-files",
                "leave the copy of the synced directories on the nodes (the next pool of this "
                "directory then sends only what changed)",
                {"action": "store_true"},
            ),
        ),
        positionals=(("name", {"nargs": "?", "type": identifier}),),
    ),
    Command("status", "", "list pools and their ranks"),
    Command(
        "auto",
        "[on | off]",
        "plain cells run on the current pool as if they began with %%sky (cells with magics, "
        "! or ? and %%local cells run in the notebook); off when the pool is shut down; "
        "alone: say which",
        positionals=(("state", {"nargs": "?", "choices": ("on", "off")}),),
    ),
    Command(
        "clean",
        "[provider options]",
        "remove from the current pool's hosts (or the hosts its provider's options name) the "
        "package cache and the copies of synced directories that no running pool uses, and "
        "say how much went",
        providers=True,
    ),
    Command(
        "stacks",
        "[NAME]",
        "every rank's Python stacks, and the collective each waits in (also from the panel's "
        "Stacks button while a cell runs)",
        positionals=(("name", {"nargs": "?", "type": identifier}),),
    ),
    Command(
        "who",
        "[NAME] [--ranks RANKS]",
        "the names bound on the head (or on --ranks), as %whos lists the notebook's: type, and "
        "shape, dtype and device for tensors and arrays",
        extra=(
            Option(
                "--ranks",
                "list these ranks' names (0, 0,2-3; default: the head)",
                {"type": rank_set, "metavar": "RANKS"},
            ),
        ),
        positionals=(("name", {"nargs": "?", "type": identifier}),),
    ),
    Command(
        "restart",
        "[NAME]",
        "fresh rank processes and worlds on the same machines (forked from warm templates)",
        positionals=(("name", {"nargs": "?", "type": identifier}),),
    ),
    Command(
        "pull",
        "NAME [--rank K | --all]",
        "bring a rank's variable into the notebook",
        extra=(
            Option("--rank", "the rank to read (0)", {"type": int_at_least(0), "default": 0}),
            Option("--all", "every rank's value, as a list", {"action": "store_true"}),
        ),
        positionals=(("name", {"type": variable_name}),),
    ),
    Command(
        "push",
        "NAME [NAME ...]",
        "send notebook variables to every rank now",
        positionals=(("names", {"nargs": "+", "type": variable_name}),),
    ),
    Command(
        "config",
        "[pool options] [--stdout M]",
        "defaults for later cells (pool options, --stdout)",
        pool=True,
        extra=(STDOUT,),
    ),
    Command(
        "panel",
        "[NAME]",
        "show the pool's live panel (text without widgets)",
        positionals=(("name", {"nargs": "?", "type": identifier}),),
    ),
    Command(
        "metrics",
        "[NAME]",
        "what log() recorded: step, name, mean, min, max, ranks across ranks "
        "(a DataFrame with pandas, else a list)",
        positionals=(("name", {"nargs": "?", "type": identifier}),),
    ),
    Command(
        "sweep",
        "[--yes] [--all-owners] [provider options]",
        "list what providers made that no live pool owns (cloud instances and what was made "
        "with them; a provider's options say where to look); --yes ends them",
        providers=True,
        extra=(
            Option("--yes", "end what is found", {"action": "store_true"}),
            Option("--all-owners", "not only this user@host's", {"action": "store_true"}),
        ),
    ),
)

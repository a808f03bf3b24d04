"""Every option of ``%%sky`` and ``%sky``, declared once.

The magics build their parsers, ``%%sky?``/``%sky?`` and their one-line errors from these
tables; the session reads which provider an option belongs to (``--hosts`` alone means SSH).
An option's parser checks its form only (a whole number, KEY=VALUE); what it means for a
provider is that provider's to check when the pool is made.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from . import limits
from .environments import requirement_lines
from .frameworks import FRAMEWORKS, KERAS_BACKENDS
from .gpus import parse_gpu
from .limits import LimitError, Range
from .providers import names


def _int_at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return parse


def _ranged(limit: Range) -> Callable[[str], float]:
    """A parser for a number option, checked against its range (finite, within bounds)."""

    def parse(text: str) -> float:
        try:
            return limit.parse(text)
        except LimitError as exc:
            raise argparse.ArgumentTypeError(exc.why) from None

    return parse


def _env(text: str) -> tuple[str, str]:
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", text, re.S):
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    key, value = text.split("=", 1)
    return key, value


def _hosts(text: str) -> tuple[str, ...]:
    hosts = tuple(h.strip() for h in text.split(",") if h.strip())
    if not hosts:
        raise argparse.ArgumentTypeError("expected user@host[:port],...")
    return hosts


def _directory(text: str) -> str:
    path = os.path.abspath(os.path.expanduser(text))
    if not os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"no such directory: {text} ({path})")
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
    return text


def identifier(text: str) -> str:
    if not text.isidentifier():
        raise argparse.ArgumentTypeError(f"expected a variable name, got {text!r}")
    return text


@dataclass(frozen=True, slots=True)
class Option:
    """One ``--flag``: argparse's keywords, and the provider it belongs to (if any)."""

    flag: str
    help: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    provider: str | None = None

    @property
    def dest(self) -> str:
        return str(self.kwargs.get("dest") or self.flag.lstrip("-").replace("-", "_"))

    def add_to(self, parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
        parser.add_argument(self.flag, help=self.help, **self.kwargs)


def grouped(
    options: Sequence[Option], cell: Sequence[Option] = ()
) -> list[tuple[str, list[Option]]]:
    """Options under the headings ``%%sky?`` shows: the pool's, the cell's output, then each
    provider's own, in the order the table names them (the help stays generated from it)."""
    groups: dict[str, list[Option]] = {"pool": []}
    if cell:
        groups["output"] = list(cell)
    for option in options:
        title = f"{option.provider} provider" if option.provider else "pool"
        groups.setdefault(title, []).append(option)
    return [(title, found) for title, found in groups.items() if found]


def _flag(**kwargs: Any) -> dict[str, Any]:
    """A boolean option that is None (not given) rather than False, so defaults can fill it."""
    return {"action": "store_true", "default": None, **kwargs}


POOL_OPTIONS: tuple[Option, ...] = (
    Option("--nodes", "nodes in the pool (default 1)", {"type": _ranged(limits.NODES)}),
    Option(
        "--procs-per-node",
        "ranks per node (default: one per GPU, or 1)",
        {"type": _ranged(limits.PROCS_PER_NODE)},
    ),
    Option(
        "--provider",
        "where the nodes come from: local (default), ssh, aws, or a registered provider",
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
        _flag(),
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
        {"type": _ranged(limits.HEARTBEAT_TIMEOUT), "metavar": "S"},
    ),
    Option(
        "--desync-after",
        "fail a cell when ranks wait S seconds in a collective that finished ranks will not "
        "join (default 1.5)",
        {"type": _ranged(limits.DESYNC_AFTER), "metavar": "S"},
    ),
    Option(
        "--sync",
        "directory whose files the nodes get, kept in step before every cell (repeatable; "
        "default: the notebook's working directory, where nodes do not share it)",
        {"type": _directory, "action": "append", "metavar": "DIR"},
    ),
    Option("--no-sync", "send no directory to the nodes", _flag()),
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
        _flag(),
    ),
    Option(
        "--ship-wheels",
        "the nodes install --pip/--requirements from wheels this notebook downloads and sends "
        "(nodes that reach no package index; they must share this machine's platform)",
        _flag(),
    ),
    Option(
        "--sync-cap",
        "the most a synced directory may hold, in MB (default 200)",
        {"type": _ranged(limits.SYNC_CAP), "metavar": "MB"},
    ),
    Option(
        "--idle-timeout",
        "stop the pool after MIN minutes without a cell (0: never; aws: 30 by default)",
        {"type": _ranged(limits.IDLE_TIMEOUT), "metavar": "MIN"},
    ),
    Option(
        "--hosts",
        "machines to use over SSH, one node each (implies --provider ssh)",
        {"type": _hosts, "metavar": "USER@HOST[:PORT],..."},
        provider="ssh",
    ),
    Option("--identity", "SSH private key file", {"metavar": "KEY"}, provider="ssh"),
    Option("--known-hosts", "known_hosts file for host keys", {"metavar": "FILE"}, provider="ssh"),
    Option(
        "--accept-new-host-keys",
        "record an unknown host's key in known_hosts and trust it (OpenSSH's accept-new; "
        "a changed key is still refused)",
        _flag(),
        provider="ssh",
    ),
    Option("--python", "Python on the hosts (python3)", {"metavar": "PATH"}),
    Option(
        "--head-addr",
        "the head's address as the other hosts reach it",
        {"metavar": "ADDR"},
        provider="ssh",
    ),
    Option(
        "--instance-type",
        "EC2 instance type (default: from --gpu)",
        {"metavar": "TYPE"},
        provider="aws",
    ),
    Option("--region", "AWS region (default: boto3's)", {"metavar": "REGION"}, provider="aws"),
    Option(
        "--spot", "spot instances, on-demand when spot has no capacity", _flag(), provider="aws"
    ),
    Option(
        "--ssh-cidr",
        "where SSH to the instances may come from (default: this notebook's address/32)",
        {"metavar": "CIDR"},
        provider="aws",
    ),
    Option("--ami", "image (default: the Deep Learning AMI)", {"metavar": "ID"}, provider="aws"),
    Option("--partition", "Slurm partition", {"metavar": "P"}, provider="slurm"),
    Option("--account", "Slurm account to charge", {"metavar": "A"}, provider="slurm"),
    Option("--time", "Slurm time limit (e.g. 1:00:00)", {"metavar": "T"}, provider="slurm"),
    Option("--qos", "Slurm quality of service", {"metavar": "Q"}, provider="slurm"),
    Option(
        "--gpus-per-node",
        "GPUs per Slurm node",
        {"type": _ranged(limits.GPUS_PER_NODE)},
        provider="slurm",
    ),
    Option("--constraint", "Slurm node features", {"metavar": "C"}, provider="slurm"),
    Option(
        "--ray-address",
        "the Ray cluster to join (default: RAY_ADDRESS, else auto)",
        {"metavar": "ADDR"},
        provider="ray",
    ),
    Option(
        "--slurm-arg",
        "another sbatch option, as sbatch reads it (repeatable; e.g. --slurm-arg=--exclusive)",
        {"action": "append", "metavar": "ARG", "dest": "slurm_args"},
        provider="slurm",
    ),
)
"""What a pool is (:class:`~skyward_jupyter.spec.PoolSpec`, ``--name`` aside)."""

StdoutMode = Literal["head", "all", "none"]
STDOUT = Option(
    "--stdout",
    "whose stdout the cell shows: the head's (default), every rank's, or none",
    {"choices": ("head", "all", "none")},
)
TIMEOUT = Option(
    "--timeout", "stop the cell (or script) after SECONDS", {"type": _ranged(limits.TIMEOUT)}
)
CELL_OPTIONS: tuple[Option, ...] = (
    STDOUT,
    Option("--all", "display every rank's last value", {"action": "store_true"}),
    Option("--out", "store the per-rank result in NAME", {"type": identifier}),
    TIMEOUT,
)


TORCHRUN: dict[str, str] = {
    "--nproc-per-node": "--procs-per-node",
    "--nnodes": "--nodes",
    "--master-addr": "--head-addr",
    "--node-rank": "the pool numbers its nodes itself: give --nodes N",
    "--master-port": "the pool chooses a free port itself",
    "--standalone": "every pool has its own rendezvous",
    "--rdzv-backend": "the pool runs its own rendezvous",
    "--rdzv-endpoint": "the pool runs its own rendezvous",
    "--rdzv-id": "the pool runs its own rendezvous",
}
"""torchrun's options (``_`` spellings too): the option that says the same here, or why none
is needed."""


def unknown_option(given: str, known: Collection[str]) -> str:
    """Why ``given`` is refused among the ``known`` options, in one line: torchrun's spelling
    with ours, or the options it is near (none is ever taken for it: no abbreviation expands)."""
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
    return f"unknown option {flag}{hint}"


_POOL_DESTS = tuple(o.dest for o in POOL_OPTIONS if o.dest != "name")


def pool_options(args: argparse.Namespace) -> dict[str, Any]:
    """The pool options given in ``args`` (None where not given), ``--name`` aside."""
    return {dest: getattr(args, dest) for dest in _POOL_DESTS}


def implied_provider(given: dict[str, Any]) -> str | None:
    """The provider that the options given choose by themselves (``--hosts``: ssh)."""
    owners = {o.provider for o in POOL_OPTIONS if o.provider and given.get(o.dest) is not None}
    return owners.pop() if len(owners) == 1 else None


@dataclass(frozen=True, slots=True)
class Command:
    """A ``%sky`` line command: its arguments beyond the shared option groups, and its help."""

    name: str
    usage: str
    help: str
    pool: bool = False
    extra: Sequence[Option] = ()
    positionals: Sequence[tuple[str, dict[str, Any]]] = ()


CLEAN_OPTIONS = tuple(
    o
    for o in POOL_OPTIONS
    if o.flag in {"--hosts", "--identity", "--known-hosts", "--accept-new-host-keys", "--python"}
)
"""What ``%sky clean`` needs to reach hosts that no pool is using."""

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
        "clean",
        "[--hosts USER@HOST,... [SSH options]]",
        "remove from the current pool's hosts (or the hosts named) the package cache and the "
        "copies of synced directories that no running pool uses, and say how much went",
        extra=CLEAN_OPTIONS,
    ),
    Command(
        "stacks",
        "[NAME]",
        "every rank's Python stacks, and the collective each waits in (also from the panel's "
        "Stacks button while a cell runs)",
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
            Option("--rank", "the rank to read (0)", {"type": _int_at_least(0), "default": 0}),
            Option("--all", "every rank's value, as a list", {"action": "store_true"}),
        ),
        positionals=(("name", {"type": identifier}),),
    ),
    Command(
        "push",
        "NAME [NAME ...]",
        "send notebook variables to every rank now",
        positionals=(("names", {"nargs": "+", "type": identifier}),),
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
        "[--yes] [--region R] [--all-owners]",
        "list what providers made that no live pool owns (EC2 instances and their key pairs, "
        "security and placement groups); --yes ends them",
        extra=(
            Option("--yes", "end what is found", {"action": "store_true"}),
            Option("--region", "where to look (default: the provider's)", {}),
            Option("--all-owners", "not only this user@host's", {"action": "store_true"}),
        ),
    ),
)

"""``%%sky`` and ``%sky``: parse the options, call the session. Nothing else lives here."""

from __future__ import annotations

import argparse
import functools
import re
import shlex
from collections.abc import Callable
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class

from .capture import CaptureError
from .providers.base import ProviderError
from .results import CellInterrupted, PoolError, RunResult
from .session import PROVIDERS, Session, SessionError, check_gpu_name

_POOL_OPTIONS = (
    "provider",
    "nodes",
    "procs_per_node",
    "gpu",
    "backend",
    "env",
    "hosts",
    "identity",
    "known_hosts",
    "accept_new_host_keys",
    "python",
    "head_addr",
    "instance_type",
    "region",
    "spot",
    "ssh_cidr",
    "ami",
    "idle_timeout",
)


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


_positive_int = _int_at_least(1)
_non_negative_int = _int_at_least(0)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be more than 0 seconds, got {text}")
    return value


def _minutes(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected minutes, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 (never) or more minutes, got {text}")
    return value


def _env(text: str) -> tuple[str, str]:
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", text, re.S):
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    key, value = text.split("=", 1)
    return key, value


def _hosts(text: str) -> tuple[str, ...]:
    from .providers.ssh import Host

    hosts = tuple(h.strip() for h in text.split(",") if h.strip())
    try:
        for h in hosts:
            Host.parse(h)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not hosts:
        raise argparse.ArgumentTypeError("expected user@host[:port],...")
    return hosts


def _gpu(text: str) -> str:
    try:
        return check_gpu_name(text)
    except SessionError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _identifier(text: str) -> str:
    if not text.isidentifier():
        raise argparse.ArgumentTypeError(f"expected a variable name, got {text!r}")
    return text


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # one line, no usage dump, no SystemExit
        raise UsageError(f"%{self.prog}: {message}")


def _add_pool_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nodes", type=_positive_int, help="nodes in the pool (default 1)")
    parser.add_argument(
        "--procs-per-node", type=_positive_int, help="ranks per node (default: one per GPU, or 1)"
    )
    parser.add_argument("--provider", choices=PROVIDERS, help="where the nodes come from (local)")
    parser.add_argument("--gpu", type=_gpu, help="GPU model, e.g. T4, A10G, L4, A100, H100")
    parser.add_argument("--name", type=_identifier, help="pool name (several pools per kernel)")
    parser.add_argument(
        "--backend", choices=("gloo", "nccl"), help="torch.distributed backend (auto)"
    )
    parser.add_argument(
        "--env",
        type=_env,
        action="append",
        metavar="KEY=VALUE",
        help="environment variable for every rank, set before torch starts (repeatable)",
    )
    parser.add_argument(
        "--hosts",
        type=_hosts,
        metavar="USER@HOST[:PORT],...",
        help="machines to use over SSH, one node each (implies --provider ssh)",
    )
    parser.add_argument("--identity", metavar="KEY", help="SSH private key file")
    parser.add_argument("--known-hosts", metavar="FILE", help="known_hosts file for host keys")
    parser.add_argument(
        "--accept-new-host-keys",
        action="store_true",
        default=None,
        help="accept host keys not in known_hosts (an explicit choice; default: refuse)",
    )
    parser.add_argument("--python", metavar="PATH", help="Python on the hosts (python3)")
    parser.add_argument(
        "--head-addr", metavar="ADDR", help="the head's address as the other hosts reach it"
    )
    parser.add_argument(
        "--instance-type", metavar="TYPE", help="EC2 instance type (default: from --gpu)"
    )
    parser.add_argument("--region", metavar="REGION", help="AWS region (default: boto3's)")
    parser.add_argument(
        "--spot",
        action="store_true",
        default=None,
        help="spot instances, on-demand when spot has no capacity",
    )
    parser.add_argument(
        "--ssh-cidr",
        metavar="CIDR",
        help="where SSH to the instances may come from (default: this notebook's address/32)",
    )
    parser.add_argument("--ami", metavar="ID", help="image (default: the Deep Learning AMI)")
    parser.add_argument(
        "--idle-timeout",
        type=_minutes,
        metavar="MIN",
        help="stop the pool after MIN minutes without a cell (0: never; aws: 30 by default)",
    )


def _add_cell_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--stdout",
        choices=("head", "all", "none"),
        help="whose stdout the cell shows: the head's (default), every rank's, or none",
    )
    parser.add_argument("--all", action="store_true", help="display every rank's last value")
    parser.add_argument("--out", type=_identifier, help="store the per-rank result in NAME")
    parser.add_argument("--timeout", type=_seconds, help="stop the cell after SECONDS")


@functools.cache
def _cell_parser() -> _Parser:
    parser = _Parser(prog="%sky", add_help=False, description="Run the cell on every rank.")
    _add_pool_options(parser)
    _add_cell_options(parser)
    return parser


@functools.cache
def _line_parsers() -> dict[str, _Parser]:
    up = _Parser(prog="sky up", add_help=False)
    _add_pool_options(up)
    down = _Parser(prog="sky down", add_help=False)
    down.add_argument("name", nargs="?", type=_identifier)
    down.add_argument("--all", action="store_true")
    pull = _Parser(prog="sky pull", add_help=False)
    pull.add_argument("name", type=_identifier)
    which = pull.add_mutually_exclusive_group()
    which.add_argument("--rank", type=_non_negative_int, default=0)
    which.add_argument("--all", action="store_true")
    push = _Parser(prog="sky push", add_help=False)
    push.add_argument("names", nargs="+", type=_identifier)
    config = _Parser(prog="sky config", add_help=False)
    _add_pool_options(config)
    config.add_argument("--stdout", choices=("head", "all", "none"))
    restart = _Parser(prog="sky restart", add_help=False)
    restart.add_argument("name", nargs="?", type=_identifier)
    run = _Parser(prog="sky run", add_help=False)
    _add_pool_options(run)
    run.add_argument("--stdout", choices=("head", "all", "none"))
    run.add_argument("--timeout", type=_seconds)
    run.add_argument("script", metavar="SCRIPT")
    run.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS")
    status = _Parser(prog="sky status", add_help=False)
    panel = _Parser(prog="sky panel", add_help=False)
    panel.add_argument("name", nargs="?", type=_identifier)
    metrics = _Parser(prog="sky metrics", add_help=False)
    metrics.add_argument("name", nargs="?", type=_identifier)
    sweep = _Parser(prog="sky sweep", add_help=False)
    sweep.add_argument("--yes", action="store_true")
    sweep.add_argument("--region")
    sweep.add_argument("--all-owners", action="store_true")
    return {
        "up": up,
        "run": run,
        "down": down,
        "status": status,
        "restart": restart,
        "pull": pull,
        "push": push,
        "config": config,
        "panel": panel,
        "metrics": metrics,
        "sweep": sweep,
    }


_LINE_HELP = """
Line magic:
  %sky up [pool options]          start a pool without running code
  %sky run [pool options] [--stdout M] [--timeout S] SCRIPT [ARGS ...]
                                  run a torchrun script on every rank as __main__, with
                                  sys.argv = [SCRIPT, *ARGS], in its own directory
  %sky down [NAME | --all]        shut a pool down (the current one by default)
  %sky status                     list pools and their ranks
  %sky restart [NAME]             fresh rank processes and process group, same pool
  %sky pull NAME [--rank K|--all] bring a rank's variable into the notebook
  %sky push NAME [NAME ...]       send notebook variables to every rank now
  %sky config [options]           defaults for later cells (pool options, --stdout)
  %sky panel [NAME]               show the pool's live panel (text without widgets)
  %sky metrics [NAME]             what log() recorded: step, name, mean, min, max, ranks
                                  across ranks (a DataFrame with pandas, else a list)
  %sky sweep [--yes] [--region R] [--all-owners]
                                  list EC2 instances of this product that no live pool owns;
                                  --yes terminates them and deletes their pools' resources
"""


@magics_class
class SkyMagics(Magics):
    def __init__(self, shell: Any, session: Session) -> None:
        super().__init__(shell)
        self.session = session

    @property
    def _user_ns(self) -> dict[str, Any]:
        assert self.shell is not None
        namespace: dict[str, Any] = self.shell.user_ns
        return namespace

    @line_cell_magic
    def sky(self, line: str, cell: str | None = None) -> Any:
        try:
            if cell is None:
                return self._line(line)
            return self._cell(line, cell)
        except (SessionError, CaptureError, PoolError, ProviderError) as exc:
            raise UsageError(str(exc)) from None
        except CellInterrupted:
            raise KeyboardInterrupt from None  # as a local cell's Ctrl-C looks

    def _cell(self, line: str, cell: str) -> RunResult | None:
        args = _cell_parser().parse_args(shlex.split(line))
        compile(cell, "<%%sky cell>", "exec")  # a syntax error fails here, before a pool starts
        pool_options = {k: getattr(args, k) for k in _POOL_OPTIONS}
        # Options describe a whole pool (the configured defaults fill the rest); none: current.
        spec = None
        if any(v is not None for v in pool_options.values()):
            spec = self.session.spec_from(pool_options)
        result = self.session.run_cell(
            cell,
            self._user_ns,
            name=args.name,
            spec=spec,
            stdout=args.stdout,
            timeout=args.timeout,
        )
        if args.out:
            self._user_ns[args.out] = result
        result.raise_for_errors()
        if all(r.value_repr is None for r in result):
            return None
        return result.with_display(every_rank=args.all)

    def _line(self, line: str) -> Any:
        words = shlex.split(line)
        if not words:
            raise UsageError("%sky needs a command: " + ", ".join(_line_parsers()))
        command, rest = words[0], words[1:]
        parsers = _line_parsers()
        if command not in parsers:
            raise UsageError(f"%sky: unknown command {command!r}; one of {', '.join(parsers)}")
        args = parsers[command].parse_args(rest)
        session = self.session
        if command == "up":
            pool_options = {k: getattr(args, k) for k in _POOL_OPTIONS}
            session.entry(args.name, session.spec_from(pool_options))
        elif command == "run":
            pool_options = {k: getattr(args, k) for k in _POOL_OPTIONS}
            spec = None
            if any(v is not None for v in pool_options.values()):
                spec = session.spec_from(pool_options)
            session.run_script(
                args.script,
                args.args,
                name=args.name,
                spec=spec,
                stdout=args.stdout,
                timeout=args.timeout,
            ).raise_for_errors()
        elif command == "down":
            session.down_all() if args.all else session.down(args.name)
        elif command == "status":
            print(session.status())
        elif command == "restart":
            session.restart(args.name)
        elif command == "pull":
            value = session.pull(args.name, "all" if args.all else args.rank)
            self._user_ns[args.name] = value
        elif command == "push":
            result = session.push(args.names, self._user_ns)
            print(f"pushed {', '.join(args.names)}: {result.shipped_bytes} bytes to each rank")
        elif command == "config":
            options = {k: getattr(args, k) for k in _POOL_OPTIONS}
            session.defaults = session.spec_from(options)
            if args.stdout:
                session.stdout_mode = args.stdout
            print(f"defaults: {session.defaults.describe()}, stdout {session.stdout_mode}")
        elif command == "panel":
            session.panel(args.name)
        elif command == "metrics":
            return session.metrics(args.name)
        elif command == "sweep":
            print(session.sweep(yes=args.yes, region=args.region, all_owners=args.all_owners))
        return None


SkyMagics.sky.__doc__ = (
    "Run the cell on every rank of a warm pool, with torch.distributed initialised.\n\n"
    + _cell_parser().format_help()
    + _LINE_HELP
)

"""``%%sky`` and ``%sky``: parse the options, call the session. Nothing else lives here.

The parsers and the help text are built from the one table of options and commands in
:mod:`skyward_jupyter.options`.
"""

from __future__ import annotations

import argparse
import functools
import shlex
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class

from .options import CELL_OPTIONS, CLEAN_OPTIONS, COMMANDS, POOL_OPTIONS, Command, pool_options
from .session import USER_ERRORS, CellInterrupted, RunResult, Session


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # one line, no usage dump, no SystemExit
        raise UsageError(f"%{self.prog}: {message}")


@functools.cache
def _cell_parser() -> _Parser:
    parser = _Parser(prog="%sky", add_help=False, description="Run the cell on every rank.")
    for option in (*POOL_OPTIONS, *CELL_OPTIONS):
        option.add_to(parser)
    return parser


def _command_parser(command: Command) -> _Parser:
    parser = _Parser(prog=f"sky {command.name}", add_help=False)
    for option in (*(POOL_OPTIONS if command.pool else ()), *command.extra):
        option.add_to(parser)
    for name, kwargs in command.positionals:
        parser.add_argument(name, **kwargs)
    return parser


@functools.cache
def _line_parsers() -> dict[str, _Parser]:
    return {c.name: _command_parser(c) for c in COMMANDS}


def _line_help() -> str:
    lines = ["Line magic:"]
    for c in COMMANDS:
        head = f"  %sky {c.name} {c.usage}".rstrip()
        if len(head) < 34:
            lines.append(f"{head:<34}{c.help}")
        else:
            lines += [head, f"{'':<34}{c.help}"]
    return "\n".join(lines) + "\n"


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
        except USER_ERRORS as exc:
            raise UsageError(str(exc)) from None
        except CellInterrupted:
            raise KeyboardInterrupt from None  # as a local cell's Ctrl-C looks

    def _spec(self, args: argparse.Namespace) -> Any:
        """The pool the options describe (the configured defaults fill the rest); None when
        no pool option was given: the current pool."""
        given = pool_options(args)
        if all(v is None for v in given.values()):
            return None
        return self.session.spec_from(given)

    def _cell(self, line: str, cell: str) -> RunResult | None:
        args = _cell_parser().parse_args(shlex.split(line))
        result = self.session.run_cell(
            cell,
            self._user_ns,
            name=args.name,
            spec=self._spec(args),
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
        parsers = _line_parsers()
        if not words:
            raise UsageError("%sky needs a command: " + ", ".join(parsers))
        command, rest = words[0], words[1:]
        if command not in parsers:
            raise UsageError(f"%sky: unknown command {command!r}; one of {', '.join(parsers)}")
        args = parsers[command].parse_args(rest)
        session = self.session
        if command == "up":
            session.entry(args.name, session.spec_from(pool_options(args)))
        elif command == "run":
            session.run_script(
                args.script,
                args.args,
                name=args.name,
                spec=self._spec(args),
                stdout=args.stdout,
                timeout=args.timeout,
            ).raise_for_errors()
        elif command == "down":
            if args.all:
                session.down_all(keep_files=args.keep_files)
            else:
                session.down(args.name, keep_files=args.keep_files)
        elif command == "status":
            print(session.status())
        elif command == "clean":
            print("\n".join(session.clean({o.dest: getattr(args, o.dest) for o in CLEAN_OPTIONS})))
        elif command == "stacks":
            print(session.stacks(args.name))
        elif command == "restart":
            session.restart(args.name)
        elif command == "pull":
            value = session.pull(args.name, "all" if args.all else args.rank)
            self._user_ns[args.name] = value
        elif command == "push":
            result = session.push(args.names, self._user_ns)
            print(f"pushed {', '.join(args.names)}: {result.shipped_bytes} bytes to each rank")
        elif command == "config":
            session.defaults = session.spec_from(pool_options(args))
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
    + "\n"
    + _line_help()
)

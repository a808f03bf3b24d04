"""``%%sky`` and ``%sky``: parse the options, call the session. Nothing else lives here.

The parsers and the help text are built from the one table of options and commands in
:mod:`skyward_jupyter.options`.
"""

from __future__ import annotations

import argparse
import difflib
import functools
import shlex
from collections.abc import Callable
from typing import Any, NoReturn

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class

from .options import (
    CELL_OPTIONS,
    COMMANDS,
    POOL_OPTIONS,
    Command,
    Option,
    examples,
    grouped,
    pool_options,
    provider_given,
    unknown_option,
)
from .session import USER_ERRORS, CellInterrupted, RunResult, Session, WaitInterrupted


class _HelpAsked(Exception):
    """``-h``/``--help`` among a command's own options: its help is shown, nothing is run."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text


class _Help(argparse.Action):
    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, argparse.SUPPRESS, nargs=0, help="show this help")

    def __call__(self, parser: argparse.ArgumentParser, *args: Any) -> None:
        raise _HelpAsked(parser.format_help())


class _Parser(argparse.ArgumentParser):
    """A parser that takes only whole option names (an abbreviation could choose another
    option, even another provider), answers ``-h``, and fails in one line.
    """

    def __init__(self, prog: str, **kwargs: Any) -> None:
        super().__init__(prog=prog, add_help=False, allow_abbrev=False, **kwargs)
        self.add_argument("-h", "--help", action=_Help)

    def error(self, message: str) -> NoReturn:  # one line, no usage dump, no SystemExit
        raise UsageError(f"{self.prog}: {message}")

    def parse(self, words: list[str]) -> argparse.Namespace:
        """``words`` parsed; an unknown option is named with the options it is near."""
        args, extra = self.parse_known_args(words)
        if extra:
            given = next((w for w in extra if w.startswith("-") and len(w) > 1), None)
            if given is None:
                self.error(f"unexpected argument {extra[0]!r}")
            self.error(unknown_option(given, self._option_string_actions))
        return args


@functools.cache
def _cell_parser() -> _Parser:
    parser = _Parser(
        "%%sky",
        description="Run the cell on every rank (or on --ranks only).",
        epilog=_examples(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_groups(parser, grouped(POOL_OPTIONS, CELL_OPTIONS))
    return parser


def _examples() -> str:
    """The help's examples: the pool's, then each provider's own."""
    lines = ["examples:"]
    for line, what in examples():
        head = f"  %%sky {line}"
        lines += [f"{head:<37}{what}"] if len(head) < 36 else [head, f"{'':<37}{what}"]
    return "\n".join(lines) + "\n"


def _add_groups(parser: _Parser, groups: list[tuple[str, list[Option]]]) -> None:
    for title, options in groups:
        group = parser.add_argument_group(f"{title} options")
        for option in options:
            option.add_to(group)


def _command_parser(command: Command) -> _Parser:
    parser = _Parser(f"%sky {command.name}", description=command.help)
    pool = POOL_OPTIONS if command.pool else ()
    _add_groups(parser, grouped(pool, providers=command.pool or command.providers))
    for option in command.extra:
        option.add_to(parser)
    for name, kwargs in command.positionals:
        parser.add_argument(name, **kwargs)
    return parser


@functools.cache
def _line_parsers() -> dict[str, _Parser]:
    return {c.name: _command_parser(c) for c in COMMANDS}


def _line_help() -> str:
    lines = ["Line magic (%sky COMMAND --help: that command's options):"]
    for c in COMMANDS:
        head = f"  %sky {c.name} {c.usage}".rstrip()
        if len(head) < 34:
            lines.append(f"{head:<34}{c.help}")
        else:
            lines += [head, f"{'':<34}{c.help}"]
    return "\n".join(lines) + "\n"


Handler = Callable[["SkyMagics", argparse.Namespace], Any]
_HANDLERS: dict[str, Handler] = {}
"""What runs each ``%sky`` command of :data:`.options.COMMANDS`, by its name: the one dispatch."""


def _handles(command: str) -> Callable[[Handler], Handler]:
    """Register the method below as what ``%sky COMMAND`` runs (its arguments parsed)."""

    def register(handler: Handler) -> Handler:
        _HANDLERS[command] = handler
        return handler

    return register


def _words(magic: str, line: str) -> list[str]:
    """The options as a shell would split them; a quote left open is the user's one line."""
    try:
        return shlex.split(line)
    except ValueError as exc:
        raise UsageError(f"{magic}: {exc} in its options: {line.strip()}") from None


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
        except _HelpAsked as asked:
            print(asked.text)
            return None
        except USER_ERRORS as exc:
            raise UsageError(str(exc)) from None
        except (CellInterrupted, WaitInterrupted) as interrupted:
            # Shown by its own rendering (a line per rank), without this frame or the cell's.
            raise interrupted.with_traceback(None) from None

    def _spec(self, args: argparse.Namespace) -> Any:
        """The pool the options describe (the configured defaults fill the rest); None when
        no pool option was given: the current pool.
        """
        given = pool_options(args)
        if all(v is None for v in given.values()):
            return None
        return self.session.spec_from(given)

    def _cell(self, line: str, cell: str) -> RunResult | None:
        args = _cell_parser().parse(_words("%%sky", line))
        if args.head and args.ranks is not None:
            raise UsageError("%%sky: --head is --ranks 0; give one of them")
        result = self.session.run_cell(
            cell,
            self._user_ns,
            name=args.name,
            spec=self._spec(args),
            stdout=args.stdout,
            timeout=args.timeout,
            ranks=(0,) if args.head else args.ranks,
        )
        if args.out:
            self._user_ns[args.out] = result
        _raise_for_errors(result)
        if all(r.value_repr is None for r in result):
            return None
        return result.with_display(every_rank=args.all)

    def _line(self, line: str) -> Any:
        words = _words("%sky", line)
        parsers = _line_parsers()
        if not words:
            raise UsageError("%sky needs a command: " + ", ".join(parsers))
        command, rest = words[0], words[1:]
        if command in ("-h", "--help"):
            raise _HelpAsked(_help())
        if command not in parsers:
            near = difflib.get_close_matches(command, parsers, n=1)
            hint = f"did you mean {near[0]}? " if near else ""
            raise UsageError(
                f"%sky: unknown command {command!r}; {hint}one of {', '.join(parsers)}"
            )
        return _HANDLERS[command](self, parsers[command].parse(rest))

    @_handles("up")
    def _up(self, args: argparse.Namespace) -> None:
        self.session.entry(args.name, self.session.spec_from(pool_options(args)))

    @_handles("run")
    def _run(self, args: argparse.Namespace) -> None:
        if args.script is None:
            raise UsageError("%sky run: which script? %sky run [pool options] SCRIPT [ARGS ...]")
        _raise_for_errors(
            self.session.run_script(
                args.script,
                args.args,
                name=args.name,
                spec=self._spec(args),
                stdout=args.stdout,
                timeout=args.timeout,
            )
        )

    @_handles("down")
    def _down(self, args: argparse.Namespace) -> None:
        if args.all and args.name is not None:
            raise UsageError(
                f"%sky down: {args.name!r} and --all: give a pool's name, or --all for every pool"
            )
        if args.all:
            self.session.down_all(keep_files=args.keep_files)
        else:
            self.session.down(args.name, keep_files=args.keep_files)

    @_handles("status")
    def _status(self, args: argparse.Namespace) -> None:
        print(self.session.status())

    @_handles("auto")
    def _auto(self, args: argparse.Namespace) -> None:
        print(self.session.auto(None if args.state is None else args.state == "on"))

    @_handles("clean")
    def _clean(self, args: argparse.Namespace) -> None:
        print("\n".join(self.session.clean(provider_given(args))))

    @_handles("stacks")
    def _stacks(self, args: argparse.Namespace) -> None:
        print(self.session.stacks(args.name))

    @_handles("who")
    def _who(self, args: argparse.Namespace) -> None:
        print(self.session.who(args.name, args.ranks))

    @_handles("restart")
    def _restart(self, args: argparse.Namespace) -> None:
        self.session.restart(args.name)

    @_handles("pull")
    def _pull(self, args: argparse.Namespace) -> None:
        self._user_ns[args.name] = self.session.pull(args.name, "all" if args.all else args.rank)

    @_handles("push")
    def _push(self, args: argparse.Namespace) -> None:
        result = self.session.push(args.names, self._user_ns)
        print(f"pushed {', '.join(args.names)}: {result.shipped_bytes} bytes to each rank")

    @_handles("config")
    def _config(self, args: argparse.Namespace) -> None:
        session = self.session
        session.defaults = session.spec_from(pool_options(args))
        if args.stdout:
            session.stdout_mode = args.stdout
        print(f"defaults: {session.defaults.describe()}, stdout {session.stdout_mode}")

    @_handles("panel")
    def _panel(self, args: argparse.Namespace) -> None:
        self.session.panel(args.name)

    @_handles("metrics")
    def _metrics(self, args: argparse.Namespace) -> Any:
        return self.session.metrics(args.name)

    @_handles("sweep")
    def _sweep(self, args: argparse.Namespace) -> None:
        given = provider_given(args)
        print(self.session.sweep(given, yes=args.yes, all_owners=args.all_owners))


def _raise_for_errors(result: RunResult) -> None:
    """The cell's failure, if any; stopped by the panel's Interrupt, it says what the toolbar's
    stop says (a line per rank), not the traceback of each rank's KeyboardInterrupt.
    """
    if result.interrupted and not result.ok:
        raise CellInterrupted(result)
    result.raise_for_errors()


def _help() -> str:
    """What ``%sky --help`` and ``%%sky?`` show: the cell's options, then the commands."""
    return (
        "Run the cell on every rank of a warm pool, with torch.distributed initialised.\n\n"
        + _cell_parser().format_help()
        + "\n"
        + _line_help()
    )


SkyMagics.sky.__doc__ = _help()

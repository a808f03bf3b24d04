"""The provider interface: everything the rest of the package knows of where nodes come from.

A provider knows how to get machines (this one, SSH hosts, EC2 instances) and how to start the
agent there with a byte stream back to the notebook, what they cost, and how to end them after
the notebook died. It knows nothing of cells, torch or failure policy: that is the pool's job.
A new provider is one module with one :class:`Provider` subclass and its
:class:`ProviderOptions`, named in the ``skyward_jupyter.providers`` entry-point group of its
package (the built-in ones are named there too).
"""

from __future__ import annotations

import abc
import asyncio
import collections
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeVar, runtime_checkable

from ..agent.descendants import ProcStat, parse_stat
from ..events import RankState
from ..flags import Option, ranged
from ..limits import Range
from ..procs import how_it_ran
from ..wire import AsyncByteReader, AsyncByteWriter

if TYPE_CHECKING:
    from ..environments import NodeEnvironment, Packages
    from ..spec import PoolSpec


NOTEBOOK_SILENCE = 30.0
"""Seconds a rank waits for the notebook's heartbeat, at least, before it ends itself (the kernel
died, or its machine is cut off)."""


def notebook_silence(heartbeat_timeout: float) -> float:
    """How long the ranks of a pool with ``--heartbeat-timeout`` wait for a silent notebook: a
    rank gives up on the notebook later than the notebook on a silent rank (a large value on its
    way down delays the notebook's beats behind it).
    """
    return max(heartbeat_timeout, NOTEBOOK_SILENCE)


log = logging.getLogger(__name__)


class ProviderError(Exception):
    """The provider could not supply what was asked (bad input, no capacity, unreachable host)."""


_OPTION = "skyward_jupyter.option"
"""The key of a field's metadata that makes it a ``--flag`` (:func:`option`)."""


def option(
    help: str,
    *,
    default: Any = None,
    flag: str | None = None,
    limit: Range | None = None,
    **kwargs: Any,
) -> Any:
    """A field of a :class:`ProviderOptions` that users give as ``--flag`` (the field's name
    with dashes unless ``flag``). ``kwargs`` are argparse's: ``type`` parses one value,
    ``action="append"`` repeats it (the field holds a tuple), ``action="store_true"`` makes a
    switch; ``limit`` is the range a number must be in, however the options were made.
    """
    return field(default=default, metadata=_metadata(help, flag, limit, kwargs))


def _metadata(
    help: str, flag: str | None, limit: Range | None, kwargs: dict[str, Any]
) -> dict[str, Any]:
    if limit is not None:
        kwargs.setdefault("type", ranged(limit))
    return {_OPTION: (help, flag, limit, kwargs)}


class SharedOption:
    """A ``--flag`` that several providers take with one meaning: declared once, here, so its
    help, its parser and its range are one. A provider's options include it as a field,
    ``python: str = PYTHON.field(default="python3")``, with the provider's own default.
    """

    def __init__(self, flag: str, help: str, *, limit: Range | None = None, **kwargs: Any):
        self.flag = flag
        self._metadata = _metadata(help, flag, limit, kwargs)

    def field(self, default: Any = None) -> Any:
        return field(default=default, metadata=self._metadata)


PYTHON = SharedOption(
    "--python",
    "Python on the nodes, a path or a command on their PATH (default: the provider's)",
    metavar="PATH",
)
GPUS_PER_NODE = SharedOption(
    "--gpus-per-node",
    "GPUs to ask for on each node",
    limit=Range("--gpus-per-node", 0, 64, "GPUs", whole=True),
    metavar="G",
)


P = TypeVar("P", bound="ProviderOptions")


@dataclass(frozen=True)
class ProviderOptions:
    """What a provider's pools are given beyond what every pool has (hosts, a region, a
    partition): a frozen dataclass of the provider's, held by the pool's spec. Its fields made
    with :func:`option` are the provider's ``--flags``: the magics' parser, ``%%sky?`` (under
    the provider's name), ``%sky config`` and the choice of provider read them from here.
    Other fields are settings users never give (timeouts, a test's endpoint).
    """

    def __post_init__(self) -> None:
        """Every number in its range, whichever way the options were made."""
        for found in fields(self):
            limit = found.metadata.get(_OPTION, (None,) * 4)[2]
            value = getattr(self, found.name)
            if limit is not None and value is not None:
                limit.check(value)

    @classmethod
    def declared(cls) -> dict[str, Option]:
        """Field name -> its ``--flag``, for the fields users give."""
        found = {}
        for each in fields(cls):
            if _OPTION not in each.metadata:
                continue
            help, flag, _, kwargs = each.metadata[_OPTION]
            found[each.name] = Option(flag or "--" + each.name.replace("_", "-"), help, kwargs)
        return found

    @classmethod
    def from_given(cls: type[P], given: Mapping[str, Any], base: P | None = None) -> P:
        """``base`` (or the defaults) with the options in ``given`` (a flag's dest -> the text
        it was given, None: not given), each parsed by its own parser; :class:`ProviderError`
        naming the flag for a bad value.
        """
        changes = {}
        for name, flag in cls.declared().items():
            if given.get(flag.dest) is not None:
                try:
                    changes[name] = flag.parse(given[flag.dest])
                except ValueError as exc:
                    raise ProviderError(str(exc)) from None
        return replace(base, **changes) if base is not None else cls(**changes)

    def shown(self) -> dict[str, Any]:
        """``--flag`` -> value, for the options given other than their defaults (what a
        replacement says changed).
        """
        defaults = {each.name: each.default for each in fields(self)}
        return {
            flag.flag: getattr(self, name)
            for name, flag in self.declared().items()
            if getattr(self, name) != defaults[name]
        }


@dataclass(frozen=True, slots=True)
class Node:
    """One machine of a pool, as the provider found it."""

    index: int
    address: str
    """How the other nodes reach this one (the rendezvous address when it is the head)."""
    gpus: tuple[str, ...] = ()
    """The GPU ids this node's ranks may use."""
    gpu_type: str | None = None
    instance_type: str | None = None
    labels: Mapping[str, str] = field(default_factory=dict)


class RankProcess(Protocol):
    """A started agent: its wire, and ways to end it that do not depend on its cooperation."""

    @property
    def reader(self) -> AsyncByteReader: ...

    @property
    def writer(self) -> AsyncByteWriter: ...

    def describe(self) -> str:
        """Where it runs, for error messages ("local pid 1234", "alice@gpu1 pid 99")."""
        ...

    async def kill(self) -> None:
        """End the process now (SIGKILL or the transport's equivalent)."""
        ...

    async def wait(self) -> str:
        """Wait for it to end; say how it ended ("exited with status 1", "killed by SIGKILL")."""
        ...

    def diagnostics(self) -> str:
        """The last lines the agent wrote outside the wire (start-up failures, watchdog exits)."""
        ...


@runtime_checkable
class Watchable(Protocol):
    """A rank process its provider can look at without its help (a local process's ``/proc``,
    a host's over SSH or as a Slurm step, through a Ray rank's actor): when it goes silent, one
    still running is told apart from a stopped one.
    """

    async def running(self, pid: int, within: float) -> str | None:
        """How process ``pid`` (the rank's, as its hello said) runs over the next ``within``
        seconds (:func:`..procs.how_it_ran`); None: it does not. Native code holding its GIL
        keeps its threads from answering, not from running.
        """
        ...


LOOKS = (
    'w=$1; shift; look() { for p; do cat "/proc/$p/stat" 2>/dev/null; done; }; '
    'look "$@"; sleep "$w"; look "$@"; exit 0'
)
"""The ``/proc`` stat lines of processes ``$2...``, and again ``$1`` seconds later; a process
gone meanwhile has no line, and the look still succeeds (its others are still told)."""
LOOK_WITHIN = 2.0
"""Seconds beyond its wait a machine has to show how its silent ranks run (else they count as
frozen): a command started there (an SSH session, a Slurm step) takes a moment."""


class Looks:
    """Looks at processes on another machine, through a command run there: the processes asked
    about together (a machine's silent ranks) share one command, however many fell silent.
    """

    def __init__(
        self,
        output: Callable[[Sequence[str], float], Awaitable[bytes]],
        failures: tuple[type[BaseException], ...],
    ) -> None:
        self._output = output
        """Runs an argument list on the machine to its end, within a timeout; its stdout."""
        self._failures: tuple[type[BaseException], ...] = (
            OSError,
            asyncio.TimeoutError,
            ProviderError,
            *failures,
        )
        """What ``output`` raises when the machine cannot be asked (it then counts as frozen)."""
        self._asked: dict[int, asyncio.Future[str | None]] = {}
        """Processes to look at in the next look."""
        self._looking: set[asyncio.Task[None]] = set()

    async def running(self, pid: int, within: float) -> str | None:
        """How process ``pid`` runs over the next ``within`` seconds (:func:`..procs.how_it_ran`).
        Those asked while a look is being set up share it, and its ``within``: the first's.
        """
        loop = asyncio.get_running_loop()
        answer = self._asked.get(pid)
        if answer is None:
            answer = self._asked[pid] = loop.create_future()
            if len(self._asked) == 1:  # the first asked: the look starts once the others are in
                loop.call_soon(self._start, within)
        return await asyncio.shield(answer)

    def _start(self, within: float) -> None:
        task = asyncio.ensure_future(self._look(within))
        self._looking.add(task)
        task.add_done_callback(self._looking.discard)

    async def _look(self, within: float) -> None:
        asked, self._asked = self._asked, {}
        argv = ["sh", "-c", LOOKS, "sh", f"{within:g}", *map(str, asked)]
        said = b""  # a machine that cannot be asked now: frozen, or cut off
        try:
            said = await self._output(argv, within + LOOK_WITHIN)
        except self._failures:
            pass
        except Exception:  # a provider's own failure: logged, its ranks judged by their silence
            log.exception("looking at processes %s failed", list(asked))
        finally:
            seen: dict[int, list[ProcStat | None]] = {}
            for line in said.splitlines():
                head = line.split(b" ", 1)[0]
                if head.isdigit():
                    seen.setdefault(int(head), []).append(parse_stat(line))
            for pid, answer in asked.items():
                looks = seen.get(pid, [])
                if not answer.done():
                    answer.set_result(
                        how_it_ran(looks[0], looks[1], within) if len(looks) == 2 else None
                    )


class StderrTail:
    """The last lines a rank wrote outside its wire (start-up failures, a watchdog's exit),
    read as they come: what :meth:`RankProcess.diagnostics` says when the rank is lost.
    """

    def __init__(self, lines: int = 40) -> None:
        self._lines: collections.deque[str] = collections.deque(maxlen=lines)
        self.task: asyncio.Task[None] | None = None

    def follow(self, stream: Any, ends: tuple[type[BaseException], ...] = ()) -> None:
        """Read ``stream`` to its end: a stream with ``read(n)`` in chunks (a line too long
        for asyncio's line reader must not stop the draining), else by iterating it. The
        errors in ``ends`` end it too (a dropped channel: how the rank ended is told elsewhere).
        """

        async def chunks() -> AsyncIterator[bytes]:
            if hasattr(stream, "read"):
                while chunk := await stream.read(1 << 16):
                    yield chunk
            else:
                async for chunk in stream:
                    yield chunk

        async def read() -> None:
            partial = ""
            with contextlib.suppress(*ends):
                async for chunk in chunks():
                    *whole, partial = (partial + chunk.decode(errors="replace")).split("\n")
                    self._lines.extend(whole)
            if partial:
                self._lines.append(partial)

        self.task = asyncio.get_running_loop().create_task(read())

    async def drain(self, timeout: float = 1.0) -> None:
        """Let the last lines arrive after the process ended."""
        if self.task is not None:
            await asyncio.wait([self.task], timeout=timeout)

    def text(self) -> str:
        return "\n".join(self._lines)


class Progress(Protocol):
    """How provisioning goes, for the panel: a step of the pool (``node`` None) or of one node
    (``state``: provisioning, booting, connecting). Callable from any thread.
    """

    def __call__(
        self, text: str, node: int | None = None, state: RankState | None = None
    ) -> None: ...


def no_progress(text: str, node: int | None = None, state: RankState | None = None) -> None:
    """The :class:`Progress` of a caller that shows none."""


@dataclass
class ReapReport:
    """What reaping an orphaned pool did (the server's answer to the side panel's Reap)."""

    killed: list[int] = field(default_factory=list)
    """Processes of the pool that were running and were ended."""
    gone: list[int] = field(default_factory=list)
    """Processes of the pool that had already ended (their pid may be another process's now)."""
    spared: list[int] = field(default_factory=list)
    """Recorded processes still running that are not provably agents: not touched."""
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "killed": sorted(self.killed),
            "gone": sorted(self.gone),
            "spared": sorted(self.spared),
            "notes": self.notes,
        }


class Provider(abc.ABC):
    """Everything a pool, the session, the registry and the server need from a provider.

    A subclass is one provider: it says how a spec becomes machines (:meth:`from_spec`,
    :meth:`provision`), how a rank starts there (:meth:`start_rank`), what the machines cost,
    what the registry must keep to end them after the notebook died (:meth:`record`, then
    :meth:`reap` in the server), and how stray resources are found (:meth:`sweep`). The
    defaults are right for a provider that owns nothing outside its rank processes.
    """

    name: ClassVar[str]
    """``--provider NAME``: the name of its entry point in ``skyward_jupyter.providers``."""
    Options: ClassVar[type[ProviderOptions]] = ProviderOptions
    """The provider's own options (its ``--flags``), held by the pool's spec."""
    examples: ClassVar[tuple[tuple[str, str], ...]] = ()
    """``%%sky`` options that use this provider, with what they do, for ``%%sky?``."""
    default_idle_minutes: ClassVar[float | None] = None
    """Minutes without a cell before the pool stops itself (paid providers set one)."""
    shares_files: ClassVar[bool] = False
    """The nodes see the notebook's files at their own paths (the working directory is then not
    copied; a provider that cannot promise it leaves this False and the nodes check)."""
    on_notebook_machine: ClassVar[bool] = False
    """The ranks run on the notebook's own machine: a large global goes to each over its own
    pipe, since relaying it through the head would only add a hop, a copy and two digests."""
    keeps_old_until_ready: ClassVar[bool] = False
    """A pool of this provider replacing one of the same name starts before the old one ends,
    which then stays when the start fails (this machine: two pools side by side only cost a
    moment's memory). Elsewhere the old pool ends first: the same hosts' GPUs and ports, or a
    second bill, would be taken while the new one starts."""
    installs_packages: ClassVar[bool] = False
    """The provider builds ``--pip``/``--requirements`` environments on its nodes
    (:meth:`build_environments`); a spec asking for packages elsewhere is refused up front."""
    packages_otherwise: ClassVar[str] = ""
    """Where it installs none, what gives its nodes packages instead (said in that refusal)."""
    release_timeout: float = 0.0
    """Seconds :meth:`release` may take beyond the pool's own shutdown (instances to go)."""
    packages: Packages | None = None
    """The pool's packages (set by the pool before :meth:`provision`): a node may then lack
    torch, which its environment brings."""
    notebook_silence: float = NOTEBOOK_SILENCE
    """Seconds the pool's ranks wait for a silent notebook (:func:`notebook_silence`, set by the
    pool before :meth:`provision`): what a provider keeps on the nodes for the pool's life (a
    warm template) waits as long, so it never ends before its ranks."""

    def __init__(self) -> None:
        self.warnings: list[str] = []
        """Said once when the pool is ready (a version mismatch, a spot fallback)."""

    # ----------------------------------------------------------------- from options to a pool

    @classmethod
    @abc.abstractmethod
    def from_spec(cls, spec: PoolSpec, pool_name: str, extra: Mapping[str, Any]) -> Provider:
        """The provider for ``spec``, or :class:`ProviderError` naming the bad option.

        ``extra`` holds settings users never give (tests: an endpoint URL).
        """

    @classmethod
    def check(cls, spec: PoolSpec) -> None:
        """Refuse ``spec`` for what can be told without starting or reaching anything (this
        machine's GPUs and memory, a key file that cannot be read, a client command that is
        missing): :class:`ProviderError` naming the option and the fix.

        The session calls it before a running pool is touched, so a description that cannot
        work never costs the pool it would replace. Starting still checks what only the
        machines can tell. The default checks nothing.
        """
        return

    @classmethod
    def settle(cls, spec: PoolSpec) -> PoolSpec:
        """Complete a spec from what it implies (one node per named host), or refuse options
        that clash (:class:`ProviderError`); called whenever options make a spec.
        """
        return spec

    @classmethod
    def where(cls, spec: PoolSpec) -> str:
        """Where the pool runs, for its one-line description."""
        return cls.name

    @classmethod
    def same_machines(cls, old: ProviderOptions, new: ProviderOptions) -> bool:
        """Whether a pool with options ``new`` replacing one with ``old`` runs on some of the
        same machines (their copies of the synced directories then stay for it).
        """
        return False

    @classmethod
    def prewarm(cls) -> None:
        """Get ready for a first pool while the user writes the first cell (called in a thread
        when the extension loads, for the default provider).
        """
        return

    @property
    def price_per_hour(self) -> float | None:
        """What the pool's machines cost per hour, where the provider knows it."""
        return None

    # ------------------------------------------------------------------------- the pool's life

    @abc.abstractmethod
    async def provision(self, nodes: int, progress: Progress = no_progress) -> list[Node]: ...

    @abc.abstractmethod
    async def start_rank(self, node: Node, env: Mapping[str, str]) -> RankProcess: ...

    async def build_environments(
        self, nodes: Sequence[Node], packages: Packages, progress: Progress
    ) -> dict[int, NodeEnvironment]:
        """Give every node the environment of ``packages`` (``--pip``, ``--requirements``),
        before any rank starts; node index -> its environment. Raises
        :class:`~skyward_jupyter.environments.PackagesError` naming the node and the reason.
        """
        raise ProviderError(f"the {self.name} provider installs no packages on its nodes")

    @abc.abstractmethod
    async def release(self) -> None:
        """End everything the provider made for the pool; raise what could not be ended."""

    async def clean(self) -> list[str]:
        """``%sky clean``: remove, on the nodes, the caches no running pool uses (the shipped
        package, copies of synced directories); one line per node saying what went.
        """
        raise ProviderError(
            f"%sky clean: the {self.name} provider keeps no caches on its nodes; name the "
            "hosts to clean with their provider's options (%sky clean --help)"
        )

    # ------------------------------------------------------------- after the notebook is gone

    def record(self, pids: Mapping[int, Sequence[int]]) -> dict[str, Any]:
        """What the registry keeps so that :meth:`reap` can end the pool without its kernel.

        ``pids``: node index -> the pids of its ranks. No secrets: the record is a file.
        """
        return {}

    @classmethod
    def reap(cls, record: Mapping[str, Any]) -> ReapReport:
        """End what an orphaned pool left running, from its :meth:`record` alone."""
        return ReapReport(notes=[f"nothing to reap for a {cls.name} pool"])

    @classmethod
    def sweep(
        cls,
        *,
        live: Sequence[Mapping[str, Any]],
        yes: bool,
        all_owners: bool,
        options: ProviderOptions,
        extra: Mapping[str, Any],
    ) -> str | None:
        """Find (and with ``yes`` end) what this provider made that no live pool owns.

        ``live``: the :meth:`record` of every live pool of this provider; ``options``: its own
        options as ``%sky sweep`` (over the configured defaults) gives them (where to look).
        None when the provider leaves nothing behind to sweep.
        """
        return None

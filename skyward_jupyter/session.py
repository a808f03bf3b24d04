"""The kernel's pools: which one a cell runs on, keeping them warm, replacing and ending them.

One session per IPython shell. A cell without pool options runs on the current pool (started
with the configured defaults the first time); a cell whose options describe a different pool
replaces the pool of that name, and says so. Pools end with ``%sky down``, with the kernel, or
when the extension is unloaded; the listeners (the views among them) hear of every pool's life.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from .capture import Shipment, Shipper
from .checked_source import CheckedSource
from .flags import is_variable_name
from .idle import IdleStop
from .limits import LimitError
from .mirror import modules_in, notebook_requirements
from .observers import NoViews, PoolListener, Views
from .options import StdoutMode
from .pool import Pool
from .protocol import Names, Script, cell_filename
from .providers import UnknownProvider, provider_class, sweep_all
from .providers.base import ProviderError
from .rank_names import table
from .results import (
    CellError,
    CellInterrupted,
    PoolError,
    RanksRestarted,
    RunResult,
    WaitInterrupted,
)
from .spec import PoolSpec, SpecError
from .status import status_text

if TYPE_CHECKING:
    from .auto_cells import AutoCells

# What the magics use of the layers below, through the session alone.
__all__ = [
    "USER_ERRORS",
    "CellInterrupted",
    "PoolSpec",
    "RunResult",
    "Session",
    "SessionError",
    "WaitInterrupted",
]
Announce = Callable[[str], None]
T = TypeVar("T")
WHO_TIMEOUT = 5.0
"""Seconds each rank has to list its names for ``%sky who`` (its reader thread answers)."""


RESHIP_TRIES = 3
"""Times a cell chooses its globals again because ranks were started meanwhile."""


class SessionError(Exception):
    """Bad input or a state the user must change; shown as one line, nothing else changes."""


USER_ERRORS = (
    SessionError,
    PoolError,
    ProviderError,
    SpecError,
    UnknownProvider,
    LimitError,
)
"""What the magics show as a one-line usage error (nothing else changed)."""


@dataclass
class PoolEntry:
    name: str
    spec: PoolSpec
    pool: Pool
    shipper: Shipper = field(default_factory=Shipper)
    last_active: float = field(default_factory=time.monotonic)
    """When the last cell on it ended (or it started): what the idle stop counts from."""
    busy: int = 0


class Session:
    def __init__(
        self,
        announce: Announce | None = None,
        views: Views | None = None,
        listeners: Sequence[PoolListener] = (),
        namespace: Mapping[str, Any] | None = None,
        auto_cells: AutoCells | None = None,
        shells_own: Mapping[str, Any] | None = None,
    ) -> None:
        self._pools: dict[str, PoolEntry] = {}
        self._shells_own = shells_own
        """The shell's own values in ``namespace`` (see :class:`.capture.Shipper`)."""
        self.namespace: Mapping[str, Any] = {} if namespace is None else namespace
        """The notebook's namespace: what ``--mirror`` reads the cells' modules from."""
        self.views: Views = views or NoViews()
        self._listeners: tuple[PoolListener, ...] = (self.views, *listeners)
        """Who hears of every pool's life, the views first."""
        self.current: str | None = None
        self._failed: dict[str, PoolSpec] = {}
        """Per name without a pool, the description that last failed to start under it."""
        self.defaults = PoolSpec()
        self.stdout_mode: StdoutMode = "head"
        self.provider_options: dict[str, dict[str, Any]] = {}
        """Per provider, options users never need (tests: ``{"aws": {"endpoint_url": ...}}``)."""
        self._announce = announce or (lambda text: print(text, file=sys.stderr))
        self._lock = threading.RLock()
        self.idle: IdleStop[PoolEntry] = IdleStop(self)
        self._auto_cells = auto_cells
        """The shell's router of plain cells (``%sky auto``); None without a shell."""
        self._auto_pool: str | None = None
        """While auto is on, the pool its cells run on (the current one when they last ran)."""

    @property
    def pools(self) -> dict[str, PoolEntry]:
        return dict(self._pools)

    def spec_from(self, options: Mapping[str, Any], base: PoolSpec | None = None) -> PoolSpec:
        """A spec from the defaults (or ``base``) overlaid with the options given; options
        that belong to one provider choose it when ``--provider`` is not given
        (:meth:`PoolSpec.from_options`).
        """
        spec = PoolSpec.from_options(options, base or self.defaults)
        spec.framework_setup(os.environ)  # options that clash fail here, before any machine
        return spec

    def _reusable(self, name: str | None, spec: PoolSpec | None) -> tuple[str, PoolEntry | None]:
        name = name or self.current or "default"
        entry = self._pools.get(name)
        if entry is not None and entry.pool.running and (spec is None or _serves(entry, spec)):
            return name, entry
        return name, None

    def entry(
        self,
        name: str | None = None,
        spec: PoolSpec | None = None,
        shipper: Shipper | None = None,
    ) -> PoolEntry:
        """The pool a cell runs on, started or replaced as the spec asks.

        A new description is checked whole (:meth:`_prepare`) before a running pool is touched.
        Should it still fail to start, the name keeps the pool it was to replace where that one
        could stay (``Provider.keeps_old_until_ready``); else the name keeps the description
        that failed, and a cell without pool options refuses rather than start another.
        """
        name, reusable = self._reusable(name, spec)
        if reusable is not None:
            self.current = name
            self._auto_follows(name)
            return reusable
        old = self._pools.get(name)
        failed = self._failed.get(name)
        if spec is None and old is None and failed not in (None, self.defaults):
            self.current = name
            raise SessionError(self._failed_line(name))
        wanted = spec or (old.spec if old else self.defaults)
        pool = self._prepare(name, wanted)
        keep_old = old is not None and pool.provider.keeps_old_until_ready
        entry = PoolEntry(name, wanted, pool, shipper or Shipper(self._shells_own))
        try:  # from here on, a failure or Ctrl-C says which pool is left
            if old is not None:
                self._announce(
                    f"pool {name!r}: replacing {old.spec.describe()} "
                    f"({old.spec.differences(wanted)})"
                )
                if not keep_old:
                    # The new pool on the same hosts works in the same copies: they stay for it.
                    self.down(name, quiet=True, keep_files=_same_hosts(old.spec, wanted))
            self._announce(f"pool {name!r}: starting {wanted.describe()} ...")
            started = time.perf_counter()
            self._tell(lambda listener: listener.pool_created(entry))
            pool.start(on_wait=lambda: self._tell(lambda listener: listener.pool_starting(entry)))
        except BaseException as exc:
            self._ended(entry)
            self._start_failed(name, wanted, old if keep_old else None)
            if type(exc) is KeyboardInterrupt:  # the user's, wherever it landed: one line
                raise WaitInterrupted(
                    f"pool {name!r} was not started: stopped at the interrupt, and nothing of "
                    "it is left running"
                ) from None
            raise
        if keep_old:
            self.down(name, quiet=True)  # the replaced pool goes once its replacement is ready
        self._failed.pop(name, None)
        self._pools[name] = entry  # from here on the session owns it (and ends it with itself)
        self._announce(
            f"pool {name!r}: {pool.world_size} rank{'s' * (pool.world_size != 1)} ready in "
            f"{time.perf_counter() - started:.1f} s ({pool.worlds_note})"
        )
        for warning in pool.provider.warnings:
            self._announce(f"warning: {warning}")
        entry.last_active = time.monotonic()
        self.current = name
        self._auto_follows(name)
        self._tell(lambda listener: listener.pool_started(entry))
        if wanted.idle_minutes():
            self.idle.watch()
        return entry

    def _prepare(self, name: str, spec: PoolSpec) -> Pool:
        """The pool ``spec`` describes, not started, after every check that needs no machine:
        the provider's (:meth:`~skyward_jupyter.providers.base.Provider.check`: this machine's
        GPUs and memory, key files, client commands), its options, the pool's arguments and
        the directories to sync. The one place where a description is checked before a
        running pool is touched.
        """
        cls = provider_class(spec.provider)
        cls.check(spec)
        provider = cls.from_spec(spec, name, self.provider_options.get(spec.provider, {}))
        pool = Pool(
            spec.nodes,
            spec.procs_per_node,
            provider=provider,
            name=name,
            backend=spec.backend,
            env=dict(spec.env),
            **spec.pool_arguments(os.getcwd(), os.environ, self._mirrored(name, spec)),
        )
        pool.check()
        return pool

    def _mirrored(self, name: str, spec: PoolSpec) -> tuple[str, ...]:
        """With ``--mirror``, the notebook's versions of what its namespace uses, said once."""
        if not spec.mirror:
            return ()
        pinned, local = notebook_requirements(modules_in(self.namespace))
        said = ", ".join(pinned) or "nothing to mirror"
        left = f" (left out, installed from a local directory: {', '.join(local)})" if local else ""
        self._announce(f"pool {name!r}: --mirror: the nodes get {said}{left}")
        return pinned

    def _start_failed(self, name: str, wanted: PoolSpec, kept: PoolEntry | None) -> None:
        """Say which pool is left after ``wanted`` failed to start; with none left under
        ``name``, remember ``wanted`` so that no cell silently runs on another pool.
        """
        self.current = name
        if kept is not None and self._pools.get(name) is kept and kept.pool.running:
            self._announce(
                f"pool {name!r}: its replacement ({kept.spec.differences(wanted)}) did not "
                f"start; the pool {name!r} is still running as before ({kept.spec.describe()}), "
                "and cells without pool options run on it"
            )
            return
        self._failed[name] = wanted
        others = ", ".join(n for n in self._pools if n != name)
        left = f"; other pools: {others}" if others else ""
        self._announce(
            f"pool {name!r}: {wanted.describe()} did not start, and no pool {name!r} is left"
            f"{left}; cells without pool options refuse to run until it starts (give its "
            "options again) or %sky down forgets it"
        )

    def _failed_line(self, name: str) -> str:
        """Why a cell without pool options does not run on ``name`` (its description failed)."""
        failed = self._failed[name]
        return (
            f"pool {name!r} did not start as {failed.describe()} "
            f"({failed.given_over(self.defaults)}) and no other pool runs in its place: give "
            f"those pool options again to retry, or %sky down {name} to forget them"
        )

    def run_cell(
        self,
        source: str,
        user_ns: Mapping[str, Any],
        *,
        name: str | None = None,
        spec: PoolSpec | None = None,
        stdout: StdoutMode | None = None,
        timeout: float | None = None,
        ranks: Sequence[int] | None = None,
    ) -> RunResult:
        """Ship what the cell needs, run it, stream its output into this cell.

        A syntax error, or a global that cannot be sent, fails before any pool starts or changes.
        The cell runs as ``<In [7]>`` where the notebook numbers it ``In [7]``; on ``ranks``
        only, when given (``--ranks``, checked against the pool before it runs).
        """
        number = self.views.cell_number()
        filename = cell_filename(number) if number is not None else None
        checked = CheckedSource.check(source, filename or "<%%sky cell>")
        _, reusable = self._reusable(name, spec)
        shipper = reusable.shipper if reusable else Shipper(self._shells_own)
        started = reusable.pool.ranks_started if reusable else None  # a new pool: None
        shipment = shipper.prepare(source, user_ns, ranks_started=started)
        with self._lock:  # the idle watcher must not stop the pool this cell is about to use
            entry = self.entry(name, spec, shipper)
            entry.busy += 1
        try:
            if ranks is not None:
                ranks = entry.pool.check_ranks(ranks)
            return self._run_on(
                entry,
                checked,
                shipment,
                stdout,
                timeout,
                filename=filename,
                ranks=ranks,
                reship=lambda: shipper.prepare(
                    source, user_ns, ranks_started=entry.pool.ranks_started
                ),
            )
        finally:
            entry.busy -= 1
            entry.last_active = time.monotonic()

    def run_script(
        self,
        path: str,
        argv: Sequence[str] = (),
        *,
        name: str | None = None,
        spec: PoolSpec | None = None,
        stdout: StdoutMode | None = None,
        timeout: float | None = None,
    ) -> RunResult:
        """Run a script on every rank as torchrun would (``%sky run``), on the warm pool.

        The file is read here and its source travels with the command, so the ranks need not
        see the notebook's files; a missing file or a syntax error fails before a pool starts.
        """
        script, source = _read_script(path)
        directory = Path(path).expanduser().is_dir()
        with self._lock:
            entry = self.entry(name, spec)
            entry.busy += 1
        try:
            run = Script(script, tuple(argv), directory)  # a script brings its own globals
            return self._run_on(entry, source, Shipment.nothing(), stdout, timeout, run)
        finally:
            entry.busy -= 1
            entry.last_active = time.monotonic()

    def _run_on(
        self,
        entry: PoolEntry,
        source: CheckedSource,
        shipment: Shipment,
        stdout: StdoutMode | None,
        timeout: float | None,
        script: Script | None = None,
        filename: str | None = None,
        ranks: tuple[int, ...] | None = None,
        reship: Callable[[], Shipment] | None = None,
    ) -> RunResult:
        """Run on ``entry``'s pool. Should a recovery the cell waits for start a rank after
        ``shipment`` was chosen, ``reship`` chooses the globals anew (the new rank has none of
        those taken for there) and the cell runs with those, up to :data:`RESHIP_TRIES` times
        (a rank that keeps failing as it starts ends the wait).
        """
        for warning in shipment.warnings:
            self._announce(f"warning: {warning}")
        said = set(shipment.warnings)
        view = self.views.cell(entry, stdout or self.stdout_mode, ranks)
        every_rank = ranks is None or set(ranks) >= set(range(entry.pool.world_size))
        tries = 0
        try:
            while True:
                try:
                    result = entry.pool.run(
                        source,
                        shipment.globals,
                        timeout=timeout,
                        filename=script.path if script else filename,
                        script=script,
                        observer=view.on_event,
                        on_wait=view.flush,
                        ranks=ranks,
                        keep=shipment.keep,
                        fill=shipment.fill,
                        started=shipment.ranks_started,
                    )
                    break
                except RanksRestarted as restarted:
                    tries += 1
                    if reship is None or tries >= RESHIP_TRIES:
                        raise PoolError(
                            f"{restarted}, {tries} times while the cell waited; run it again "
                            "once %sky status shows every rank ready"
                        ) from None
                    shipment = reship()
                    for warning in shipment.warnings:
                        if warning not in said:  # every global goes again now: a new size
                            said.add(warning)
                            self._announce(f"warning: {warning}")
        except CellInterrupted as interrupted:
            self._after_cell(entry, shipment, interrupted.result, every_rank)
            raise
        finally:
            view.finish()
        self._after_cell(entry, shipment, result, every_rank)
        return result

    def _after_cell(
        self, entry: PoolEntry, shipment: Shipment, result: RunResult, every_rank: bool
    ) -> None:
        """What the ranks hold once a cell ended (its globals, the names it bound; nothing
        where a rank was lost), and what they had to say.
        """
        if result.lost:
            every = len(result.lost) >= entry.pool.world_size
            entry.shipper.forget(None if every else result.bound, every_rank, result.deleted)
        else:
            entry.shipper.commit(shipment, result.bound, every_rank, result.deleted)
        entry.shipper.note_ranks_started(entry.pool.ranks_started)
        for note in result.notes:
            self._announce(f"pool {entry.name!r}: {note}")

    def pull(self, name: str, ranks: str | int = 0) -> Any:
        """A rank's value of ``name`` (``ranks="all"``: every rank's, as a list), read on that
        rank alone: the others need not have it. Raises, rather than bind ``None``, where a
        rank lacks the name or its value does not pickle.
        """
        entry = self._require()
        if not is_variable_name(name):
            raise SessionError(f"{name!r} is not a variable name")
        size = entry.pool.world_size
        if ranks != "all" and not 0 <= int(ranks) < size:
            raise SessionError(f"--rank {ranks}: the pool has ranks 0..{size - 1}")
        try:
            result = entry.pool.run(name, ranks=None if ranks == "all" else [int(ranks)])
        finally:
            self.views.operation_ended(entry)
        for r in result:
            if r.error is not None and r.error.type_name == "NameError":
                raise SessionError(f"rank {r.rank} has no variable {name!r}")
            if r.error is None and r.value is None and r.value_repr is not None:
                raise SessionError(
                    f"rank {r.rank}'s {name} ({r.value_repr[:80]}) cannot come to the notebook: "
                    "it does not pickle there, or does not load here (a class or package the "
                    "notebook lacks, a GPU tensor); pull a plain part or copy of it"
                )
        if not result.ok:
            raise CellError(result.errors)
        if ranks == "all":
            return result.values
        return next(r.value for r in result if r.rank == int(ranks))

    def push(self, names: list[str], user_ns: Mapping[str, Any]) -> RunResult:
        """Send notebook variables to every rank now, even ones the ranks already bound."""
        entry = self._require()
        missing = [n for n in names if n not in user_ns]
        if missing:
            raise SessionError(f"not defined in the notebook: {', '.join(missing)}")
        shipment = entry.shipper.prepare(
            "", user_ns, force=frozenset(names), ranks_started=entry.pool.ranks_started
        )
        try:
            # Names pulled in by what is pushed (a function's globals) keep their rules.
            result = entry.pool.run(
                "", shipment.globals, keep=shipment.keep, fill=shipment.fill
            ).raise_for_errors()
        finally:
            self.views.operation_ended(entry)
        entry.shipper.commit(shipment, result.bound)
        entry.shipper.pushed(names)
        return result

    def restart(self, name: str | None = None) -> PoolEntry:
        """Fresh processes and worlds for the pool, on its machines (a pool that stopped, or
        whose ranks cannot be restarted, is started afresh with the same spec).
        """
        entry, started = self._require(name), time.perf_counter()
        try:
            entry.pool.restart()
        except (PoolError, ProviderError) as exc:
            self.views.operation_ended(entry)
            self._announce(f"pool {entry.name!r}: {exc}; starting it afresh")
            self.down(entry.name, quiet=True, keep_files=_same_hosts(entry.spec, entry.spec))
            return self.entry(entry.name, entry.spec)
        self.views.operation_ended(entry)
        entry.shipper.forget()
        took = time.perf_counter() - started
        size = entry.pool.world_size
        self._announce(f"pool {entry.name!r}: {size} fresh rank{'s' * (size != 1)} in {took:.1f} s")
        return entry

    def down(
        self, name: str | None = None, *, quiet: bool = False, keep_files: bool = False
    ) -> list[str]:
        """End a pool (the current one by default); returns the names ended. Its nodes remove
        their copy of the synced directories unless ``keep_files``.
        """
        target = name or self.current
        if target is not None and target not in self._pools and target in self._failed:
            failed = self._failed.pop(target)
            if self.current == target:
                self.current = next(iter(self._pools), None)
            if not quiet:
                self._announce(f"pool {target!r}: forgot {failed.describe()}, which did not start")
                self._auto_ended(target)
            return []
        if target is None or target not in self._pools:
            if quiet:
                return []
            raise SessionError(f"no pool named {target!r}" if target else "no pool is running")
        self._close(self._forget(target), keep_files)
        if not quiet:
            self._announce(f"pool {target!r}: shut down")
            self._auto_ended(target)
        return [target]

    def _forget(self, name: str) -> PoolEntry:
        """Take a pool out of the session (it is no longer current or reusable)."""
        entry = self._pools.pop(name)
        if self.current == name:
            self.current = next(iter(self._pools), None)
        return entry

    def take_pools(
        self, chosen: Callable[[Sequence[PoolEntry]], Sequence[PoolEntry]]
    ) -> Sequence[PoolEntry]:
        """Take the pools ``chosen`` picks out of the session, under its lock, so that no cell
        takes one meanwhile (the idle stop's).
        """
        with self._lock:
            taken = chosen(list(self._pools.values()))
            for entry in taken:
                self._forget(entry.name)
            return taken

    def end_pool(self, entry: PoolEntry, why: str) -> None:
        """End a pool :meth:`take_pools` took, saying ``why`` (and why it failed to end)."""
        self._announce(why)
        self._auto_ended(entry.name)
        try:
            self._close(entry)
        except Exception as exc:  # noqa: BLE001 - said; the pool is out of the session anyway
            self._announce(f"pool {entry.name!r}: shutdown failed: {exc}")

    def _close(self, entry: PoolEntry, keep_files: bool = False) -> None:
        try:
            entry.pool.close(keep_files)
        finally:
            self._ended(entry)

    def _ended(self, entry: PoolEntry) -> None:
        self._tell(lambda listener: listener.pool_ended(entry))

    def _tell(self, event: Callable[[PoolListener], None]) -> None:
        """Every listener hears ``event``, in order; one that fails keeps it from no other (the
        first failure is raised once all have heard it).
        """
        failure: Exception | None = None
        for listener in self._listeners:
            try:
                event(listener)
            except Exception as exc:  # noqa: BLE001 - raised below, once the others heard
                failure = failure or exc
        if failure is not None:
            raise failure

    def down_pool(self, name: str, pool: Pool) -> None:
        """End ``pool`` if it is still the pool called ``name`` (a panel's "Shut down")."""
        entry = self._pools.get(name)
        if entry is not None and entry.pool is pool:
            self.down(name, quiet=True)
            self._auto_ended(name)
        else:
            pool.close()

    def down_all(self, keep_files: bool = False) -> list[str]:
        self._failed.clear()
        names = list(self._pools)
        ended = [n for name in names for n in self.down(name, quiet=True, keep_files=keep_files)]
        if self._auto_pool is not None:
            self._auto_ended(self._auto_pool)
        return ended

    @property
    def auto_on(self) -> bool:
        """Whether plain cells run on the pool (``%sky auto on``)."""
        return self._auto_cells is not None and self._auto_cells.enabled

    def auto(self, on: bool | None = None) -> str:
        """``%sky auto on|off``: plain cells run on the current pool as ``%%sky`` cells, or in
        the notebook; ``None`` changes nothing. The line that says which.
        """
        cells = self._auto_cells
        if cells is None:
            raise SessionError("%sky auto needs an IPython shell: %load_ext skyward_jupyter there")
        if on is not None and on != cells.enabled:
            cells.enabled = on
            self._auto_pool = (self.current or "default") if on else None
            self.views.auto(self._auto_pool)
        if self._auto_pool is None:
            return "auto: off: cells run in the notebook (%sky auto on: plain cells on the pool)"
        return (
            f"auto: cells run on pool {self._auto_pool!r} (magics, ! and %%local cells run in "
            "the notebook; %sky auto off to stop)"
        )

    def _auto_follows(self, name: str) -> None:
        """Auto cells run on the current pool: ``name`` is it now (a cell, ``%sky up`` or
        ``%sky run`` with ``--name``), and its views say so.
        """
        if self.auto_on and name != self._auto_pool:
            self._auto_pool = name
            self.views.auto(name)

    def _auto_ended(self, name: str) -> None:
        """Auto goes off with the pool its cells run on: the next plain cell would otherwise
        start a new pool, unasked (and undo an idle stop on paid machines).
        """
        if self._auto_cells is None or name != self._auto_pool:
            return
        self._auto_cells.enabled = False
        self._auto_pool = None
        self.views.auto(None)
        self._announce(
            f"auto: off, as pool {name!r} ended: cells run in the notebook again "
            "(%sky auto on to run them on a pool)"
        )

    def panel(self, name: str | None = None) -> None:
        """Show the live panel of a pool (the current one by default)."""
        self._view(self.views.show, name)

    def stacks(self, name: str | None = None) -> str:
        """Every rank's Python stacks and the collective each waits in (``%sky stacks``)."""
        return self._require(name).pool.stacks()

    def head_names(self, path: tuple[str, ...], timeout: float) -> Names | None:
        """The current pool's head's names, or the attributes of ``path`` there (the notebook's
        Tab completion); None when no pool is ready or the head did not answer by ``timeout``.
        Never starts a pool, nor waits for another command of the session.
        """
        entry = self._pools.get(self.current or "")
        if entry is None or not entry.pool.running:
            return None
        try:
            return entry.pool.names((0,), path, timeout)[0]
        except PoolError:  # it ended meanwhile
            return None

    def who(self, name: str | None = None, ranks: Sequence[int] | None = None) -> str:
        """``%sky who``: the names the head (or ``ranks``) binds, a table per rank."""
        answers = self._require(name).pool.names(ranks or (0,), (), WHO_TIMEOUT)
        return "\n\n".join(table(r, answer, WHO_TIMEOUT) for r, answer in answers.items())

    def metrics(self, name: str | None = None) -> Any:
        """What ``log()`` recorded on a pool's ranks: (step, name, mean, min, max, ranks) rows."""
        return self._view(self.views.metrics, name)

    def _view(self, call: Callable[[str | None, str | None], Any], name: str | None) -> Any:
        try:
            return call(name, self.current)
        except LookupError as exc:
            raise SessionError(str(exc.args[0] if exc.args else exc)) from None

    def sweep(
        self, given: Mapping[str, Any] | None = None, *, yes: bool = False, all_owners: bool = False
    ) -> str:
        """What providers made that no live pool (this session's, or the registry's with a live
        owner) owns: cloud instances and what was made with them; listed, or with ``yes`` ended.
        ``given``: the providers' options (where to look), over the configured defaults.
        """
        from .registry import live_teardowns

        return sweep_all(
            [e.pool.provider for e in self._pools.values()],
            live_teardowns(),
            yes=yes,
            all_owners=all_owners,
            given=given or {},
            defaults={self.defaults.provider: self.defaults.options},
            extra=self.provider_options,
        )

    def clean(self, given: Mapping[str, Any]) -> list[str]:
        """``%sky clean``: on the hosts that the providers' options in ``given`` name, or else
        the current pool's, remove the caches no running pool uses; one line per host.
        """
        if any(v is not None for v in given.values()):
            spec = self.spec_from(given)
            extra = self.provider_options.get(spec.provider, {})
            provider = provider_class(spec.provider).from_spec(spec, "clean", extra)
        else:
            provider = self._require().pool.provider
        return _interruptible(provider.clean())

    def status(self) -> str:
        """``%sky status``: every pool (``*`` the current one), its state and its ranks."""
        return status_text(
            {n: (e.spec.describe(), e.pool) for n, e in self._pools.items()},
            {n: spec.describe() for n, spec in self._failed.items()},
            self.current,
        )

    def _require(self, name: str | None = None) -> PoolEntry:
        target = name or self.current
        if target is not None and target not in self._pools and target in self._failed:
            raise SessionError(self._failed_line(target))
        if target is not None and name is not None and target not in self._pools:
            running = ", ".join(repr(n) for n in self._pools)
            raise SessionError(
                f"no pool named {name!r}" + (f" (running: {running})" if running else "")
            )
        if target is None or target not in self._pools:
            raise SessionError("no pool is running; run a %%sky cell or %sky up first")
        return self._pools[target]


def _serves(entry: PoolEntry, spec: PoolSpec) -> bool:
    """Whether ``entry``'s running pool is what ``spec`` asks: its own spec, or one that spells
    out what the pool chose for an option left out (``--procs-per-node 1`` where each node
    has one rank, ``--backend gloo`` where its group is gloo's, ``--framework torch`` where its
    ranks set torch up). Replacing it would lose every rank's state for nothing.
    """
    if spec == entry.spec or entry.pool.group_problem:
        return spec == entry.spec  # (a pool whose group broke is what it was, not its choice)
    pool = entry.pool
    per_node = set(collections.Counter(r.node for r in pool.ranks).values())
    chosen = pool.group_backend

    def as_run(asked: PoolSpec) -> dict[str, Any]:
        # Fields, not a spec: a spec is checked as it is made, and a choice filled in may
        # clash with what was asked (nccl, chosen on GPUs, with --gpu none), a difference.
        run = {f.name: getattr(asked, f.name) for f in fields(asked)}
        run.update(
            procs_per_node=asked.procs_per_node or (min(per_node) if len(per_node) == 1 else None),
            backend=asked.backend or chosen,
            frameworks=asked.frameworks or (("torch",) if chosen else ()),
        )
        return run

    return as_run(spec) == as_run(entry.spec)


def _same_hosts(old: PoolSpec, new: PoolSpec) -> bool:
    """Whether a pool replacing ``old`` with ``new`` runs on some of the same machines."""
    same = provider_class(old.provider).same_machines
    return old.provider == new.provider and same(old.options, new.options)


def _interruptible(work: Coroutine[Any, Any, T]) -> T:
    """Run ``work`` in a thread of its own, the kernel's thread waiting so that Ctrl-C reaches
    it: the work is then cancelled (its connections closed), and the interrupt goes on.
    """
    loop = asyncio.new_event_loop()
    task = loop.create_task(work)

    def run() -> None:
        try:
            loop.run_until_complete(asyncio.wait([task]))  # its outcome is read from the task
        finally:
            loop.close()

    thread = threading.Thread(target=run, name="skyward-clean", daemon=True)
    thread.start()
    try:
        while thread.is_alive():
            thread.join(0.1)
    except KeyboardInterrupt:
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nothing to cancel
            loop.call_soon_threadsafe(task.cancel)
        thread.join(5)
        raise
    return task.result()


def _read_script(path: str) -> tuple[str, CheckedSource]:
    """The script's absolute path (its name in tracebacks) and its source, checked. A
    directory runs its ``__main__.py``, as ``python DIR`` does.
    """
    script = Path(path).expanduser()
    if script.is_dir():
        if not (script / "__main__.py").is_file():
            raise SessionError(f"{path} is a directory without a __main__.py: give the script")
        script = script / "__main__.py"
        path = str(Path(path) / "__main__.py")  # what the errors below name
    if not script.is_file():
        where = "" if script.is_absolute() else f" (looked in {Path.cwd()})"
        raise SessionError(f"no such script: {path}{where}")
    try:
        resolved = str(script.resolve())
        source = CheckedSource.check(script.read_text(), resolved)
    except (OSError, UnicodeDecodeError) as exc:
        raise SessionError(f"cannot read {path}: {exc}") from None
    except SyntaxError as exc:
        raise SessionError(
            f"{path}, line {exc.lineno}: SyntaxError: {exc.msg}; nothing was run"
        ) from None
    return resolved, source

"""The rank process: one per DDP rank, spawned by a provider, speaking the wire on stdin/stdout.

Threads and their jobs:

- main: runs commands one at a time (cells, process-group changes); user code runs here, so a
  SIGINT aimed at this thread interrupts it like Ctrl-C in a terminal; while idle, it reads the
  wire itself (see :mod:`.inbox`);
- reader: reads the wire while main runs a command (from the watchdog's next tick on), so
  heartbeats, interrupts, stack and names requests are still answered while a cell runs;
- watchdog: sends heartbeats and batched metrics; lets the reader read when main is busy; exits
  the process when the notebook's heartbeat has been silent too long (its machine may be gone
  without closing the channel);
- two capture threads (see :mod:`.output`).

Whichever thread reads the wire exits the process when the channel closes.

What a finished cell sends back is built in :mod:`.cell_result`; the process's name, C stdio and
usage sampling are in :mod:`.process`.

The exits use ``os._exit`` because user code may be blocked in C (a collective, a sleep) and
would never return to let a normal exit happen. Every exit goes through :meth:`Agent.leave`: what
the rank's cells started, detached or not, ends with it (see :mod:`.descendants`), and so does its
private directory (torch's ``@record`` error file).
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import platform
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, NoReturn, TypeVar

import cloudpickle

from .. import protocol as p
from .. import runtime
from ..launch_env import error_file, launched
from ..wire import SyncChannel
from .agent_threads import AGENT_THREADS
from .arrivals import Arrivals
from .cell_head import CellHead
from .cell_result import cell_done
from .cells import Namespace, run_script
from .console import Console
from .descendants import (
    become_subreaper,
    end_descendants,
    make_private_dir,
    remove_private_dir,
)
from .inbox import Inbox
from .names import answer as names_answer
from .node_usage import NodeUsage, socket_path
from .output import FdCapture, PythonStreams
from .process import UsageMeter, flush_c_stdio, set_process_name, unread_bytes
from .relay import RelayKeys
from .rich_output import RichOutput
from .stacks import Watch
from .torch_setup import GroupSettings
from .workdir import remove_tree
from .worlds import Worlds

T = TypeVar("T")
EXIT_CHANNEL_CLOSED = 0
EXIT_HEARTBEAT_LOST = 75
EXIT_AGENT_FAILED = 70
HEARTBEAT_FILE_EVERY = 2.0
"""Seconds between touches of ``$SKYWARD_HEARTBEAT_FILE`` (a cloud instance's watchdog reads it)."""


@dataclass(frozen=True, slots=True)
class AgentSettings:
    """What the provider passes in ``SKYWARD_AGENT`` (JSON); the topology comes in torch's vars."""

    heartbeat_interval: float = 1.0
    heartbeat_timeout: float = 15.0
    backend: str | None = None
    pg_timeout: float = 1800.0
    relay_token: str | None = field(default=None, repr=False)
    """The pool's relay secret (None: no relay, as on the notebook's own machine)."""
    relay_cert: str | None = None
    """The pool's certificate (PEM) the relay's TLS uses and its clients trust alone."""
    relay_key: str | None = field(default=None, repr=False)
    """The certificate's private key (PEM): the head's only."""
    frameworks: tuple[str, ...] | None = None
    """What the rank sets up (``--framework``); None: torch when it is installed."""
    keras_backend: str | None = None
    secure: bool = False
    """gloo on loopback, its traffic between hosts through TLS tunnels (``--secure``)."""
    ranks_on_machine: int = 1
    """The pool's ranks on this rank's machine, every node there counted (see :mod:`.inbox`)."""

    @classmethod
    def from_env(cls) -> AgentSettings:
        # Taken out of the environment: it holds the relay's token (and, on the head, its key),
        # which neither the cells nor what they start should see.
        given = json.loads(os.environ.pop("SKYWARD_AGENT", "{}"))
        if given.get("frameworks") is not None:
            given["frameworks"] = tuple(given["frameworks"])
        return cls(**given)


class Agent:
    def __init__(self, settings: AgentSettings) -> None:
        self.settings = settings
        set_process_name(f"sky-rank-{os.environ.get('RANK', '0')}")
        become_subreaper()  # what a cell detaches stays below the rank, to end with it
        # Take the wire off descriptors 0 and 1 before anything can print or read there.
        wire_in, wire_out = os.dup(0), os.dup(1)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        self._diag = os.dup(2)
        lines = os.environ.get("SKYWARD_WIRE") == "lines"
        self.channel = SyncChannel(wire_in, wire_out, lines, progress=self._heard)
        self.namespace = Namespace()
        self._notes: list[str] = []
        self._bound_here: set[str] = set()
        """Names this rank's cells bound: a global sent to be kept where not bound
        (``RunCell.keep``) leaves these alone."""
        self._withheld: dict[str, tuple[int, str]] = {}
        """Globals the notebook sent that this rank did not bind, as they share tensors with one
        it keeps (see :meth:`_bind`): the cell they came with, and why; a later cell that misses
        one says so."""
        group = GroupSettings(
            rank=int(os.environ.get("RANK", "0")),
            world_size=int(os.environ.get("WORLD_SIZE", "1")),
            local_rank=int(os.environ.get("LOCAL_RANK", "0")),
            master_addr=os.environ.get("MASTER_ADDR", "127.0.0.1"),
            backend=settings.backend,
            timeout=settings.pg_timeout,
            secure=settings.secure,
            pool_keys=(settings.relay_cert, settings.relay_key)
            if settings.secure and settings.relay_cert and settings.relay_key
            else None,
        )
        self.worlds = Worlds(
            group, settings.frameworks, settings.keras_backend, self._notes.append, self._diagnose
        )
        self.arrivals = Arrivals(
            int(os.environ.get("GROUP_RANK", "0")),
            group.local_rank == 0,
            group.master_addr,
            RelayKeys(settings.relay_token, settings.relay_cert, settings.relay_key)
            if settings.relay_token
            else None,
            self._diagnose,
            self._notes.append,
        )
        self.watch = Watch(AGENT_THREADS)
        head = CellHead(
            group.rank, self._send_whole, lambda: (self.cell_id, self.cell_head), self._sync_output
        )
        self.console = Console(head)
        self.console.install()
        self.rich_output = RichOutput(head, self._notes.append)
        self.rich_output.install()
        self.inbox = Inbox(self.channel, self._route, settings.ranks_on_machine)
        self.cell_id: int | None = None
        self.cell_head = 0
        """The running cell's head rank (``RunCell.head``): the one whose prompts the notebook
        answers."""
        self._in_cell = False
        self._interrupted = False
        """An interrupt arrived during the current cell (its error is then a consequence)."""
        self._stop_cell: int | None = None
        self._last_cell: int | None = None
        """The last cell run since the group last formed (when it forms again, it is why)."""
        """A cell the pool stopped before it started here (its interrupt came first)."""
        self._keep_files = False
        """The pool asked the node to keep its copy of the synced directories."""
        self._cell_lock = threading.Lock()
        """Orders an interrupt against the start of a cell (reader thread against main)."""
        self._last_heard = time.monotonic()
        self._heartbeat_file = os.environ.get("SKYWARD_HEARTBEAT_FILE") or None
        self._heartbeat_touched = 0.0
        self._metrics: list[tuple[int | None, dict[str, float]]] = []
        self._metrics_lock = threading.Lock()
        self._usage = UsageMeter()
        self._private_dir: str | None = None
        """This rank's own directory (mode 0700), removed when it ends (see :mod:`.descendants`
        for when it is killed)."""
        if "TORCHELASTIC_ERROR_FILE" not in os.environ:
            self._private_dir = make_private_dir(os.environ.get("TORCHELASTIC_RUN_ID", "pool"))
            os.environ["TORCHELASTIC_ERROR_FILE"] = error_file(self._private_dir)
        self._leaving = threading.Lock()
        """Held by the one thread that ends the process (the reader, the watchdog and main may
        all try at once)."""

        threading.excepthook = self._thread_died
        # Helper threads inherit a blocked SIGINT, so a process-wide SIGINT reaches the main thread.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        run_id = os.environ.get("TORCHELASTIC_RUN_ID", "pool")
        self.node_usage = NodeUsage(  # the node's first rank starts its thread here
            group.rank,
            socket_path(run_id, int(os.environ.get("GROUP_RANK", "0"))),
            group.local_rank == 0,
            os.environ.get("LOCAL_WORLD_SIZE", "1") == "1",
            self.channel.send,
            self._diagnose,
        )
        self.captures = [
            FdCapture(1, "stdout", self._emit_output),
            FdCapture(2, "stderr", self._emit_output),
        ]
        threading.Thread(target=self._read_loop, name="reader", daemon=True).start()
        threading.Thread(target=self._watchdog, name="watchdog", daemon=True).start()
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        signal.signal(signal.SIGINT, self._on_sigint)
        self.streams = PythonStreams({c.stream: c for c in self.captures})
        runtime.set_metric_sink(self._record_metric)

    # ------------------------------------------------------------------ threads other than main

    def _diagnose(self, text: str) -> None:
        os.write(
            self._diag, f"skyward_jupyter agent (rank {os.environ.get('RANK')}): {text}\n".encode()
        )

    def _thread_died(self, args: threading.ExceptHookArgs) -> None:
        """A thread of the agent's own died: the rank cannot be trusted any more, so it exits
        loudly (the pool reports it lost, with this message) rather than limp on unwatched.
        """
        if args.thread is not None and args.thread.name in AGENT_THREADS:
            self._diagnose(f"agent thread {args.thread.name} failed: {args.exc_value!r}")
            self.leave(EXIT_AGENT_FAILED)
        threading.__excepthook__(args)  # a user thread: report as Python always does

    def _emit_output(self, stream: str, text: str) -> None:
        self.channel.send(p.Output(self.cell_id, stream, text))

    def _record_metric(self, step: int | None, values: dict[str, float]) -> None:
        with self._metrics_lock:
            self._metrics.append((step, values))

    def _flush_metrics(self) -> None:
        with self._metrics_lock:
            rows, self._metrics = self._metrics, []
        if rows:
            self.channel.send(p.Metrics(self.cell_id, tuple(rows)))

    def _heard(self) -> None:
        self._last_heard = time.monotonic()

    def _route(self, message: object) -> bool:
        """Answer ``message`` at once, whichever thread read it (True); False for a command."""
        self._last_heard = time.monotonic()
        if isinstance(message, p.Beat):
            self._touch_heartbeat_file()
            return True
        if isinstance(message, p.Interrupt):
            self._interrupt_cell(message.cell_id)
            return True
        if isinstance(message, p.StackRequest):
            stacks = self.watch.stacks()
            self.channel.send(dataclasses.replace(stacks, request=message.request))
            return True
        if isinstance(message, p.NamesRequest):
            self.channel.send(names_answer(message, self.namespace.globals))
            return True
        if isinstance(message, p.InputReply):
            self.console.answer(message)
            return True
        if self.arrivals.on_wire(message):
            return True
        if isinstance(message, p.Shutdown):
            self._keep_files = message.keep_files
            self._interrupt_main()  # a cell still running stops
        return False

    def _read_loop(self) -> None:
        self._reading(self.inbox.read_while_busy)

    def _reading(self, read: Callable[[], T]) -> T:
        try:
            return read()
        except EOFError:
            self.leave(EXIT_CHANNEL_CLOSED)
        except BaseException as exc:  # noqa: BLE001 - an unreadable wire leaves nothing to serve
            self._diagnose(f"channel failed: {exc!r}")
            self.leave(EXIT_CHANNEL_CLOSED)

    def leave(self, code: int) -> NoReturn:
        """End the process, and with it every process its cells started, its directory and
        (with its node's last rank) the node's copy of the synced directories.

        One thread does it; another that gets here meanwhile waits for the process to end. The
        quick steps come first (the tree frozen and killed within
        :data:`.descendants.FREEZE_TIMEOUT`, then the copy renamed away: the cell's children,
        forked DataLoader workers among them, hold the copy's lock until they are gone), the
        deletions last: all fit in the pool's shutdown grace, and a kill during the deletions
        leaves what the next removal sweeps.
        """
        if not self._leaving.acquire(blocking=False):
            while True:
                time.sleep(60)
        try:
            end_descendants(os.getpid())
            removals = self._leave_files()
            self.node_usage.close()
            if self._private_dir is not None:
                remove_private_dir(self._private_dir)
            for path in removals:
                try:
                    remove_tree(path)
                except OSError as exc:  # the next removal on the node sweeps what is left
                    self._diagnose(f"could not delete {path}: {exc}")
        finally:
            os._exit(code)

    def _leave_files(self) -> list[Path]:
        """As the rank ends: the node's copy of the synced directories goes with its last
        rank, unless the pool keeps it, and its large values with its first; the directories
        to delete. Never raises: the rank's other leaving steps must still run.
        """
        try:
            removals, problems = self.arrivals.files.leave(self._keep_files)
        except OSError as exc:
            self._diagnose(f"could not let go of the synced copies: {exc}")
            return self.arrivals.leaving()
        for problem in problems:
            self._diagnose(problem)
        return removals + self.arrivals.leaving()

    def _touch_heartbeat_file(self) -> None:
        """Tell the machine's watchdog that the notebook is alive (cloud instances only)."""
        now = time.monotonic()
        if self._heartbeat_file is None or now - self._heartbeat_touched < HEARTBEAT_FILE_EVERY:
            return
        self._heartbeat_touched = now
        try:
            with open(self._heartbeat_file, "a"):
                os.utime(self._heartbeat_file)
        except OSError as exc:  # the watchdog will stop the machine: say why, once
            self._diagnose(f"cannot touch the heartbeat file {self._heartbeat_file}: {exc}")
            self._heartbeat_file = None

    def _watchdog(self) -> None:
        s = self.settings
        tick = min(0.25, s.heartbeat_interval)
        last_beat = 0.0
        waiting = 0
        silent_before = False
        while True:
            time.sleep(tick)
            now = time.monotonic()
            # Bytes arriving that no thread has read yet (the main thread still importing
            # torch, a C call holding the GIL) are the notebook heard all the same.
            try:
                arrived = unread_bytes(self.channel.read_fd)
            except OSError:  # a wire that cannot tell: only what was read counts
                arrived = 0
            if arrived > waiting:
                self._last_heard = now
            waiting = arrived
            # Silent at two ticks running: a beat the reader had just taken off the wire but not
            # yet counted, as this thread looked (both woken at once: a stopped process let go,
            # a loaded machine), is counted by the next tick.
            silent = now - self._last_heard > s.heartbeat_timeout
            if silent and silent_before:
                self._diagnose(
                    f"no heartbeat from the notebook for {s.heartbeat_timeout:.0f} s; exiting"
                )
                self.leave(EXIT_HEARTBEAT_LOST)
            silent_before = silent
            self._flush_metrics()
            self.inbox.tick()
            self.worlds.tick()
            if now - last_beat >= s.heartbeat_interval:
                # torch is read only once the main thread has finished importing it: a module
                # half-imported by another thread has no attributes yet.
                usage = self._usage.sample(torch_ready=self.worlds.torch is not None)
                seen, waited = self.watch.sample()
                if seen is not None:
                    usage = dataclasses.replace(
                        usage, waiting=f"{seen.collective} at {seen.where}", waited=waited
                    )
                self.node_usage.beat(usage)
                last_beat = now

    def _interrupt_cell(self, cell_id: int | None) -> None:
        """Stop the running cell; an interrupt that overtook its cell stops it as it starts
        (the rank would otherwise run it in full, and wait in its collectives until killed).
        """
        with self._cell_lock:
            if self._in_cell and cell_id in (None, self.cell_id):
                self._interrupted = True
                self._interrupt_main()
            elif cell_id is not None:
                self._stop_cell = cell_id  # ids only grow: a stale one never matches again

    def _interrupt_main(self) -> None:
        if self._in_cell:
            signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)

    def _on_sigint(self, signum: int, frame: FrameType | None) -> None:
        # Only user code is interruptible; between cells the agent must finish what it sends.
        if self._in_cell:
            raise KeyboardInterrupt

    def _send_whole(self, message: object) -> None:
        """Send from the cell's thread (a figure, a prompt): a signal that comes meanwhile (the
        pool's interrupt, a cell's alarm) has its handler run once the frame is written; raised
        inside it, its exception would leave half a frame on the wire, and the notebook would
        read what follows as its rest. One already caught when the signals are blocked raises
        as ``send`` is entered (Python runs pending handlers there), before anything is written.
        """
        if threading.current_thread() is not threading.main_thread():
            self.channel.send(message)  # handlers run on the main thread only
            return
        # The mask as it is (the call runs pending handlers, so may raise: nothing changed yet);
        # blocking may raise too, for one caught in between: the mask is put back all the same.
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, ())
        try:
            signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
            self.channel.send(message)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)

    # ------------------------------------------------------------------------------- main thread

    def serve(self) -> None:
        self.worlds.prepare()
        self.namespace.ready(self.worlds.ready_names())
        self.channel.send(
            p.Hello(
                pid=os.getpid(),
                hostname=platform.node(),
                python=platform.python_version(),
                cloudpickle=cloudpickle.__version__,
                torch=self.worlds.torch,
                cuda_devices=self.worlds.cuda_devices(),
                nccl=self.worlds.nccl(),
                relay_port=self.arrivals.relay_port,
                jax=self.worlds.jax_version,
                problem=self.worlds.problem,
            )
        )
        while True:
            command = self._reading(self.inbox.next_command)
            if isinstance(command, p.RunCell):
                self._run_cell(command)
            elif isinstance(command, p.SyncFiles):
                self.channel.send(self.arrivals.sync(command))
            elif isinstance(command, p.FormGroup):
                after = f" after cell {self._last_cell}" if self._last_cell is not None else ""
                self._last_cell = None
                self.worlds.form(command, self.channel.send, self.namespace.globals, after)
                self.namespace.ready(self.worlds.ready_names())
            elif isinstance(command, p.LeaveGroup):
                self._leave_group()
            elif isinstance(command, p.Shutdown):
                self._leave_group()
                self._sync_output()
                return  # main() runs the exit hooks, then leave() ends the rest

    def _leave_group(self) -> None:
        try:
            self.worlds.leave()
        except Exception as exc:  # noqa: BLE001 - a broken group is being discarded anyway
            self._diagnose(f"leaving the process group failed: {exc!r}")

    def _sync_output(self) -> None:
        self.streams.flush()
        flush_c_stdio()
        for capture in self.captures:
            capture.sync()

    def _mend_output(self) -> None:
        """After a cell: its closed or replaced stdout and stderr reach the notebook again, and
        the cell's result says what the cell had done to them.
        """
        mended = [note for note in [c.mend() for c in self.captures] + self.streams.mend() if note]
        if mended:
            rank = os.environ.get("RANK", "0")
            self._notes.extend(f"rank {rank}: {note}" for note in mended)

    def _bind(self, command: p.RunCell, group: dict[str, Any]) -> None:
        """Bind globals that arrived together, except those this rank holds its own of
        (``RunCell.keep``, ``RunCell.fill``): where it holds one of a group that shares tensors
        (a model), the others (its optimizer) stay as they are here too, and the cell says so:
        bound, they would step the notebook's copy, not this rank's.
        """
        own = [
            name
            for name in group
            if (name in command.fill and name in self.namespace.globals)
            or (name in command.keep and name in self._bound_here)
        ]
        if own and len(group) > len(own):
            rank = os.environ.get("RANK", "0")
            kept = " and ".join(map(repr, own))
            withheld = [name for name in group if name not in own]
            push = f"%sky push {' '.join(group)} gives every rank the notebook's"
            self._notes.append(
                f"rank {rank} keeps its own {kept}, so the notebook's "
                f"{' and '.join(map(repr, withheld))}, which "
                f"share{'s' * (len(withheld) == 1)} tensors with it, was not bound "
                f"there (it would step the notebook's copy); {push}"
            )
            for name in withheld:
                self._withheld[name] = (
                    command.cell_id,
                    f"rank {rank} did not bind the notebook's {name!r} "
                    f"(sent with {command.filename}): it keeps its own {kept}, which {name!r} "
                    f"shares tensors with; make {name!r} on this rank, or {push}",
                )
            return
        for name, value in group.items():
            if name not in own:
                self.namespace.bind(name, value)
                self._withheld.pop(name, None)

    def _run_cell(self, command: p.RunCell) -> None:
        self.cell_id = self._last_cell = command.cell_id
        self.cell_head = command.head
        started = time.perf_counter()
        value: Any = None
        error: BaseException | None = None
        before: dict[str, Any] = {}
        try:
            for group in self.arrivals.prepare(command):
                self._bind(command, group)
            before = dict(self.namespace.globals)  # holds the values, so ids cannot be reused
            self.worlds.user_calls.reset()
            try:
                with self._cell_lock:  # inside: an interrupt as the lock is let go is the cell's
                    self._interrupted = self._stop_cell == command.cell_id
                    self._in_cell = True
                if self._interrupted:
                    raise KeyboardInterrupt
                if command.script is None:
                    try:
                        value = self.namespace.run(command.source, command.filename)
                    except BaseException:
                        self.rich_output.cell_ended(failed=True)  # its figures closed undrawn
                        raise
                    self.rich_output.cell_ended()
                else:
                    script = command.script
                    path = self.arrivals.files.here(script.path)
                    with launched(command.run_id, self._private_dir):
                        argv0 = os.path.dirname(path) if script.directory else path
                        argv = (argv0, *script.argv)
                        run_script(command.source, path, argv, self.namespace.module)
            finally:
                self._in_cell = False
                if command.script is not None:
                    self.rich_output.discard()
        except BaseException as exc:  # noqa: BLE001 - the cell's failure is its result
            error = exc
        after_interrupt = self._interrupted
        seconds = time.perf_counter() - started
        after = self.namespace.globals
        bound = tuple(
            name
            for name, v in after.items()
            if before and (name not in before or before[name] is not v)
        )
        added = sum(name not in before for name in bound)
        # Counted first: a cell that deleted nothing (most) pays no walk over its namespace.
        deleted = (
            tuple(name for name in before if name not in after)
            if len(after) - added < len(before)
            else ()
        )
        before.clear()
        self._bound_here.update(bound)
        self._bound_here.difference_update(deleted)
        if self._withheld:
            for name in (*bound, *deleted):  # the rank's own now, or gone by its own cell
                self._withheld.pop(name, None)
            missing = error.name if isinstance(error, NameError) else None
            missed = self._withheld.get(missing) if missing is not None else None
            if missed is not None and missed[0] != command.cell_id:  # else said as it came
                self._notes.append(missed[1])
        self._sync_output()
        self._mend_output()
        self._flush_metrics()
        self.arrivals.files.note_modules()  # before the answer: an edit may follow it at once
        notes = tuple(self._notes)  # any thread may add one: a later one goes with the next
        done = cell_done(
            command.cell_id,
            value,
            error,
            seconds,
            after_interrupt,
            bound=bound,
            group_destroyed=self.worlds.destroyed(),
            notes=notes,
            collectives=self.worlds.collectives(),
            deleted=deleted,
        )
        del self._notes[: len(notes)]
        self.channel.send(done)
        self.cell_id = None
        if command.script is not None:
            # A script's namespace is a cycle (its functions hold its globals): without a full
            # collection its model, optimiser and data (on a GPU, its memory) would outlive the
            # run into the next one, as they never do under torchrun. Its group is retired, not
            # destroyed here (see ProcessGroup.retire).
            value = error = None
            del done
            gc.collect()

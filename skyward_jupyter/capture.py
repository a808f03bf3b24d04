"""Which notebook globals a cell needs on the ranks, and which of them must actually travel.

A cell is read, not run, to find the names it uses: every name it loads, also inside the
functions, lambdas and comprehensions it defines (they run on the ranks later and look those
names up there). The ones the notebook defines travel with the cell: modules by name, functions
and classes defined in the notebook by value (cloudpickle), data by value.

Two rules keep this cheap and unsurprising:
- a name an earlier ``%%sky`` cell bound on the ranks stays remote and wins over the notebook's;
- a value whose pickled bytes hash the same as when it was last sent is not sent again.

A large value's buffers (a numpy array's data) are not read again to be hashed while no byte of
them was written since they last were (:mod:`.written`): its pickle stream, which pickling
out-of-band keeps small and cheap, must also be the same (with the few bytes at the buffers'
ends that share a page with other memory), and its buffers where they were.
"""

from __future__ import annotations

import ast
import builtins
import re
import sys
import types
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import xxhash

from .protocol import Pickled, Together, each_once, is_array
from .results import PoolError
from .transfer import pickle_global
from .written import WATCH_MIN_BYTES, WRITES, Ranges, Watch, pages

LARGE_GLOBAL_BYTES = 100 * 1024 * 1024
SHELLS_NAMES = frozenset({"In", "Out", "get_ipython", "exit", "quit", "open"})
"""What IPython binds in every notebook's namespace (``InteractiveShell.init_user_ns``). Not
everything the shell lists as its own (``user_ns_hidden``): that also holds what startup files
and ``%pylab`` imported, which the cells use and the ranks need."""
_SHELLS_HISTORY = re.compile(
    r"_+|_i+|_i?\d+|_(dh|ih|oh|sh)"
    r"|__(name|doc|package|loader|spec|file|cached|annotations|builtin|builtins)__"
)
"""The names IPython keeps its history under (``_``, ``__``, ``_i``, ``_7``, ``_i7``, ``_oh``)
and a module's own (``__name__``; each rank has its own): never the notebook's data. Any other
name that starts with ``_`` is one the notebook defined (``_scale = 10``, ``__version__``) and
travels."""


def names_read(source: str) -> set[str]:
    """Every name the cell loads anywhere, including in the functions and lambdas it defines."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load | ast.Del):
            found.add(node.id)
        elif isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name):
            found.add(node.target.id)  # x += 1 reads x first
    return found


def _code_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
    return names


def names_used_by(value: Any) -> set[str]:
    """Global names a notebook-defined function (or the methods of such a class) looks up.

    On the ranks these functions are rebound to the rank's namespace (as if defined there), so
    the globals they use must travel as globals of their own.
    """
    if isinstance(value, types.FunctionType) and value.__module__ == "__main__":
        return _code_names(value.__code__)
    if isinstance(value, type) and value.__module__ == "__main__":
        return {n for member in vars(value).values() for n in names_used_by(member)}
    return set()


def _digest(pickled: Pickled) -> bytes:
    """A change detector, not a security check: XXH3, because it reads a large global many times
    faster than hashlib's fastest (BENCHMARKS.md, "Measurements behind the code").
    """
    h = xxhash.xxh3_128()
    h.update(pickled.data)
    for buffer in pickled.buffers:
        h.update(buffer)
    return h.digest()


@dataclass(frozen=True)
class _Hashed:
    """A large global as last hashed: the digest of its pickle stream and of its buffers' bytes
    outside the whole pages they fill, where those pages lie, the watch on them that began
    before they were read (if one did), and whether its digest was the one before (``steady``).
    """

    stream: bytes
    where: Ranges
    watch: Watch | None
    digest: bytes
    steady: bool


@dataclass(frozen=True)
class Shipment:
    """What one cell sends: the changed globals, pickled once for every rank."""

    globals: dict[str, Pickled]
    unchanged: tuple[str, ...]
    remote: tuple[str, ...]
    nbytes: int
    warnings: tuple[str, ...]
    digests: dict[str, bytes] = field(repr=False)
    keep: tuple[str, ...] = ()
    """Of ``globals``, names some ranks bound: they keep theirs (``RunCell.keep``)."""
    fill: tuple[str, ...] = ()
    """Of ``globals``, names some ranks lack: only those bind them (``RunCell.fill``)."""
    ranks_started: int | None = None
    """The pool's rank processes started when the globals were chosen (``Pool.run``'s
    ``started``); None: a pool not started yet."""

    @classmethod
    def nothing(cls) -> Shipment:
        """What a run that ships no globals sends (``%sky run``: a script brings its own)."""
        return cls({}, (), (), 0, (), {})


def _sharing(held: Mapping[str, list[Any] | None]) -> list[set[str]]:
    """The globals that share an object with another (by identity), in groups of two or more."""
    owner: dict[int, str] = {}
    group: dict[str, set[str]] = {name: {name} for name in held}
    for name, objects in held.items():
        for obj in objects or ():
            other = owner.setdefault(id(obj), name)
            if group[other] is not group[name]:
                merged = group[other] | group[name]
                for member in merged:
                    group[member] = merged
    unique = {id(g): g for g in group.values() if len(g) > 1}
    return list(unique.values())


def _arrays_in(value: Any) -> list[Any] | None:
    """The tensors of a torch model or optimizer, or a tensor or array itself, found without
    pickling it; None for any other value. Pickling a value to look (an optimizer's state, a
    list of tensors) would cost every cell that sends a new tensor up to seconds.
    """
    if is_array(value):
        return [value]
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    if isinstance(value, torch.nn.Module):
        return [*value.parameters(), *value.buffers()]
    if isinstance(value, torch.optim.Optimizer):
        state = [t for s in value.state.values() for t in s.values() if is_array(t)]
        return [*(t for group in value.param_groups for t in group["params"]), *state]
    return None


def _names(names: Iterable[str]) -> str:
    return " and ".join(repr(n) for n in names)


class Shipper:
    """Per pool: the globals already on the ranks (by hash) and the names the ranks own."""

    def __init__(self, shells_own: Mapping[str, Any] | None = None) -> None:
        """``shells_own``: the shell's own values by name (IPython's ``user_ns_hidden``); of
        those, the ones of :data:`SHELLS_NAMES` stay in the notebook while the name still holds
        them (a name the notebook rebinds travels).
        """
        self._shells_own: Mapping[str, Any] = shells_own or {}
        self._sent: dict[str, bytes] = {}
        self._remote: set[str] = set()
        """Names a cell bound on every rank: the ranks' now."""
        self._partly: set[str] = set()
        """Names ``--ranks`` cells bound on some ranks only: sent to be kept where not bound."""
        self._lacking: set[str] = set()
        """Names sent that some ranks may lack (a cell deleted them there, or a rank started
        again): sent again when read, bound only where lacking (the others may have changed
        theirs in place)."""
        self._hashed: dict[str, _Hashed] = {}
        self._ranks_started: int | None = None
        """How many rank processes the pool had started when last told (None: not yet)."""

    def prepare(
        self,
        source: str,
        user_ns: Mapping[str, Any],
        force: frozenset[str] = frozenset(),
        ranks_started: int | None = None,
    ) -> Shipment:
        """Pickle the globals ``source`` needs (:func:`.transfer.pickle_global`: a PoolError
        names one that cannot travel), for a pool that has started ``ranks_started`` rank
        processes so far (:meth:`note_ranks_started`; None: not started yet).
        """
        if ranks_started is not None:
            self.note_ranks_started(ranks_started)
        wanted = sorted(self._closure(names_read(source) | force, user_ns))
        send: dict[str, Pickled] = {}
        digests: dict[str, bytes] = {}
        unchanged, remote, warnings, keep, fill = [], [], [], [], []
        held: dict[str, list[Any] | None] = {}
        """Per global pickled: the tensors and arrays in it, which another could share (None:
        not looked at)."""
        for name in wanted:
            if name in self._remote and name not in force:
                remote.append(name)
                continue
            value = user_ns[name]
            # A function's copy of the globals it reads is not its own on the ranks (rebound
            # there): what it refers to is not shared with them.
            held[name] = None if isinstance(value, type | types.FunctionType) else []
            try:
                pickled = pickle_global(name, value, held[name])
            except PoolError:
                if name not in self._partly or name in force:
                    raise
                # Some ranks hold their own: the others lack the name, and say so by name,
                # rather than the cell fail for a value the ranks that have one never need.
                remote.append(name)
                continue
            digest = self._digest(name, pickled)
            digests[name] = digest
            if self._sent.get(name) == digest and name not in force:
                if name not in self._lacking:
                    unchanged.append(name)
                    continue
                fill.append(name)
            send[name] = pickled
            if name in self._partly and name not in force:
                keep.append(name)
            if pickled.nbytes > LARGE_GLOBAL_BYTES:
                warnings.append(
                    f"global {name!r} is {pickled.nbytes / 2**20:.0f} MiB and is sent to every "
                    "rank; loading it on the ranks inside the cell avoids the transfer"
                )
        if any(held.get(n) and n not in fill and not is_array(user_ns[n]) for n in send):
            # A new value (not a fill, not a bare batch) may be built over one the cell does
            # not read: looked for among those the ranks hold.
            self._note_held_on_ranks(held, user_ns)
        for group in _sharing(held) if send else ():
            fresh, there = sorted(group & send.keys()), sorted(group - send.keys())
            sent = _names(fresh)
            share = f"{sent} share{'s' * (len(fresh) == 1)} tensors with"
            theirs = [n for n in there if n in self._remote or n in self._partly]
            ours = [n for n in there if n not in theirs]
            if fresh and ours:
                warnings.append(
                    f"{share} {_names(ours)}, which the ranks hold from an earlier cell: they "
                    f"arrive with copies of those; %sky push {' '.join(sorted(group))} sends "
                    "them all together (the notebook's values then replace the ranks')"
                )
            if fresh and theirs:
                one = len(theirs) == 1
                warnings.append(
                    f"{share} the notebook's {_names(theirs)}, but the ranks' "
                    f"{'is' if one else 'are'} their own (a %%sky cell bound "
                    f"{'it' if one else 'them'}): on the ranks they share nothing, so one "
                    "does not act on the other (an optimizer steps a model it does not hold); "
                    "make them together in a %%sky cell, or %sky push "
                    f"{' '.join(sorted(group))} to give the ranks the notebook's values of all"
                )
            if len(fresh) > 1:  # those sent now travel together
                together = pickle_global(fresh[0], Together({n: user_ns[n] for n in fresh}))
                for name in fresh:
                    send[name] = together
        return Shipment(
            send,
            tuple(unchanged),
            tuple(remote),
            sum(p.nbytes for p in each_once(send.values())),
            tuple(warnings),
            digests,
            tuple(keep),
            tuple(fill),
            ranks_started,
        )

    def _note_held_on_ranks(
        self, held: dict[str, list[Any] | None], user_ns: Mapping[str, Any]
    ) -> None:
        """Add to ``held`` the tensors of the notebook's models, optimizers, tensors and arrays
        the ranks hold (sent there, or bound there by a cell) that this cell does not send,
        read or not (one a cell bound is never sent): a value sent now over one of them (an
        optimizer over a model) arrives over a copy of it, not over the ranks' own. A name some
        ranks may lack (deleted on one, or a rank started again) is still held by the others.
        """
        held_there = self._sent.keys() | self._partly | self._remote
        for name in sorted(held_there - held.keys()):
            arrays = _arrays_in(user_ns.get(name))
            if arrays is not None:
                held[name] = arrays

    def _digest(self, name: str, pickled: Pickled) -> bytes:
        """The digest of ``pickled``; its buffers are read only if they may have changed.

        A watch costs the notebook a page fault at its first write to each page, so a value
        written since its last hash, or found changed then, is hashed unwatched until it is
        found unchanged: one that changes every cell pays no faults.
        """
        large = sum(memoryview(b).nbytes for b in pickled.buffers) >= WATCH_MIN_BYTES
        watchable = pages(pickled.buffers) if large else None
        where, edges = watchable or ((), ())
        h = xxhash.xxh3_128(pickled.data)
        for edge in edges:
            h.update(edge)
        stream = h.digest()
        known = self._hashed.pop(name, None)
        if known is not None and known.watch is not None:
            if (known.stream, known.where) == (stream, where) and not WRITES.written(known.watch):
                self._hashed[name] = known
                return known.digest
            WRITES.release(known.watch)
        calm = known is None or (known.watch is None and known.steady)
        watch = WRITES.watch(where) if where and calm else None  # before the buffers are read
        digest = _digest(pickled)
        if where:
            steady = known is None or known.digest == digest
            self._hashed[name] = _Hashed(stream, where, watch, digest, steady)
        return digest

    def _closure(self, names: set[str], user_ns: Mapping[str, Any]) -> set[str]:
        """The notebook globals among ``names``, plus those their functions use, transitively;
        not the shell's own values, nor a builtin bound to its own name (the ranks have theirs).
        """
        shells_own = self._shells_own
        missing = object()

        def shippable(name: str) -> bool:
            value = user_ns.get(name, missing)
            return (
                value is not missing
                and not _SHELLS_HISTORY.fullmatch(name)
                and not (name in SHELLS_NAMES and value is shells_own.get(name, missing))
                and value is not vars(builtins).get(name, missing)
            )

        found: set[str] = set()
        todo = [n for n in names if shippable(n)]
        while todo:
            name = todo.pop()
            if name in found:
                continue
            found.add(name)
            todo.extend(n for n in names_used_by(user_ns[name]) if shippable(n))
        return found

    def commit(
        self,
        shipment: Shipment,
        bound: frozenset[str],
        every_rank: bool = True,
        deleted: frozenset[str] = frozenset(),
    ) -> None:
        """The cell ran: its globals are on the ranks, and the names it bound are theirs now.

        ``bound`` comes from the ranks (what the cell actually rebound, also when it failed
        part-way), not from reading the cell, so ``exec`` or ``globals()[...]`` count too. A
        cell that ran on some ranks only (``every_rank`` False) bound them there only: the
        others still take the notebook's values of those names. A name ``deleted`` on some
        rank is sent again when a cell reads it, kept by the ranks whose own it still is: one
        the ranks had bound goes with ``keep``; one the notebook sent, unchanged since, with
        ``fill``, as the other ranks may have changed it in place (a model they trained).
        """
        for name in shipment.globals:
            self._sent[name] = shipment.digests[name]
            self._lacking.discard(name)
        for name in bound:
            if every_rank:
                self._remote.add(name)
                self._partly.discard(name)
                self._sent.pop(name, None)
            elif name not in self._remote:
                # What was sent before still holds on the ranks that did not run the cell: an
                # unchanged notebook value is not sent again over what they made of it.
                self._partly.add(name)
        for name in deleted:
            if name in self._remote:
                self._remote.discard(name)
                self._partly.add(name)
            elif name in self._sent:
                self._lacking.add(name)

    def note_ranks_started(self, count: int) -> None:
        """The pool has started ``count`` rank processes so far: a change since it was last
        told means a rank began again with an empty namespace (lost while idle, and started
        again), so no value sent can be assumed there; the names the other ranks bound stay
        theirs, as :meth:`forget` has it for a loss during a cell.
        """
        if count != self._ranks_started:
            if self._ranks_started is not None:
                self.forget(frozenset())
            self._ranks_started = count

    def pushed(self, names: Iterable[str]) -> None:
        """``%sky push`` gave every rank the notebook's value of ``names``: one that only some
        ranks had bound is now every rank's, as a pushed name that all of them had bound stays.
        """
        for name in names:
            if name in self._partly:
                self._partly.discard(name)
                self._remote.add(name)

    def forget(
        self,
        survivors_bound: frozenset[str] | None = None,
        every_rank: bool = True,
        deleted: frozenset[str] = frozenset(),
    ) -> None:
        """Namespaces were lost (ranks restarted): no value sent can be assumed there any more.
        Each goes again when a cell reads it, bound only where lacking (``fill``): a surviving
        rank keeps what it made of it (a model it trained in place).

        ``survivors_bound``: only some ranks were lost, and the last cell bound these names on
        the others. Those, and the names earlier cells bound, stay remote: the notebook's values
        would silently replace what the surviving ranks hold, while a restarted rank, which
        lacks them, names them in its NameError. A cell that ran on some ranks only
        (``every_rank`` False) bound them there only, as :meth:`commit` has it. A name the
        others ``deleted`` is sent again, kept where a rank still holds its own.
        """
        self._lacking |= self._sent.keys()
        if survivors_bound is None:
            self._remote.clear()
            self._partly.clear()
        elif every_rank:
            self._remote |= survivors_bound
        else:
            self._partly |= survivors_bound - self._remote
        for name in deleted if survivors_bound is not None else ():
            if name in self._remote:
                self._remote.discard(name)
                self._partly.add(name)

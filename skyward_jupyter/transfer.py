"""What leaves the notebook for a cell besides its code: large globals and the synced directories.

Both leave the notebook once per pool, whatever the number of nodes. A global of
``RELAY_MIN_BYTES`` or more goes to the head only (a :class:`~.protocol.Stash`); the command every
rank gets names it by digest. The nodes pass it on among themselves in a binary tree of their
relays (:mod:`.agent.relay`, :func:`tree`): each node's first rank fetches it from its parent
(a :class:`~.protocol.Fetch`), checks it against that digest and serves it to at most two
children, so each node's link carries it once, no relay sends it more than twice, and N nodes
have it after about log2(N) hops. The node's ranks map that one copy (:mod:`.agent.node_blobs`).
The synced directories travel the same way: one rank per node says which contents it lacks,
those go to the head once as a bundle, and the nodes that lack them pass the bundle on in the
same tree and switch their copy.

Ranks on the notebook's own machine (local) get every global over their own pipes: the relay
would only add a hop. Nodes that share the notebook's filesystem get no copy: when the provider
says so (local), nothing is scanned or sent; when a node finds every listed file at the
notebook's own path (a shared home over NFS), its cells run in the notebook's directory.

The first sync of a directory to a pool says what it sends (how many files, how much, the
largest), and what it left out: keys and credentials, symlinks leading out of the directory.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import heapq
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any

from . import protocol as p
from . import wire
from .agent.relay import ancestors
from .events import PoolEvent, PoolMessage
from .providers.base import Provider
from .ranks import Rank, Ranks
from .results import PoolError, RankEnded
from .workdir import Manifest, Scanner, SyncError, bundle, human_bytes

Relay = tuple[int, str, int]
"""A node's relay: the node's index, its address, the port."""

RELAY_MIN_BYTES = 1 << 20
"""Smaller values go to every rank with the command: a relay round trip would cost more."""
DEFAULT_SYNC_CAP = 200 << 20
"""The most a synced directory may hold (``--sync-cap``): past it, the user says what to leave."""
SAY_AFTER_BYTES = 8 << 20
"""A later sync sending more than this says what it sends, and how long it took."""
NAMED = 5
"""How many files (largest, left out) a message names."""


def sync_key(root: str) -> str:
    """One copy per notebook machine and directory on each node."""
    return hashlib.sha256(f"{socket.gethostname()}:{root}".encode()).hexdigest()[:20]


class Transfer:
    def __init__(
        self,
        ranks: Ranks,
        roots: Sequence[str],
        cap_bytes: int,
        provider: Provider,
        emit: Callable[[PoolEvent], None],
        chosen: bool = True,
    ) -> None:
        self._ranks = ranks
        # Nodes that share the notebook's files run in its directories: nothing to scan or send.
        shares = provider.shares_files
        self._scanners = [] if shares else [Scanner(root, cap_bytes, chosen) for root in roots]
        self._shared = tuple(roots) if shares else ()
        self._emit = emit
        self._synced: dict[str, tuple[str, tuple[int, ...]]] = {}
        """Per key: the manifest digest the nodes hold, and the pids of the ranks that keep it
        (a new rank may find its node's copy gone: it is asked again)."""
        self._left: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {}
        """Per key: what the last message said was left out."""
        self.notes: list[str] = []
        """What the syncs said since the last cell took them (the cell's result repeats it)."""
        self.sent: list[tuple[str, int, int]] = []
        """(directory, files, bytes) of every bundle that left the notebook."""
        self._paths: dict[str, dict[int, str]] = {}

    # -- on the caller's thread: what the directories hold now --------------------------------

    def scan(self) -> list[Manifest]:
        """The synced directories' state; a :class:`PoolError` names a bad one (nothing sent)."""
        try:
            return [scanner.scan() for scanner in self._scanners]
        except SyncError as exc:
            raise PoolError(str(exc)) from None

    # -- on the IO thread ---------------------------------------------------------------------

    async def workdir(self, manifests: list[Manifest]) -> p.Workdir | None:
        """Bring every node in step with ``manifests``; where each node's cells run."""
        if self._shared:
            return p.Workdir({n.index: self._shared for n in self._ranks.nodes}, self._shared)
        if not manifests:
            return None
        keepers = tuple(r.hello.pid if r.hello else 0 for r in self._leaders())
        for manifest in manifests:
            key = sync_key(manifest.root)
            first = key not in self._synced
            if first:
                self._say(_listing(manifest))
            left = (manifest.secrets, manifest.outside)
            if left != self._left.get(key, ((), ())):
                self._say(*_left_out(manifest))
            self._left[key] = left
            if self._synced.get(key) == (manifest.digest, keepers):
                continue
            self._paths[key] = await self._sync(key, manifest, first)
            self._synced[key] = (manifest.digest, keepers)
        keys = [sync_key(m.root) for m in manifests]
        paths = {n.index: tuple(self._paths[k][n.index] for k in keys) for n in self._ranks.nodes}
        return p.Workdir(paths, tuple(m.root for m in manifests))

    def _leaders(self) -> list[Rank]:
        """One rank per node: the one that keeps the node's copy in step."""
        return [r for r in self._ranks.all if r.local_rank == 0]

    def _say(self, *lines: str) -> None:
        for line in lines:
            self.notes.append(line)
            self._emit(PoolMessage(line))

    def take_notes(self) -> list[str]:
        notes, self.notes = self.notes, []
        return notes

    async def _sync(self, key: str, manifest: Manifest, first: bool) -> dict[int, str]:
        ask = p.SyncFiles(key, manifest.root, manifest.entries, None)
        answers = await self._ask(self._leaders(), ask)
        lacking = {r: a for r, a in answers.items() if a.missing}
        if lacking:
            digests = {d for a in lacking.values() for d in a.missing}
            sizes = {f.digest: f.size for f in manifest.files}
            size = sum(sizes[d] for d in digests)
            started = time.monotonic()
            if size > SAY_AFTER_BYTES and not first:
                self._emit(
                    PoolMessage(
                        f"sending {len(digests)} file{'s' * (len(digests) != 1)} "
                        f"({human_bytes(size)}) of {manifest.root} to {len(lacking)} "
                        f"node{'s' * (len(lacking) != 1)}"
                    )
                )
            try:
                blob = await asyncio.to_thread(bundle, manifest, digests)
            except SyncError as exc:
                raise PoolError(str(exc)) from None
            ref = await self.stash(blob, list(lacking))
            self.sent.append((manifest.root, len(digests), size))
            again = p.SyncFiles(key, manifest.root, manifest.entries, ref)
            try:
                answers.update(await self._ask(list(lacking), again))
            finally:
                self.drop([ref.digest])
            if size > SAY_AFTER_BYTES:
                took = time.monotonic() - started
                self._emit(PoolMessage(f"{manifest.root} in step on the nodes ({took:.1f} s)"))
        paths = {}
        for rank, answer in answers.items():
            if answer.path is None:
                raise PoolError(
                    f"node {rank.node.index} ({rank.describe()}) could not take the files of "
                    f"{manifest.root}: {answer.error or 'it still lacks some'}"
                )
            paths[rank.node.index] = answer.path
        return paths

    async def _ask(self, ranks: list[Rank], command: p.SyncFiles) -> dict[Rank, p.Synced]:
        futures = {r: r.expect(p.Synced, command.key) for r in ranks}
        frame = wire.encode(command)
        for r in ranks:
            self._ranks.send(r, frame)
        try:
            answers = dict(zip(futures, await asyncio.gather(*futures.values()), strict=True))
        except RankEnded as exc:
            gone = next((r for r in futures if not r.alive), ranks[0])
            raise PoolError(
                f"node {gone.node.index} ({gone.describe()}) ended while its files were synced: "
                f"{exc.how}"
            ) from None
        failed = [(r, a) for r, a in answers.items() if a.error]
        if failed:
            rank, answer = failed[0]
            raise PoolError(f"node {rank.node.index} ({rank.describe()}): {answer.error}")
        return answers

    # -- the relay ----------------------------------------------------------------------------

    def _relay(self) -> tuple[str, int] | None:
        """The head's relay (address, port)."""
        relay = _relay_of(self._ranks.all[0])
        return relay[1:] if relay else None

    async def stash(self, blob: bytes | bytearray, readers: list[Rank]) -> p.Relayed:
        """Hand ``blob`` to the head, and have the first rank of each of the ``readers``'
        nodes fetch it in the nodes' tree (each gets it from the notebook itself when the head
        has no relay); the reference they load it by.
        """
        digest = await asyncio.to_thread(lambda: hashlib.sha256(blob).hexdigest())
        frame = wire.encode(p.Stash(digest, p.Pickled(blob)))
        nodes = {r.node.index for r in readers}
        leaders = [r for r in self._leaders() if r.node.index in nodes and r.index != 0]
        head = _relay_of(self._ranks.all[0])
        if head is None:
            for r in leaders:
                self._ranks.send(r, frame)
        self._ranks.send(self._ranks.all[0], frame)
        if head is not None:
            relays = [relay for relay in map(_relay_of, leaders) if relay]
            sources = tree([head, *relays])
            for r in leaders:  # a node without a relay of its own fetches from the head
                fetch = p.Fetch(digest, len(blob), sources.get(r.node.index, (head,)))
                self._ranks.send(r, wire.encode(fetch))
        return p.Relayed(digest, len(blob))

    def drop(self, digests: list[str]) -> None:
        if digests:
            frame = wire.encode(p.Drop(tuple(digests)))
            for r in self._ranks.all:
                if r.local_rank == 0:
                    self._ranks.send(r, frame)

    async def relay_globals(self, command: p.RunCell, live: list[Rank]) -> p.RunCell:
        """``command`` with its large globals replaced by references to a stash on the head."""
        if self._relay() is None or len(live) < 2:  # no relay on a pool of the notebook's machine
            return command
        shipped: dict[str, p.Pickled | p.Relayed] = {}
        stashed: dict[int, p.Relayed] = {}
        """By the value's identity: globals that travel together (:class:`.protocol.Together`)
        share one value, stashed once, and the ranks load it once."""
        for name, value in command.globals.items():
            if isinstance(value, p.Pickled) and value.nbytes >= RELAY_MIN_BYTES:
                if id(value) not in stashed:
                    blob = await asyncio.to_thread(wire.encode_blob, value)
                    stashed[id(value)] = await self.stash(blob, live)
                shipped[name] = stashed[id(value)]
            else:
                shipped[name] = value
        return dataclasses.replace(command, globals=shipped)


def _relay_of(rank: Rank) -> Relay | None:
    port = rank.hello.relay_port if rank.hello else None
    return (rank.node.index, rank.node.address, port) if port else None


def tree(relays: Sequence[Relay]) -> dict[int, tuple[Relay, ...]]:
    """Per node after the first (the head, the root), the relays it fetches from: its parent
    in a binary tree of ``relays`` in their order, then the parent's ancestors up to the head.
    """
    return {
        node: tuple(relays[j] for j in ancestors(k))
        for k, (node, _, _) in enumerate(relays[1:], start=1)
    }


def _listing(manifest: Manifest) -> str:
    """What the first sync of a directory sends: count, size, largest files."""
    largest = heapq.nlargest(NAMED, manifest.files, key=lambda f: f.size)
    named = ", ".join(f"{f.path} ({human_bytes(f.size)})" for f in largest)
    count = len(manifest.files)
    return (
        f"syncing {manifest.root} to the nodes: {count} file{'s' * (count != 1)}, "
        f"{human_bytes(manifest.total_bytes)}" + (f"; largest: {named}" if named else "")
    )


def _left_out(manifest: Manifest) -> list[str]:
    """What a sync left out, and how to send it after all."""
    lines = []
    root = manifest.root
    if manifest.secrets:
        n = len(manifest.secrets)
        lines.append(
            f"left out of {root} as keys or credentials: {n} file{'s' * (n != 1)} "
            f"({_some(manifest.secrets)}); to send one, add a line !PATH to {root}/.skyignore"
        )
    if manifest.outside:
        n = len(manifest.outside)
        lines.append(
            f"warning: {n} symlink{'s' * (n != 1)} in {root} lead{'s' * (n == 1)} out of it "
            f"and {'were' if n != 1 else 'was'} not followed: {_some(manifest.outside)}; "
            "copy what the nodes need into the directory, or --sync its own directory"
        )
    return lines


def _some(names: Sequence[str]) -> str:
    shown = ", ".join(names[:NAMED])
    return shown + (f" and {len(names) - NAMED} more" if len(names) > NAMED else "")


def pickle_global(name: str, value: Any, noting: list[Any] | None = None) -> p.Pickled:
    """The one gate a notebook global passes to travel: pickled once for every rank (a value
    already pickled passes as it is), or a :class:`PoolError` that names it and says what to do.
    ``noting`` gets the objects in it another global could share (:meth:`.Pickled.dump`).
    """
    if isinstance(value, p.Pickled):
        return value
    try:
        return p.Pickled.dump(value, noting)
    except Exception as exc:
        raise PoolError(
            f"global {name!r} ({type(value).__name__}) cannot be sent to the ranks: "
            f"{type(exc).__name__}: {exc}. Create it inside the %%sky cell instead, "
            "or pass what it is built from."
        ) from exc

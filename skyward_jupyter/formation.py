"""Forming the ranks' distributed worlds: torch's process group, and JAX's when the pool has it.

The head goes first: it starts what the others connect to (torch's rendezvous store on a port it
binds itself, a free port for JAX's coordinator) and says where; then every other rank is told,
and all join, torch's group before JAX's everywhere. What the ranks said when they started is
checked first, so a missing framework is named with its rank rather than found as a hang.
"""

from __future__ import annotations

import asyncio
import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from . import protocol as p
from . import wire
from .events import RankState
from .results import PoolError, RankEnded
from .spec import backend_problem

if TYPE_CHECKING:
    from .ranks import Rank, Ranks

FORM_TIMEOUT = 60.0
"""Seconds for the worlds to form (the ranks check their reach of each other within 10)."""
JAX_INSTALL = (
    "install it where the ranks run (pip install 'skyward_jupyter[jax]', which brings "
    "jax[cpu]; GPUs need jax[cuda12]), or leave out --framework jax"
)


def check_hellos(ranks: Ranks, started: list[Rank]) -> None:
    """Fail the start, naming the rank, when a rank lacks what the pool sets up."""
    wanted = ranks.settings.frameworks
    for r in started:
        assert r.hello is not None
        if r.hello.problem:
            raise PoolError(f"rank {r.index} ({r.describe()}): {r.hello.problem}")
        h, where = r.hello, f"rank {r.index} ({r.describe()})"
        problem = backend_problem(ranks.settings.backend, where, h.torch, h.nccl, h.cuda_devices)
        if problem is not None:
            raise PoolError(problem)
        if wanted.jax and r.hello.jax is None:
            where = f"rank {r.index} ({r.describe()})"
            raise PoolError(f"JAX is not installed on {where}: {JAX_INSTALL}")
    missing = [r for r in started if r.hello is not None and r.hello.torch is None]
    if missing and (wanted.torch or len(missing) < len(ranks.all)):
        where = ", ".join(f"rank {r.index} ({r.describe()})" for r in missing)
        have = next((r.hello.torch for r in ranks.all if r.hello and r.hello.torch), None)
        others = f"; the other ranks have torch {have}" if have else ""
        raise PoolError(f"torch is missing on {where}{others}: install it there")


def nothing_to_form(ranks: Ranks, jax: bool) -> str | None:
    """Why no world is formed now (None: one is; empty: JAX's world stands, nothing to say)."""
    wanted = ranks.settings.frameworks
    has_torch = wanted.torch is not False and all(
        r.hello is not None and r.hello.torch is not None for r in ranks.all
    )
    if has_torch or jax:
        return None
    if not wanted.forms_worlds:
        return "--framework none: no distributed setup"
    if wanted.jax:
        return ""  # JAX's world stands; torch is not set up
    return "torch is not installed on the ranks: torch.distributed setup skipped"


@dataclass(frozen=True, slots=True)
class Rebuilt:
    """What the ranks' namespaces had built on the earlier group (see
    :mod:`.agent.earlier_groups`), as ``name (kind)``.
    """

    rewrapped: tuple[str, ...] = ()
    """Wrapped again on the new group (DDP models)."""
    earlier: tuple[str, ...] = ()
    """To be built again: their next use fails, saying how."""


@dataclass(frozen=True, slots=True)
class Formed:
    """What a formation made, for :class:`~.ranks.Ranks` to keep."""

    backend: str | None
    """torch.distributed's backend (None: no torch group formed)."""
    port: int | None
    """Where the head's rendezvous store listens (None: no torch group formed)."""
    note: str
    """What the ranks formed, as the pool says it ("torch.distributed gloo, port 4242")."""
    rebuilt: Rebuilt


def reformed(backend: str, port: int | None, restarted: bool, rebuilt: Rebuilt) -> str:
    """What the notebook is told when the group formed again after a failure: DDP models were
    wrapped again on the new group; what torch cannot move is named, to be built again.
    """
    text = f"the pool formed its process group again ({backend}, port {port}"
    text += ")" if restarted else "; no rank was restarted)"
    if rebuilt.rewrapped:
        text += "; wrapped again on the new group: " + ", ".join(rebuilt.rewrapped)
    earlier = rebuilt.earlier
    if earlier:
        text += (
            "; built on the earlier group, these must be built again (their next use says how): "
            + ", ".join(earlier)
        )
    return text


async def form_worlds(ranks: Ranks, generation: int, jax: bool) -> Formed:
    """Form torch.distributed everywhere as formation ``generation``, and JAX's world when
    ``jax``; return what was formed and what the ranks' namespaces had built on the earlier
    group. Only ranks with a world to form come here (:func:`nothing_to_form`).
    """
    head, others = ranks.all[0], ranks.all[1:]
    for r in ranks.all:
        ranks.set_state(r, RankState.CONNECTING)
    states = {r: r.expect(p.GroupState, generation) for r in ranks.all}
    port_future = head.expect(p.GroupPort, generation)
    first: list[asyncio.Future[Any]] = [port_future, states[head]]  # the head hosts, or fails
    secret = secrets.token_bytes(32)  # the store's, for this formation only
    ranks.send(head, wire.encode(p.FormGroup(generation, None, secret, ranks.restarts, jax)))
    try:
        await asyncio.wait(first, timeout=FORM_TIMEOUT, return_when=asyncio.FIRST_COMPLETED)
        if not port_future.done():
            state = states[head].result() if states[head].done() else None
            reason = state.message if state else "no answer"
            raise PoolError(f"rank 0 ({head.describe()}) could not host the rendezvous: {reason}")
        where = port_future.result()
        command = p.FormGroup(generation, where.port, secret, ranks.restarts, jax, where.jax_port)
        frame = wire.encode(command)
        for r in others:
            ranks.send(r, frame)
        gathered = asyncio.gather(*states.values())
        # A cancelled wait (the pool going down) leaves the gathering's error to nobody.
        gathered.add_done_callback(lambda f: f.cancelled() or f.exception())
        results = await asyncio.wait_for(gathered, FORM_TIMEOUT + 10)
    except asyncio.TimeoutError:
        raise PoolError(f"the process group did not form within {FORM_TIMEOUT:.0f} s") from None
    except RankEnded as exc:
        raise PoolError(f"a rank ended while the process group formed: {exc.how}") from None
    failed = [(r, s) for r, s in zip(ranks.all, results, strict=True) if not s.ok]
    if failed:
        r, s = failed[0]
        raise PoolError(
            f"rank {r.index} ({r.describe()}) could not join the process group: {s.message}"
        )
    parts = []
    backend = results[0].backend if where.port is not None else None
    if where.port is not None:
        parts.append(f"torch.distributed {backend}, port {where.port}")
    if ranks.settings.frameworks.jax:
        count = len(ranks.all)
        parts.append(f"jax.distributed, {count} process{'es' * (count != 1)}")
    rebuilt = Rebuilt(
        tuple(dict.fromkeys(name for s in results for name in s.rewrapped)),
        tuple(dict.fromkeys(name for s in results for name in s.earlier)),
    )
    return Formed(backend, where.port, "; ".join(parts), rebuilt)

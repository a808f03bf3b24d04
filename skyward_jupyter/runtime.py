"""The API a cell uses on the ranks: where am I, my share of the data, metrics, output control.

Everything here also works outside a pool (in the notebook, in a plain script) with single-node
defaults, so a cell can be tried locally before it is sent to a pool. The agent fills in the
topology through environment variables before the first cell runs:

- the torch variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
  ``NODE_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``), and
- ``SKYWARD_POOL``: JSON with the pool's name, provider and nodes (address, ranks, GPUs).

Unlike the seeds, sharding is per *rank* (a DDP process), not per node: with two GPUs per node,
two ranks on one node must not train on the same half of the data.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import math
import operator
import os
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar, overload

F = TypeVar("F", bound=Callable[..., Any])
MetricSink = Callable[[int | None, dict[str, float]], None]


@dataclass(frozen=True, slots=True)
class Peer:
    node: int
    addr: str
    ranks: tuple[int, ...]
    accelerators: int


@dataclass(frozen=True, slots=True)
class InstanceInfo:
    """This rank's place in the pool."""

    node: int
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    total_nodes: int
    head_addr: str
    head_port: int | None
    accelerators: int
    peers: tuple[Peer, ...]
    pool: str | None

    @property
    def is_head(self) -> bool:
        return self.rank == 0


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else default


def instance_info() -> InstanceInfo:
    """The topology as the agent set it, or a world of one outside a pool."""
    pool = json.loads(os.environ.get("SKYWARD_POOL") or "null") or {}
    node = _env_int("NODE_RANK", 0)
    peers = tuple(
        Peer(
            node=int(p["node"]),
            addr=str(p["addr"]),
            ranks=tuple(int(r) for r in p["ranks"]),
            accelerators=int(p.get("accelerators", 0)),
        )
        for p in pool.get("nodes", [])
    )
    world = _env_int("WORLD_SIZE", 1)
    port = os.environ.get("MASTER_PORT")
    return InstanceInfo(
        node=node,
        rank=_env_int("RANK", 0),
        local_rank=_env_int("LOCAL_RANK", 0),
        world_size=world,
        local_world_size=_env_int("LOCAL_WORLD_SIZE", 1),
        total_nodes=len(peers) or 1,
        head_addr=os.environ.get("MASTER_ADDR", "127.0.0.1"),
        head_port=int(port) if port else None,
        accelerators=next((p.accelerators for p in peers if p.node == node), 0),
        peers=peers or (Peer(0, "127.0.0.1", tuple(range(world)), 0),),
        pool=pool.get("name"),
    )


# ------------------------------------------------------------------------------------ shard


def _length(x: Any) -> int:
    shape = getattr(x, "shape", None)
    if shape is not None and len(shape) > 0:
        return int(shape[0])
    return len(x)


def _take(x: Any, indices: list[int]) -> Any:
    module = type(x).__module__.split(".")[0]
    if module == "torch":
        import torch

        return x[torch.as_tensor(indices, dtype=torch.long)]
    if module == "numpy":
        return x[indices]
    if module == "pandas":
        return x.iloc[indices]
    if isinstance(x, tuple):
        return tuple(x[i] for i in indices)
    if isinstance(x, str):
        return "".join(x[i] for i in indices)
    return [x[i] for i in indices]


@overload
def shard(
    x: Any,
    /,
    *,
    shuffle: bool = ...,
    seed: int = ...,
    drop_last: bool = ...,
    rank: int | None = ...,
    world_size: int | None = ...,
) -> Any: ...
@overload
def shard(
    x: Any,
    y: Any,
    /,
    *more: Any,
    shuffle: bool = ...,
    seed: int = ...,
    drop_last: bool = ...,
    rank: int | None = ...,
    world_size: int | None = ...,
) -> tuple[Any, ...]: ...
def shard(
    *arrays: Any,
    shuffle: bool = False,
    seed: int = 0,
    drop_last: bool = False,
    rank: int | None = None,
    world_size: int | None = None,
) -> Any:
    """This rank's share of ``arrays``: every ``world_size``-th item, starting at ``rank``.

    Several arrays are sharded with the same indices, so ``x[i]`` still matches ``y[i]``; they
    must have the same length. ``shuffle`` applies one seeded permutation first, identical on
    every rank, so the shares stay disjoint. ``drop_last`` trims the tail so every rank gets
    the same count (a DDP loop with unequal step counts hangs in its last collective). Types are
    kept: tensors stay tensors, arrays arrays, DataFrames DataFrames, tuples tuples; other
    sequences become lists. One array in, one out; several in, a tuple out.
    """
    if not arrays:
        raise TypeError("shard() needs at least one array")
    info = instance_info() if rank is None or world_size is None else None
    rank = info.rank if rank is None and info else rank
    world_size = info.world_size if world_size is None and info else world_size
    assert rank is not None and world_size is not None
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"shard(): rank {rank} is outside a world of {world_size}")
    lengths = [_length(a) for a in arrays]
    if len(set(lengths)) > 1:
        raise ValueError(
            f"shard(): arrays must have the same length to stay aligned, got lengths {lengths}"
        )
    n = lengths[0]
    order = list(range(n))
    if shuffle:
        random.Random(seed).shuffle(order)
    if drop_last:
        order = order[: (n // world_size) * world_size]
    mine = order[rank::world_size]
    out = tuple(_take(a, mine) for a in arrays)
    return out[0] if len(out) == 1 else out


def shard_size(n: int, rank: int, world_size: int, drop_last: bool = False) -> int:
    """How many items :func:`shard` gives ``rank`` out of ``n``."""
    if drop_last:
        return n // world_size
    return math.ceil((n - rank) / world_size) if n > rank else 0


# -------------------------------------------------------------------------------------- log

_sink: MetricSink | None = None
_local_records: list[tuple[int | None, dict[str, float]]] = []


def set_metric_sink(sink: MetricSink | None) -> None:
    """Where :func:`log` sends metrics; the agent installs its batching sender here."""
    global _sink
    _sink = sink


TOTAL_KEY = "@total"
"""Where :func:`log`'s ``total`` travels among the metrics (no keyword argument is named so)."""


def log(step: int | None = None, total: int | None = None, **metrics: Any) -> None:
    """Record metrics for the live panel, aggregated across ranks per step.

    ``total``: how many steps the loop will take, once known; the panel then shows a bar and an
    estimate of the time left, as tqdm does. Cheap: on a rank it appends to a buffer the agent
    sends in batches; outside a pool it keeps the record locally (see :func:`local_metrics`).
    """
    values: dict[str, float] = {}
    if total is not None:
        try:
            count = operator.index(total)
        except TypeError:
            count = -1
        if isinstance(total, bool) or count < 0:
            raise TypeError(f"log(): total must be a count of steps, got {total!r}")
        if count > 2**53:  # a count a float still holds exactly
            raise ValueError("log(): total is too large a count of steps")
        values[TOTAL_KEY] = float(count)
    for name, value in metrics.items():
        try:
            if isinstance(value, str | bytes):
                raise TypeError("text is not a number")
            values[name] = float(value.item() if hasattr(value, "item") else value)
        except (TypeError, ValueError, RuntimeError) as exc:  # RuntimeError: a multi-item tensor
            raise TypeError(
                f"log(): metric {name!r} must be a number, got {type(value).__name__}"
            ) from exc
        except OverflowError:  # an int beyond any float
            raise ValueError(f"log(): metric {name!r} is too large for a float") from None
    if step is not None:
        if isinstance(step, bool):
            raise TypeError("log(): step must be an int, got bool")
        try:
            step = operator.index(step)  # numpy and 0-d tensor integers are fine
        except TypeError:
            raise TypeError(f"log(): step must be an int, got {type(step).__name__}") from None
    if _sink is not None:
        _sink(step, values)
    else:
        _local_records.append((step, values))


def local_metrics() -> list[tuple[int | None, dict[str, float]]]:
    """Metrics logged in this process outside a pool."""
    return list(_local_records)


# ---------------------------------------------------------------------------- output control


class _OutputControl(contextlib.ContextDecorator):
    """Silence streams on the ranks where a predicate is false; a context manager or decorator.

    Works on Python's ``sys.stdout``/``sys.stderr`` (one cell runs at a time on a rank, so the
    process-wide redirection cannot silence someone else's output).
    """

    def __init__(self, streams: tuple[str, ...], keep: Callable[[InstanceInfo], bool]) -> None:
        self._streams = streams
        self._keep = keep
        self._stack: list[contextlib.ExitStack] = []

    def __enter__(self) -> _OutputControl:
        stack = contextlib.ExitStack()
        if not self._keep(instance_info()):
            for name in self._streams:
                redirect = (
                    contextlib.redirect_stdout if name == "stdout" else contextlib.redirect_stderr
                )
                stack.enter_context(redirect(io.StringIO()))
        self._stack.append(stack)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.pop().close()


def _predicate(
    only: Literal["head", "all"] | Callable[[InstanceInfo], bool],
) -> Callable[[InstanceInfo], bool]:
    if only == "head":
        return lambda info: info.is_head
    if only == "all":
        return lambda info: True
    if callable(only):
        return only
    raise ValueError(f"only= must be 'head', 'all' or a function of InstanceInfo, got {only!r}")


def stdout(
    only: Literal["head", "all"] | Callable[[InstanceInfo], bool] = "head",
) -> _OutputControl:
    """Keep stdout only where ``only`` holds: ``"head"``, ``"all"`` or ``lambda info: ...``."""
    return _OutputControl(("stdout",), _predicate(only))


def stderr(
    only: Literal["head", "all"] | Callable[[InstanceInfo], bool] = "head",
) -> _OutputControl:
    """Keep stderr only where ``only`` holds."""
    return _OutputControl(("stderr",), _predicate(only))


@overload
def silent(fn: F, /) -> F: ...
@overload
def silent(fn: None = None, /) -> _OutputControl: ...
def silent(fn: F | None = None, /) -> F | _OutputControl:
    """Silence stdout and stderr on every rank: ``with silent():``, ``@silent`` or ``@silent()``."""
    control = _OutputControl(("stdout", "stderr"), lambda info: False)
    if fn is None:
        return control
    return functools.wraps(fn)(control(fn))  # type: ignore[return-value]

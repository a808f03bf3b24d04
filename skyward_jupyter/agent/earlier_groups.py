"""Objects in a rank's namespace built on a process group that the pool has since formed again.

When a cell fails, is interrupted or times out while ranks wait in a collective, the pool frees
them by closing the group's connections, and forms a new group before the next cell (see
``failure_policy``). torch cannot move an object to another group: a DDP model's reducer, an
FSDP2 module and a ``new_group`` group keep the ProcessGroup they were built on, whose
connections are closed. Their next use would fail with a peer's "Connection closed".

So as the group forms again, each rank looks at its namespace's globals. A DDP model built on
the default group is wrapped again in place on the new one, with the arguments it was built
with, as ``model = DDP(model.module, ...)`` would (rank 0's parameters are broadcast, as DDP
does): the ranks first agree on which, since each wrap runs collectives. A ``DeviceMesh`` over
the whole world names the default group, and the new group takes the same name: it goes on
working. The rest (an FSDP module, a ``new_group`` group, a DDP model with a communication hook
or on another group) is named to the notebook, and its next use fails at once, on every rank
alike, in one line saying how to build it again.
"""

from __future__ import annotations

import functools
import inspect
import weakref
from collections.abc import Callable
from typing import Any

_BUILT_WITH = "_skyward_built_with"
"""The attribute holding a DDP model's constructor arguments (None: it cannot be wrapped again)."""


class StaleGroupError(RuntimeError):
    """An object built on a process group that the pool has since formed again."""


class EarlierGroups:
    """The groups of the pool's last formation, and the guards on what was built on them."""

    def __init__(self) -> None:
        self._stale: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
        """Groups that are gone, each with the line their next use raises."""
        self._guarded: dict[int, weakref.ref[Any]] = {}
        """Objects guarded already, by identity (equal meshes are different objects)."""

    def install(self) -> None:
        """Make every collective of ``torch.distributed`` refuse a group that is gone.

        They all ask ``_rank_not_in_group(group)`` before anything else (torch 2.13, which this
        project pins); the agent's own calls go through the same function.
        """
        from torch.distributed import distributed_c10d as c10d

        original: Callable[[Any], bool] = c10d._rank_not_in_group

        def rank_not_in_group(group: Any) -> bool:
            if isinstance(group, c10d.ProcessGroup):
                why = self._stale.get(group)
                if why is not None:
                    raise StaleGroupError(why)
            return original(group)

        c10d._rank_not_in_group = rank_not_in_group
        _record_ddp_arguments()

    @staticmethod
    def now() -> list[Any]:
        """The groups torch has now (the default one first), to be given to :meth:`guard` once
        they are replaced.
        """
        from torch.distributed import distributed_c10d as c10d

        return list(c10d._world.pg_map)

    def guard(
        self, names: dict[str, Any], earlier: list[Any], after: str, agree: bool
    ) -> tuple[list[str], list[str]]:
        """The pool's group was formed again ``after`` (" after cell 3", or ""): wrap the DDP
        models in ``names`` again on it, and make the other objects built on the ``earlier``
        groups fail at their next use. Returns both, as ``name (kind)``. ``agree``: every rank
        calls this (each must, even one with nothing to wrap: a restarted rank).
        """
        self._guarded = {k: ref for k, ref in self._guarded.items() if ref() is not None}
        rewrapped = _wrap_again(names, earlier, agree)
        if not earlier:
            return rewrapped, []
        from torch.distributed import distributed_c10d as c10d

        gone = f"which the pool formed again{after}"
        for group in earlier:
            self._stale.setdefault(
                group,
                f"a process group created before the pool formed its group again{after} was "
                "used; create it again, and what was built on it",
            )
        old_default, new_default = earlier[0], c10d._world.default_pg
        found = []
        for name, value in list(names.items()):
            seen = self._guarded.get(id(value))
            if name.startswith("_") or (seen is not None and seen() is value):
                continue
            if f"{name} (DDP)" in rewrapped:
                continue
            kind, fix = _kind(value, name, earlier, old_default, new_default)
            if kind is None:
                continue
            why = f"{name} was built on the pool's earlier process group, {gone}; build it again: "
            why += fix
            if kind == "process group":
                self._stale[value] = why
            elif kind == "DeviceMesh":
                _refuse_mesh(value, why)
            else:
                value.register_forward_pre_hook(_refusal(why), prepend=True)
            self._guarded[id(value)] = weakref.ref(value)
            found.append(f"{name} ({kind})")
        return rewrapped, found


def _record_ddp_arguments() -> None:
    """Keep each DDP model's constructor arguments, to wrap it again on a new group; a model
    given a communication hook is not wrapped again (the hook's state may hold the old group).
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    init = DDP.__init__
    signature = inspect.signature(init)

    @functools.wraps(init)
    def recording_init(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        given = signature.bind(self, *args, **kwargs).arguments
        # Without the group (the model is wrapped again on its default group only), which would
        # also stop the model from pickling; a model on a mesh is not wrapped again.
        built_with: dict[str, Any] | None = {
            k: v for k, v in given.items() if k not in ("self", "module", "process_group")
        }
        if given.get("device_mesh") is not None:
            built_with = None
        object.__setattr__(self, _BUILT_WITH, built_with)

    DDP.__init__ = recording_init  # type: ignore[method-assign]
    for name in ("register_comm_hook", "_register_builtin_comm_hook"):
        method = getattr(DDP, name)

        @functools.wraps(method)
        def hooked(self: Any, *args: Any, _method: Any = method, **kwargs: Any) -> Any:
            object.__setattr__(self, _BUILT_WITH, None)
            return _method(self, *args, **kwargs)

        setattr(DDP, name, hooked)


def _wrap_again(names: dict[str, Any], earlier: list[Any], agree: bool) -> list[str]:
    """Wrap the DDP models of ``names`` built on the earlier default group again, on the new
    one, in the same order on every rank; return them as ``name (DDP)``.
    """
    from torch import distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    mine = sorted(
        name
        for name, value in names.items()
        if type(value) is DDP
        and earlier
        and value.process_group is earlier[0]
        and getattr(value, _BUILT_WITH, None) is not None
    )
    if not agree:
        return []
    everyone: list[list[str]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(everyone, mine)
    wrapped = []
    for name in mine:
        if not all(name in theirs for theirs in everyone):
            continue  # a rank lost it (restarted): nobody wraps it, all refuse it
        model = names[name]
        module, training = model.module, model.training
        built_with = dict(getattr(model, _BUILT_WITH))
        built_with["static_graph"] = built_with.get("static_graph", False) or model.static_graph
        try:
            DDP.__init__(model, module, **built_with)
        except (RuntimeError, ValueError):
            continue  # as on every rank (its checks are collective): refused like the rest
        model.train(training)
        wrapped.append(f"{name} (DDP)")
    return wrapped


def _kind(
    value: Any, name: str, earlier: list[Any], old_default: Any, new_default: Any
) -> tuple[str | None, str]:
    """What ``value`` is, when it was built on an ``earlier`` group, and how to build it again."""
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(value, DistributedDataParallel):
        return "DDP", f"{name} = DDP({name}.module, ...) as it was built, its hook too"
    if isinstance(value, nn.Module):
        for module in value.modules():
            if isinstance(module, (FSDPModule, FullyShardedDataParallel)):
                return "FSDP", "run the code that created and sharded it again"
            if isinstance(module, DistributedDataParallel):
                return "holds a DDP module", "run the code that built it again"
        return None, ""
    if isinstance(value, dist.ProcessGroup):
        if any(value is group for group in earlier):
            return "process group", f"{name} = dist.new_group(...) as before"
        return None, ""
    if isinstance(value, DeviceMesh):
        names = getattr(value, "_dim_group_names", [])
        if all(n == old_default.group_name == new_default.group_name for n in names):
            # Its groups are looked up by name: the new default group answers for it.
            registry = getattr(value, "_pg_registry", {})
            for n in list(registry):
                registry[n] = new_default
            return None, ""
        return "DeviceMesh", f"{name} = init_device_mesh(...) as before"
    return None, ""


def _refusal(why: str) -> Callable[..., None]:
    def refuse(module: Any, args: Any) -> None:
        raise StaleGroupError(why)

    return refuse


def _refuse_mesh(mesh: Any, why: str) -> None:
    """A mesh's groups are found by name, which a later group may take: its lookups refuse."""

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise StaleGroupError(why)

    mesh.__class__ = type(
        type(mesh).__name__,
        (type(mesh),),
        {"get_group": refuse, "get_all_groups": refuse, "__getitem__": refuse},
    )

"""Objects in a rank's namespace built on a process group that the pool has since formed again.

When a cell fails, is interrupted or times out while ranks wait in a collective, the pool frees
them by closing the group's connections, and forms a new group before the next cell (see
``failure_policy``). torch cannot move an object to another group: a DDP model's reducer and an
FSDP2 module keep the ProcessGroup they were built on, whose connections are closed, and a
``new_group`` group leaves torch's registry with the default group (its own connections may
still answer, out of step with the peers'). Their next use would fail with a peer's "Connection
closed", or hang.

So as the group forms again, each rank finds such objects among its namespace's globals, tells
the notebook their names, and makes their next use fail at once, on every rank alike, in one
line saying how to build them again. A ``DeviceMesh`` over the whole world names the default
group, and the new group takes the same name: such a mesh goes on working on the new group.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any


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
        project pins); the agent's own calls go through the same function."""
        from torch.distributed import distributed_c10d as c10d

        original: Callable[[Any], bool] = c10d._rank_not_in_group

        def rank_not_in_group(group: Any) -> bool:
            if isinstance(group, c10d.ProcessGroup):
                why = self._stale.get(group)
                if why is not None:
                    raise StaleGroupError(why)
            return original(group)

        c10d._rank_not_in_group = rank_not_in_group

    @staticmethod
    def now() -> list[Any]:
        """The groups torch has now (the default one first), to be given to :meth:`guard` once
        they are replaced."""
        from torch.distributed import distributed_c10d as c10d

        return list(c10d._world.pg_map)

    def guard(self, names: dict[str, Any], earlier: list[Any], after: str) -> list[str]:
        """The pool's group was formed again ``after`` (" after cell 3", or ""): make the objects
        in ``names`` built on the ``earlier`` groups fail at their next use; return them as
        ``name (kind)``."""
        self._guarded = {k: ref for k, ref in self._guarded.items() if ref() is not None}
        if not earlier:
            return []
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
        return found


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
        return "DDP", f"{name} = DDP({name}.module), with the arguments it had"
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

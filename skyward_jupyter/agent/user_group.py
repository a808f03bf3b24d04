"""A script's own ``init_process_group`` and ``destroy_process_group`` on a rank of a pool.

Every torchrun script starts with ``init_process_group()`` and many end with
``destroy_process_group()``. On a pool the group is already up when the code runs, so torch
would refuse the first call ("trying to initialize the default process group twice") and the
second would leave the warm pool without a group. The public functions of
``torch.distributed`` are therefore replaced on the rank:

- ``init_process_group`` while the pool's group is up checks that what the script asks for
  (backend, rank, world size) is what the pool has, and returns: the script uses the pool's
  group. A difference is an error naming it. After the script destroyed the group in the same
  cell, the call forms a new group over the pool's store, as the script expects.
- ``destroy_process_group`` is honoured; the cell reports it, and the pool re-forms its group
  before the next cell. The destroyed group object is kept alive until then (see
  :meth:`ProcessGroup.retire`).

Only the names in ``torch.distributed`` are replaced (what scripts and libraries call);
``torch.distributed.distributed_c10d`` keeps the originals, which the agent itself uses.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any

from .torch_setup import ProcessGroup


class UserGroupCalls:
    def __init__(self, group: ProcessGroup, note: Callable[[str], None]) -> None:
        self._group = group
        self._note = note
        self._noted = False
        self._reinits = 0
        self.destroyed = False
        """The user's code destroyed the default group since the last :meth:`reset`."""

    def install(self) -> None:
        import torch.distributed as dist

        dist.init_process_group = self.init_process_group  # type: ignore[assignment]
        dist.destroy_process_group = self.destroy_process_group

    def reset(self) -> None:
        """A new cell: the pool's group is whole again."""
        self.destroyed = False

    def init_process_group(
        self,
        backend: Any = None,
        init_method: str | None = None,
        timeout: datetime.timedelta | None = None,
        world_size: int = -1,
        rank: int = -1,
        store: Any = None,
        group_name: str = "",
        pg_options: Any = None,
        device_id: Any = None,
        **kwargs: Any,
    ) -> None:
        """Use the pool's group when the script asks for the same world; otherwise say why not."""
        from torch.distributed import distributed_c10d as c10d

        s = self._group.settings
        pool_backend = self._group.backend or "gloo"
        if backend is not None:
            asked = {part.split(":")[-1].strip().lower() for part in str(backend).split(",")}
            if pool_backend not in asked:
                import torch

                hint = "" if torch.cuda.is_available() else " (the ranks have no GPU)"
                other = {"gloo", "nccl"} & asked
                start = f", or start the pool with --backend {min(other)}" if other else ""
                raise ValueError(
                    f"init_process_group(backend={str(backend)!r}): this pool's process group "
                    f"uses {pool_backend!r}{hint}; call init_process_group() without a backend"
                    + start
                )
        if rank not in (-1, s.rank):
            raise ValueError(
                f"init_process_group(rank={rank}): this process is rank {s.rank} of the pool's "
                "group; leave rank out or pass int(os.environ['RANK'])"
            )
        if world_size not in (-1, s.world_size):
            raise ValueError(
                f"init_process_group(world_size={world_size}): the pool's group has "
                f"{s.world_size} rank{'s' * (s.world_size != 1)}; leave world_size out or pass "
                "int(os.environ['WORLD_SIZE'])"
            )
        if c10d.is_initialized():
            if not self._noted:
                self._noted = True
                self._note(
                    f"init_process_group() uses the pool's process group "
                    f"({pool_backend}, {s.world_size} rank{'s' * (s.world_size != 1)})"
                )
            return
        if not self.destroyed or self._group.store is None:
            raise RuntimeError("the pool's process group is not up on this rank; run %sky restart")
        # The script destroyed the group earlier in this cell and asks for a new one: form it
        # over the pool's store, under a prefix of its own, as every rank does in step.
        self._reinits += 1
        self._group.rejoin(
            f"user-{self._reinits}",
            str(backend or pool_backend),
            timeout or datetime.timedelta(seconds=s.timeout),
            device_id=device_id,
        )

    def destroy_process_group(self, group: Any = None) -> None:
        """Honoured; the pool re-forms its group before the next cell."""
        from torch.distributed import distributed_c10d as c10d

        world = c10d.GroupMember.WORLD
        if group is None or group is world:
            self.destroyed = True
            if world is not None:
                self._group.retire(world)
        c10d.destroy_process_group(group)

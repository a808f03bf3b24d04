"""The distributed worlds a rank belongs to: torch's process group and JAX's, as the pool asks.

Which frameworks a rank sets up is the pool's ``--framework`` (torch by default, when it is
installed). A formation is one :class:`~skyward_jupyter.protocol.FormGroup`: the head first
starts what the others connect to (torch's store, JAX's coordinator port) and says where, then
every rank joins torch's group, then JAX's, in that order everywhere, so nobody waits for a
peer that is still in the other one.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

from .. import protocol as p
from .earlier_groups import EarlierGroups
from .jax_setup import JaxWorld, jax_version, keras_conflict
from .torch_setup import (
    FORM_TIMEOUT,
    GroupError,
    GroupSettings,
    ProcessGroup,
    cuda_device_count,
    nccl_available,
    rank_device,
    torch_version,
)
from .user_group import UserGroupCalls


def _accelerators(node: int) -> int:
    """GPUs on this rank's node, as the pool's description (``SKYWARD_POOL``) gives them."""
    pool = json.loads(os.environ.get("SKYWARD_POOL", "{}"))
    return next((int(n["accelerators"]) for n in pool.get("nodes", ()) if n["node"] == node), 0)


class Worlds:
    def __init__(
        self,
        settings: GroupSettings,
        frameworks: tuple[str, ...] | None,
        keras_backend: str | None,
        note: Callable[[str], None],
        diagnose: Callable[[str], None] | None = None,
    ) -> None:
        self.wanted = frameworks
        """The frameworks to set up; None: torch when it is installed."""
        self.keras_backend = keras_backend
        self.group = ProcessGroup(settings, diagnose)
        self.user_calls = UserGroupCalls(self.group, note)
        self.earlier = EarlierGroups()
        self._left: list[Any] = []
        """The groups left since the last formation, the default one first."""
        self._kept: list[Any] = []
        """Those of the formation before, kept until the next."""
        node = int(os.environ.get("GROUP_RANK", "0"))
        self.jax = JaxWorld(
            settings.rank,
            settings.world_size,
            settings.local_rank,
            int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
            _accelerators(node),
            settings.master_addr,
            note,
        )
        self.torch: str | None = None
        self.jax_version: str | None = None
        self.problem: str | None = None
        """What stops this rank from serving the pool (the notebook shows it, naming the rank)."""

    @property
    def uses_torch(self) -> bool:
        return self.torch is not None and (self.wanted is None or "torch" in self.wanted)

    def prepare(self) -> None:
        """Import the frameworks (the slow part of a start); note what stops this rank."""
        self.torch = torch_version()
        if self.uses_torch:
            self.user_calls.install()
            self.earlier.install()
            self.group.track_user_groups()
            # A rank forked from the warm template imported torch before this variable was
            # set: apply it, as the OpenMP runtime of a freshly started process would.
            threads = os.environ.get("OMP_NUM_THREADS", "")
            if threads.isdigit() and int(threads) > 0:
                import torch

                torch.set_num_threads(int(threads))
        if self.wanted is not None and "jax" in self.wanted:
            self.jax_version = jax_version()
            if self.jax_version is not None:
                self.jax.install()
        self.problem = keras_conflict(self.keras_backend)

    def ready_names(self) -> dict[str, Any]:
        """The names every cell finds bound (the README's "What a cell gets"): ``device`` only
        where the rank sets up torch.
        """
        s = self.group.settings
        names: dict[str, Any] = {
            "rank": s.rank,
            "local_rank": s.local_rank,
            "world_size": s.world_size,
        }
        if self.uses_torch:
            names["device"] = rank_device(s.local_rank)
        return names

    def cuda_devices(self) -> int:
        return cuda_device_count() if self.torch else 0

    def nccl(self) -> bool | None:
        return nccl_available() if self.torch else None

    def form(
        self,
        command: p.FormGroup,
        send: Callable[[object], None],
        names: dict[str, Any],
        after: str,
    ) -> None:
        """Join the pool's worlds; the head first says where the others connect.

        What ``names`` (the namespace) built on the earlier group is refused from now on, and
        named to the notebook; ``after`` says when the group was formed again (" after cell 3").
        """
        os.environ["TORCHELASTIC_RESTART_COUNT"] = str(command.restarts)
        rewrapped: list[str] = []
        stale: list[str] = []
        try:
            backend = None
            if self.uses_torch:
                self._leave_torch()
            port, jax_port = command.port, command.jax_port
            if port is None and jax_port is None:
                port = self.group.host(command.secret) if self.uses_torch else None
                jax_port = self.jax.host() if command.jax else None
                send(p.GroupPort(command.generation, port, jax_port))
            if self.uses_torch and port is not None:
                backend = self.group.join(port, command.secret)
                rewrapped, stale = self.earlier.guard(
                    names, self._left, after, agree=command.generation > 1
                )
                # Dropped at the next formation, not now (see ProcessGroup.retire).
                self._kept, self._left = self._left, []
            if command.jax and jax_port is not None:
                self.jax.join(jax_port, FORM_TIMEOUT)
                if self.keras_backend == "jax":
                    self.jax.start_keras()
        except GroupError as exc:
            send(p.GroupState(command.generation, False, None, str(exc)))
            return
        except Exception as exc:  # noqa: BLE001 - reported to the notebook with its type
            send(p.GroupState(command.generation, False, None, f"{type(exc).__name__}: {exc}"))
            return
        send(
            p.GroupState(command.generation, True, backend, "ready", tuple(stale), tuple(rewrapped))
        )

    def leave(self) -> None:
        """Leave torch's group (JAX's world ends with the process)."""
        if self.uses_torch:
            self._leave_torch()

    def _leave_torch(self) -> None:
        """Leave torch's groups, remembering them: the next formation guards what was built on
        them (see :mod:`.earlier_groups`).
        """
        self._left += self.earlier.now() or list(self.group.retired)
        self.group.leave()

    def tick(self) -> None:
        """The watchdog's tick: lower gloo's threads of groups the user's code formed."""
        if self.uses_torch:
            self.group.lower_gloo_loops()

    def collectives(self) -> tuple[tuple[str, int], ...] | None:
        """Each of torch's groups by name, with the collectives this rank called in it (None:
        a backend that does not count them).
        """
        if not self.uses_torch:
            return ()
        from torch.distributed import distributed_c10d as c10d

        try:
            # (bound at runtime, missing from torch's stubs)
            return tuple(
                (pg.group_name, pg._get_sequence_number_for_group())  # type: ignore[attr-defined]
                for pg in c10d._world.pg_map
            )
        except RuntimeError:
            return None

    def destroyed(self) -> bool:
        """The cell's code destroyed torch's group: the pool forms it again."""
        return self.uses_torch and (self.user_calls.destroyed or self.group.gone())

"""JAX's distributed runtime on a rank: ``jax.distributed`` initialised before the first cell.

The head runs JAX's coordination service on the head's pool address and a port it found free
(not on every interface); then every rank calls ``jax.distributed.initialize`` with the pool's
world, so ``jax.process_count()`` is the world size and ``jax.devices()`` lists every rank's
devices, on CPU pools too (JAX's gloo CPU collectives). The seeds' variables
(``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``,
``JAX_LOCAL_DEVICE_COUNT``) are set as a JAX plugin sets them.

JAX allows one initialisation per process, before its backend starts, so the world cannot be
formed again in a running process: a pool with JAX replaces every rank when one is lost. A
script's own ``jax.distributed.initialize()`` therefore finds the pool's world (agreeing
arguments return; others are an error naming the difference), and its
``jax.distributed.shutdown()`` is left to the pool, which ends the world with the ranks.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Callable
from typing import Any

from .torch_setup import GroupError

SHUTDOWN_TIMEOUT = 10
"""Seconds a rank's exit waits for its peers to leave JAX's world (JAX's default is 300: a pool
closing around a lost peer would wait that long)."""


def jax_version() -> str | None:
    """Import jax now (the slow part of joining); None when it is not installed."""
    try:
        import jax
    except ImportError:
        return None
    return str(jax.__version__)


def keras_conflict(wanted: str | None) -> str | None:
    """Why Keras cannot have the backend ``wanted`` in this process (it was imported already,
    with another: Keras reads its backend once, at import); None when it can.
    """
    keras = sys.modules.get("keras")
    if wanted is None or keras is None:
        return None
    try:
        have = str(keras.backend.backend())
    except AttributeError:
        return None  # still being imported by the code that asked: it read the variable
    if have == wanted:
        return None
    return (
        f"keras was imported with the {have!r} backend before the pool could set "
        f"KERAS_BACKEND={wanted} (by sitecustomize, a .pth file or PYTHONSTARTUP on this "
        "rank); Keras reads its backend once: remove that import, or start the pool with "
        f"--keras-backend {have}"
    )


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class JaxWorld:
    """This rank's place in JAX's distributed world."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        local_rank: int,
        local_world: int,
        accelerators: int,
        master_addr: str,
        note: Callable[[str], None],
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.local_rank = local_rank
        self.local_world = local_world
        self.accelerators = accelerators
        self.master_addr = master_addr
        self._note = note
        self._noted: set[str] = set()
        self._quiet = False
        self.initialized = False

    def host(self) -> int:
        """A free port on the head's pool address for the coordination service."""
        with socket.create_server((self.master_addr, 0)) as listener:
            return int(listener.getsockname()[1])

    def join(self, port: int, timeout: float) -> None:
        """Initialise ``jax.distributed`` with the pool's world (the head also serves it)."""
        import jax

        if self.initialized:
            raise GroupError("JAX's world cannot be formed again in a running process")
        coordinator = _address(self.master_addr, port)
        # One GPU per rank when a node runs one rank per GPU; every GPU when it runs one rank.
        split = self.accelerators > 0 and self.local_world > 1
        devices = [self.local_rank % self.accelerators] if split else None
        os.environ.update(
            {
                "JAX_COORDINATOR_ADDRESS": coordinator,
                "JAX_NUM_PROCESSES": str(self.world_size),
                "JAX_PROCESS_ID": str(self.rank),
                # What `keras.distribution.initialize()` reads, as a Keras launch script sets it
                "KERAS_DISTRIBUTION_JOB_ADDRESSES": coordinator,
                "KERAS_DISTRIBUTION_NUM_PROCESSES": str(self.world_size),
                "KERAS_DISTRIBUTION_PROCESS_ID": str(self.rank),
            }
        )
        try:
            # jax._src's own function: the one in jax.distributed is the user's (see install)
            from jax._src import distributed

            distributed.initialize(
                coordinator_address=coordinator,
                num_processes=self.world_size,
                process_id=self.rank,
                local_device_ids=devices,
                initialization_timeout=max(1, int(timeout)),
                coordinator_bind_address=coordinator if self.rank == 0 else None,
                shutdown_timeout_seconds=SHUTDOWN_TIMEOUT,
            )
        except Exception as exc:  # JAX raises several types; each is said for people
            last = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
            raise GroupError(
                f"JAX's world did not form with the coordinator at {coordinator}: {last}; "
                "if the head has an address these hosts reach, name it with the provider's "
                "option for the head's address (see %%sky?)"
            ) from exc
        self.initialized = True
        os.environ["JAX_LOCAL_DEVICE_COUNT"] = str(len(jax.local_devices()))

    def start_keras(self) -> None:
        """Import Keras (on JAX) and agree on its random seed across the world, as
        ``keras.distribution.initialize()`` does: otherwise each rank initialises its weights
        from a seed of its own, and JAX refuses a replicated variable that differs.
        """
        self._quiet = True  # Keras calls initialize() here; the user did not
        try:
            import keras

            keras.distribution.initialize()
        finally:
            self._quiet = False

    def install(self) -> None:
        """Route the user's ``jax.distributed`` calls to the pool's world (see the module)."""
        import jax

        jax.distributed.initialize = self.initialize
        jax.distributed.shutdown = self.shutdown

    def _say_once(self, text: str) -> None:
        if not self._quiet and text not in self._noted:
            self._noted.add(text)
            self._note(text)

    def initialize(
        self,
        coordinator_address: str | None = None,
        num_processes: int | None = None,
        process_id: int | None = None,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        """The user's ``jax.distributed.initialize``: the pool's world, when it agrees."""
        if num_processes not in (None, self.world_size):
            raise ValueError(
                f"jax.distributed.initialize(num_processes={num_processes}): the pool's JAX "
                f"world has {self.world_size} process{'es' * (self.world_size != 1)}; leave "
                "num_processes out"
            )
        if process_id not in (None, self.rank):
            raise ValueError(
                f"jax.distributed.initialize(process_id={process_id}): this process is "
                f"{self.rank} in the pool's JAX world; leave process_id out"
            )
        self._say_once(
            "jax.distributed.initialize() uses the pool's JAX world "
            f"({self.world_size} process{'es' * (self.world_size != 1)})"
        )

    def shutdown(self) -> None:
        """The user's ``jax.distributed.shutdown``: the world stays up for the next cell."""
        self._say_once("jax.distributed.shutdown() is left to the pool: its JAX world stays up")

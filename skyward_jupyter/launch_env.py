"""The environment a rank gets: what torchrun (and ``accelerate launch``) would give a worker.

Libraries find out that they run in a launched world by reading the launcher's variables:
Lightning looks for ``TORCHELASTIC_RUN_ID`` with ``GROUP_RANK``, Accelerate and the Hugging Face
Trainer read ``LOCAL_RANK`` and ``ACCELERATE_USE_CPU``, torch's ``env://`` rendezvous reads the
master address and ``TORCHELASTIC_USE_AGENT_STORE``. A pool gives every rank the same names with
the same meanings as ``torchrun --nnodes NODES --nproc-per-node RANKS_PER_NODE`` would, so code
written for torchrun runs as written. What the user sets with ``--env`` (or had in the notebook's
environment, for the thread count) wins, except for each rank's place and the rendezvous
(:data:`POOL_SETS`), which only the pool can set.

Three values are set on the rank itself: ``MASTER_PORT`` (the store's port, fresh for each
formation of the group), ``TORCHELASTIC_RESTART_COUNT`` (how often the group was formed again
after a failure; not after a script's own ``destroy_process_group``) and
``TORCHELASTIC_ERROR_FILE`` (a file in the rank's private directory, for torch's ``@record``).

Those are the cells' values: the pool is one long launch, its group restarted after failures. A
script run (``%sky run``) is a launch of its own, as each torchrun is: :func:`launched` gives it
its own run id, a restart count of 0 and its own error file, and puts the cells' back after it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

FLIGHT_RECORDER_ENTRIES = "2000"
"""``TORCH_FR_BUFFER_SIZE`` on GPU ranks unless the notebook set it: NCCL's flight recorder keeps
this many of the rank's last collectives for the hang doctor."""


@dataclass(frozen=True, slots=True)
class RankPlace:
    """Where one rank sits in the pool."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node: int
    nodes: int
    ranks_on_machine: int
    """Ranks sharing this rank's machine (a local pool simulates nodes on one machine)."""
    has_gpu: bool


POOL_SETS = frozenset(
    {
        "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
        "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR",
        "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE",
    }
)  # fmt: skip
"""What only the pool can set: each rank's place and the group's rendezvous. A value given
with ``--env`` would put every rank in the wrong place, or send them to a store no one runs,
and the start would wait for a group that never forms."""


def check_user_env(names: Iterable[str]) -> None:
    """Refuse a variable of :data:`POOL_SETS` among ``names`` (``--env``), in one line."""
    for name in names:
        if name in POOL_SETS:
            raise ValueError(
                f"--env {name}: the pool sets {name} on each rank itself (its place in the "
                "world and the group's rendezvous, as torchrun does); leave it out"
            )


def launcher_env(
    place: RankPlace,
    *,
    master_addr: str,
    run_id: str,
    user_env: Mapping[str, str],
    notebook_env: Mapping[str, str],
) -> dict[str, str]:
    """torchrun's worker variables for ``place``, plus the pool's own ``NODE_RANK``."""
    env = {
        "RANK": str(place.rank),
        "WORLD_SIZE": str(place.world_size),
        "LOCAL_RANK": str(place.local_rank),
        "LOCAL_WORLD_SIZE": str(place.local_world_size),
        "GROUP_RANK": str(place.node),
        "GROUP_WORLD_SIZE": str(place.nodes),
        "ROLE_RANK": str(place.rank),
        "ROLE_WORLD_SIZE": str(place.world_size),
        "ROLE_NAME": "default",
        "NODE_RANK": str(place.node),
        "MASTER_ADDR": master_addr,
        "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_RESTART_COUNT": "0",
        # torchrun's default: it never restarts workers itself (the pool restarts lost ranks).
        "TORCHELASTIC_MAX_RESTARTS": "0",
        # The store at MASTER_ADDR:MASTER_PORT is hosted by the head's agent, not by each worker.
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": notebook_env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
        # What `accelerate launch` says about the machine: Accelerate and the HF Trainer
        # distribute over CPU processes only when told so.
        "ACCELERATE_USE_CPU": str(not place.has_gpu),
    }
    # NCCL's flight recorder, read by the hang doctor (``%sky stacks``, desyncs): NCCL
    # collectives return at once, so only it knows which ones a rank still waits for. Not on
    # ranks without a GPU (gloo): there the doctor reads the cell's stack, and the recorder would
    # capture a Python stack at every collective of the training loop, as torchrun's workers
    # never do.
    recorder = notebook_env.get(
        "TORCH_FR_BUFFER_SIZE", FLIGHT_RECORDER_ENTRIES if place.has_gpu else None
    )
    if recorder is not None:
        env["TORCH_FR_BUFFER_SIZE"] = recorder
    # torchrun: one OpenMP thread per worker when several share a machine, unless the user chose.
    threads = notebook_env.get("OMP_NUM_THREADS")
    if threads is None and place.ranks_on_machine > 1:
        threads = "1"
    if threads is not None:
        env["OMP_NUM_THREADS"] = threads
    return {**env, **user_env}


def error_file(private_dir: str) -> str:
    """Where torch's ``@record`` writes a worker's error (``TORCHELASTIC_ERROR_FILE``).

    The file is made now, empty and mode 0600, in ``private_dir`` (the rank's own, mode 0700,
    removed when the rank ends): torch's ``open(path, "w")`` keeps that mode, so a traceback,
    which may quote secrets, is readable by this user alone, and nothing is left behind.
    """
    path = os.path.join(private_dir, "error.json")
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    return path


@contextlib.contextmanager
def launched(run_id: str | None, private_dir: str | None) -> Iterator[None]:
    """A script run's launch: ``TORCHELASTIC_RUN_ID`` is ``run_id``, ``TORCHELASTIC_RESTART_COUNT``
    0 (the pool never restarts a run) and, where the rank has a private directory (the user did
    not choose the file), ``TORCHELASTIC_ERROR_FILE`` a file of the run's own in it, kept when
    ``@record`` wrote it (it goes with the rank), removed when empty. ``run_id`` None: a cell,
    nothing changes.
    """
    if run_id is None:
        yield
        return
    names = ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_ERROR_FILE")
    saved = {name: os.environ.get(name) for name in names}
    os.environ.update(TORCHELASTIC_RUN_ID=run_id, TORCHELASTIC_RESTART_COUNT="0")
    run_dir = None
    if private_dir is not None:  # named as torchrun names its run's: the id --env chose may recur
        run_dir = tempfile.mkdtemp(prefix=f"{run_id.replace(os.sep, '_')}_", dir=private_dir)
        os.environ["TORCHELASTIC_ERROR_FILE"] = error_file(run_dir)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        if run_dir is not None and not _recorded(os.path.join(run_dir, "error.json")):
            shutil.rmtree(run_dir, ignore_errors=True)


def _recorded(path: str) -> bool:
    """Whether ``@record`` wrote the error file at ``path``."""
    try:
        return os.path.getsize(path) > 0
    except OSError:  # the run removed it
        return False

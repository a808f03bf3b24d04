"""Multi-node PyTorch training as a notebook cell.

``%load_ext skyward_jupyter`` then ``%%sky --nodes 2`` runs a cell on every rank of a warm pool
with ``torch.distributed`` initialised. The same runtime API works on the ranks and here.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .pool import Pool, RankInfo
    from .results import CellError, PoolError, RankResult, RemoteError, RunResult
    from .runtime import InstanceInfo, Peer, instance_info, log, shard, silent, stderr, stdout

_HOMES = {
    **dict.fromkeys(("Pool", "RankInfo"), "pool"),
    **dict.fromkeys(
        ("CellError", "PoolError", "RankResult", "RemoteError", "RunResult"), "results"
    ),
    **dict.fromkeys(
        ("InstanceInfo", "Peer", "instance_info", "log", "shard", "silent", "stderr", "stdout"),
        "runtime",
    ),
}
"""Where each public name lives: imported on first use, so that a node's Python, which runs
``skyward_jupyter.agent`` with the standard library, torch and cloudpickle only, never imports
the notebook's side (its pool, SSH client, widgets)."""


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_HOMES[name]}", __name__), name)


__all__ = [
    "CellError",
    "InstanceInfo",
    "Peer",
    "Pool",
    "PoolError",
    "RankInfo",
    "RankResult",
    "RemoteError",
    "RunResult",
    "instance_info",
    "log",
    "shard",
    "silent",
    "stderr",
    "stdout",
]
__version__ = "0.1.0"


def _jupyter_server_extension_points() -> list[dict[str, str]]:
    """The Jupyter server extension of the lab's "Sky" panel (:mod:`skyward_jupyter.server`)."""
    return [{"module": "skyward_jupyter.server"}]


def _jupyter_labextension_paths() -> list[dict[str, str]]:
    """The prebuilt "Sky" side panel, for ``jupyter labextension develop`` (wheels ship it)."""
    return [{"src": "labextension", "dest": "skyward-jupyter"}]


def load_ipython_extension(ipython: object) -> None:
    """``%load_ext skyward_jupyter``: register ``%%sky``/``%sky`` and warm up the rank template."""
    from .extension import load

    load(ipython)


def unload_ipython_extension(ipython: object) -> None:
    from .extension import unload

    unload(ipython)

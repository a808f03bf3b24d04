"""Where a kernel's pools publish themselves for the Jupyter server (the lab's "Sky" panel).

One JSON record per pool in a private directory (:mod:`.files`), saying what the panel shows and
how to end the pool without its kernel (:mod:`.record`), kept up to date by the kernel's
:class:`Registry` (:mod:`.writer`). The server reads the records (:mod:`skyward_jupyter.server`),
asks a live owner to shut a pool down, and reaps a pool whose owner is dead from its record.
"""

from __future__ import annotations

from .files import (
    FORMAT,
    POOL_ID,
    RegistryError,
    check_dir,
    down_path,
    ensure_dir,
    live_teardowns,
    new_pool_id,
    read_record,
    read_records,
    record_path,
    registry_dir,
    remove_record,
    request_shutdown,
    shutdown_requested,
    write_record,
)
from .record import Owner
from .writer import Registry

__all__ = [
    "FORMAT",
    "POOL_ID",
    "Owner",
    "Registry",
    "RegistryError",
    "check_dir",
    "down_path",
    "ensure_dir",
    "live_teardowns",
    "new_pool_id",
    "read_record",
    "read_records",
    "record_path",
    "registry_dir",
    "remove_record",
    "request_shutdown",
    "shutdown_requested",
    "write_record",
]

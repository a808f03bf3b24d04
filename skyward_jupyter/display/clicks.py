"""Panel clicks while a cell runs: the buttons' comm messages routed to a kernel subshell.

A running cell blocks the kernel's main thread, and with it every message the frontend sends on
the shell channel, widget clicks included. ipykernel 7 (kernel subshells) can route a comm's
messages to another thread; without it (older kernels, terminal IPython) the buttons act when the
kernel is next idle.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Sequence

import ipywidgets as widgets  # type: ignore[import-untyped]

log = logging.getLogger(__name__)

_subshell: str | None = None
_subshell_lock = threading.Lock()


def _click_subshell() -> str | None:
    """The kernel subshell for the buttons' messages (one per kernel, made on first use)."""
    global _subshell
    with _subshell_lock:
        if _subshell is not None:
            return _subshell
        try:
            from ipykernel.kernelbase import Kernel

            if not Kernel.initialized():
                return None
            channel = Kernel.instance().shell_channel_thread
            create = channel.manager._create_subshell
            loop = channel.io_loop
        except (ImportError, AttributeError):
            return None
        made: concurrent.futures.Future[str] = concurrent.futures.Future()

        def make() -> None:
            try:
                made.set_result(create())
            except Exception as exc:  # noqa: BLE001 - handed to the waiting thread
                made.set_exception(exc)

        try:
            loop.add_callback(make)
            _subshell = made.result(timeout=10)
        except Exception:  # the buttons still work when the kernel is idle
            log.debug("no kernel subshell for the panel's buttons", exc_info=True)
            return None
        return _subshell


def route_clicks(buttons: Sequence[widgets.Button]) -> bool:
    """Have ``buttons``' clicks handled on the subshell; False where the kernel has none."""
    subshell = _click_subshell()
    if subshell is None:
        return False
    for button in buttons:
        comm = button.comm
        if comm is not None and hasattr(comm, "_reply_subshell_for"):
            comm._reply_subshell_for = lambda data, default, _s=subshell: _s
    return True

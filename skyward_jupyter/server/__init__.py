"""The Jupyter server extension behind the lab's "Sky" panel: REST routes under ``/skyward/``.

Enabled on install by ``etc/jupyter/jupyter_server_config.d/skyward_jupyter.json``; by hand:
``jupyter server extension enable skyward_jupyter``. It reads the pool registry
(:mod:`skyward_jupyter.registry`) that every kernel's session writes; see :mod:`.handlers`.
"""

from __future__ import annotations

from typing import Any


def _jupyter_server_extension_points() -> list[dict[str, str]]:
    return [{"module": "skyward_jupyter.server"}]


def _load_jupyter_server_extension(serverapp: Any) -> None:
    from ..registry import registry_dir
    from .handlers import setup_handlers

    directory = registry_dir()
    setup_handlers(serverapp.web_app, directory)
    serverapp.log.info("skyward_jupyter: pool routes under /skyward/, registry %s", directory)


load_jupyter_server_extension = _load_jupyter_server_extension  # the pre-2.0 name

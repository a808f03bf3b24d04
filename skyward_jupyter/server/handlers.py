"""REST routes of the "Sky" panel, under the server's authentication, authorization and XSRF.

``GET    /skyward/pools``            ``{"pools": [pool, ...], "now": epoch seconds}``
``GET    /skyward/pools/<id|name>``  one pool (a name shared by several pools: 409, with their ids)
``DELETE /skyward/pools/<id>``       shut the pool down:

- its owner process runs: ask it (``<id>.down`` beside the record; the kernel's registry thread
  shuts the pool down as the panel's button does, interrupting a running cell first), then wait
  up to ``?wait=`` seconds (default 30) for the record to go: 200 ``{"how": "kernel"}``, or 202
  ``{"how": "requested"}`` when it takes longer (the request stands);
- its owner is dead (or dies while we wait): reap it (:mod:`.reap`) and remove the record: 200
  ``{"how": "reaped", "killed": [...], "gone": [...], "spared": [...], "notes": [...]}``.

Pools are part of kernels: the routes authorize on the ``kernels`` resource (GET reads, DELETE
writes), so a user who may not touch kernels may not see or end pools either.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

from jupyter_server.auth.decorator import authorized
from jupyter_server.base.handlers import APIHandler
from jupyter_server.utils import url_path_join
from tornado import web

from .. import registry
from . import pools
from .reap import reap

DEFAULT_WAIT = 30.0
MAX_WAIT = 300.0


class _Base(APIHandler):
    auth_resource = "kernels"

    @property
    def directory(self) -> Path:
        return Path(self.settings["skyward_registry_dir"])

    def _kernel_ids(self) -> set[str]:
        return set(self.kernel_manager.list_kernel_ids())

    def _checked_dir(self) -> Path:
        directory = self.directory
        try:
            registry.check_dir(directory)
        except FileNotFoundError:
            pass  # no pool has registered yet
        except registry.RegistryError as exc:
            raise web.HTTPError(500, f"the pool registry is not safe to use: {exc}") from None
        return directory

    def _reply(self, body: dict[str, Any], status: int = 200) -> None:
        self.set_status(status)
        self.finish(json.dumps(body))


class PoolsHandler(_Base):
    @web.authenticated
    @authorized
    def get(self) -> None:
        now = time.time()
        found = pools.listing(self._checked_dir(), self._kernel_ids(), now)
        self._reply({"pools": found, "now": now})


class PoolHandler(_Base):
    @web.authenticated
    @authorized
    def get(self, key: str) -> None:
        found = pools.find(pools.listing(self._checked_dir(), self._kernel_ids()), key)
        if not found:
            raise web.HTTPError(404, f"no pool {key!r}")
        if len(found) > 1:
            ids = ", ".join(p["id"] for p in found)
            raise web.HTTPError(409, f"several pools are named {key!r} (ids {ids}); use an id")
        self._reply(found[0])

    @web.authenticated
    @authorized
    async def delete(self, key: str) -> None:
        directory = self._checked_dir()
        if not registry.POOL_ID.fullmatch(key):
            raise web.HTTPError(400, f"{key!r} is not a pool id (shutting down takes an id)")
        record = registry.read_record(directory, key)
        if record is None or not pools.concerns(record, self._kernel_ids()):
            raise web.HTTPError(404, f"no pool {key!r}")
        try:
            wait = min(MAX_WAIT, max(0.0, float(self.get_argument("wait", str(DEFAULT_WAIT)))))
        except ValueError:
            raise web.HTTPError(400, "wait: expected seconds") from None
        reply = {"id": key, "name": record.get("name")}
        if pools.owner_alive(record) is not False:
            registry.request_shutdown(directory, key)
            outcome = await self._wait_for_owner(directory, record, wait)
            if outcome == "ended":
                self._reply({**reply, "how": "kernel"})
                return
            if outcome == "pending":
                self._reply({**reply, "how": "requested"}, 202)
                return
            self.log.info("skyward: the owner of pool %s died while it was asked to shut down", key)
        report = await asyncio.to_thread(reap, record)
        registry.remove_record(directory, key)
        self.log.info("skyward: reaped orphaned pool %s: %s", key, report.as_dict())
        self._reply({**reply, "how": "reaped", **report.as_dict()})

    @staticmethod
    async def _wait_for_owner(directory: Path, record: dict[str, Any], wait: float) -> str:
        """``ended`` (the record went), ``dead`` (the owner died first) or ``pending``."""
        deadline = time.monotonic() + wait
        while True:
            if registry.read_record(directory, record["id"]) is None:
                return "ended"
            if pools.owner_alive(record) is False:
                return "dead"
            if time.monotonic() >= deadline:
                return "pending"
            await asyncio.sleep(0.1)


def setup_handlers(web_app: Any, directory: Path) -> None:
    base = url_path_join(web_app.settings["base_url"], "skyward", "pools")
    web_app.settings["skyward_registry_dir"] = str(directory)
    web_app.add_handlers(
        ".*$",
        [
            (base + "/?", PoolsHandler),
            (url_path_join(base, r"([^/]+)") + "/?", PoolHandler),
        ],
    )

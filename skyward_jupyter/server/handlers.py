"""REST routes of the "Sky" panel, under the server's authentication, authorization and XSRF.

``GET    /skyward/pools``            ``{"pools": [pool, ...], "now": epoch seconds, "stamp": digest,
                                     "states": the vocabulary of states (model.STATE_WORDS)}``
``GET    /skyward/stamp``            ``{"stamp": digest}``: the listing's digest alone, which
                                     changes when the listing does; the panel asks for it several
                                     times a second and for the listing when it changes
``DELETE /skyward/pools?gone=1``     clean every ``gone`` pool (its kernel or ranks ended) as
                                     DELETE of each does: ``{"cleaned": [reply, ...]}``
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
from functools import partial
from pathlib import Path
from typing import Any

from jupyter_server.auth.decorator import authorized
from jupyter_server.base.handlers import APIHandler
from jupyter_server.utils import url_path_join
from tornado import web

from .. import registry
from ..model import RECORD_GONE, state_words
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

    async def _listing(self, now: float | None = None) -> list[dict[str, Any]]:
        """The pools this server shows, each with its kernel's notebook where a session has one."""
        sessions = await self.session_manager.list_sessions()  # type: ignore[no-untyped-call]
        notebooks = {
            s["kernel"]["id"]: s["path"]
            for s in sessions
            if s.get("kernel") and s.get("type") == "notebook"
        }
        # In a thread: reading every record is file IO, which the server's loop must not wait on
        return await asyncio.to_thread(
            pools.listing, self._checked_dir(), self._kernel_ids(), now, notebooks
        )

    async def _end(self, record: dict[str, Any], wait: float) -> tuple[dict[str, Any], int]:
        """Shut a pool down: its live owner does it (up to ``wait`` seconds), else reap it."""
        directory, key = self.directory, record["id"]
        reply = {"id": key, "name": record.get("name")}
        if pools.owner_alive(record) is not False:
            registry.request_shutdown(directory, key)
            outcome = await self._wait_for_owner(directory, record, wait)
            if outcome == "ended":
                return {**reply, "how": "kernel"}, 200
            if outcome == "pending":
                return {**reply, "how": "requested"}, 202
            self.log.info("skyward: the owner of pool %s died while it was asked to shut down", key)
        report = await asyncio.to_thread(reap, record)
        registry.remove_record(directory, key)
        self.log.info("skyward: reaped orphaned pool %s: %s", key, report.as_dict())
        return {**reply, "how": "reaped", **report.as_dict()}, 200

    def _wait_argument(self) -> float:
        try:
            return min(MAX_WAIT, max(0.0, float(self.get_argument("wait", str(DEFAULT_WAIT)))))
        except ValueError:
            raise web.HTTPError(400, "wait: expected seconds") from None

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
    async def get(self) -> None:
        now = time.time()
        found = await self._listing(now)
        body = {"pools": found, "now": now, "stamp": pools.stamp(found), "states": state_words()}
        self._reply(body)

    @web.authenticated
    @authorized
    async def delete(self) -> None:
        if self.get_argument("gone", "") != "1":
            raise web.HTTPError(400, "only gone pools are cleaned together: ?gone=1")
        wait = self._wait_argument()
        gone = [p["id"] for p in await self._listing() if p["state"] == RECORD_GONE]
        records = [r for r in map(partial(registry.read_record, self.directory), gone) if r]
        ended = await asyncio.gather(*(self._end(r, wait) for r in records))
        self._reply({"cleaned": [reply for reply, _ in ended]})


class StampHandler(_Base):
    @web.authenticated
    @authorized
    async def get(self) -> None:
        self._reply({"stamp": pools.stamp(await self._listing())})


class PoolHandler(_Base):
    @web.authenticated
    @authorized
    async def get(self, key: str) -> None:
        found = pools.find(await self._listing(), key)
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
        reply, status = await self._end(record, self._wait_argument())
        self._reply(reply, status)


def setup_handlers(web_app: Any, directory: Path) -> None:
    base = url_path_join(web_app.settings["base_url"], "skyward", "pools")
    web_app.settings["skyward_registry_dir"] = str(directory)
    web_app.add_handlers(
        ".*$",
        [
            (base + "/?", PoolsHandler),
            (url_path_join(web_app.settings["base_url"], "skyward", "stamp") + "/?", StampHandler),
            (url_path_join(base, r"([^/]+)") + "/?", PoolHandler),
        ],
    )

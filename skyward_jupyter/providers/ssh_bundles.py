"""What the SSH hosts get for their packages before the ranks start (the wheels of
``--ship-wheels``, the uv binary): sent over the notebook's uplink once, to the first host that
lacks it, and passed on by the hosts in a tree (:mod:`..agent.bundles` says how, and what each
host checks).

A host that has the bundle's folder already (an earlier pool) is left out. The first host's
relay listens before it receives; the others start as soon as their parent's relay listens, and
wait there for the bytes. Every relay serves until each host has its copy, then ends.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import shlex
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import asyncssh

from ..agent.relay import ancestors
from ..environments import PackagesError
from ..events import RankState
from ..relay_keys import RelaySecrets
from ..workdir import human_bytes
from .base import Node, Progress, ProviderError

PASSER = ("-m", "skyward_jupyter.agent.bundles")
"""The host side's arguments after the host's Python."""
STALL_WITHIN = 60.0
"""Seconds a host's relay may go without a line (it says its progress each second it moves on)
before the notebook gives up on it and sends that host the bundle itself."""
SAY_EVERY = 10.0
"""Seconds between two of a host's progress lines shown (a large bundle over a slow link takes
minutes: the panel shows how far it is, the text view is not flooded)."""
CLOSE_WITHIN = 10.0
"""Seconds a host's relay has to end once the pass is over, before its channel is closed."""


@dataclass(frozen=True, slots=True)
class Bundle:
    """A thing to send (the wheels, uv): its name, its folder under a host's cache, and how its
    tarball is made (only when some host lacks it).
    """

    what: str
    folder: str
    make: Callable[[], bytes]


@dataclass(frozen=True, slots=True)
class Receiver:
    """A host that may need the bundle: its node, how it is named in errors, how to run its
    relay (``python`` with what it needs on the path) and where its cache is.
    """

    node: Node
    label: str
    open: Callable[[str], Awaitable[Any]]
    """A new session running a command (bytes in, bytes out)."""
    run: Callable[[Sequence[str]], Awaitable[int | None]]
    """A command run to its end; its exit status."""
    send: Callable[[str, bytes], Awaitable[object]]
    """A tarball sent from here over SSH and unpacked into a folder (when no relay passes it)."""
    python: Sequence[str]
    cache: str

    def target(self, bundle: Bundle) -> str:
        return f"{self.cache}/{bundle.folder}"


async def pass_bundle(bundle: Bundle, receivers: Sequence[Receiver], progress: Progress) -> None:
    """Every receiver has ``bundle`` unpacked in its cache once this returns; one that got it
    from no relay gets it from here; the first that could not get it at all fails the start,
    naming itself and why.
    """
    try:
        missing = await asyncio.gather(
            *(r.run(["test", "-d", r.target(bundle)]) for r in receivers)
        )
    except (asyncssh.Error, OSError) as exc:
        raise PackagesError(f"cannot look for the {bundle.what} on the hosts: {exc}") from None
    lacking = [r for r, status in zip(receivers, missing, strict=True) if status != 0]
    if not lacking:
        return
    tarball = await asyncio.to_thread(bundle.make)
    digest = await asyncio.to_thread(lambda: hashlib.sha256(tarball).hexdigest())
    keys = await asyncio.to_thread(RelaySecrets.make, True)
    loop = asyncio.get_running_loop()
    ports: list[asyncio.Future[int | None]] = [loop.create_future() for _ in lacking]
    """Per receiver: where its relay listens; None once it never will."""
    processes: list[Any] = []
    size = human_bytes(len(tarball))

    async def one(k: int) -> None:
        """Receiver ``k`` gets the bundle through the relays, or else from the notebook."""
        receiver = lacking[k]
        try:
            sources = [
                [lacking[j].node.index, lacking[j].node.address, port]
                for j in ancestors(k)
                if (port := await ports[j]) is not None
            ]
            if k and not sources:
                raise PackagesError("no host up the tree serves it")
            await relayed(k, sources)
        except PackagesError as exc:
            if not ports[k].done():
                ports[k].set_result(None)
            say(k, f"packages: sending {bundle.what} ({size}) from here ({exc})")
            try:
                await receiver.send(receiver.target(bundle), tarball)
            except (ProviderError, asyncssh.Error, OSError) as direct:
                raise PackagesError(
                    f"{receiver.label}: could not get the {bundle.what} ({exc}; sent from here: "
                    f"{direct})"
                ) from None
        finally:
            if not ports[k].done():
                ports[k].set_result(None)

    async def relayed(k: int, sources: list[list[Any]]) -> None:
        """Receiver ``k``'s relay, until it has the bundle unpacked; raises why it has not."""
        receiver = lacking[k]
        try:
            process = await receiver.open(shlex.join([*receiver.python, *PASSER]))
        except (ProviderError, asyncssh.Error, OSError) as exc:
            raise PackagesError(f"its relay did not start: {exc}") from None
        processes.append(process)
        request = {
            "target": receiver.target(bundle),
            "digest": digest,
            "nbytes": len(tarball),
            "root": lacking[0].node.address,
            "sources": sources,
            "token": keys.token,
            "cert": keys.cert,
            "key": keys.key,
        }
        said_at = loop.time()
        try:
            process.stdin.write(json.dumps(request).encode() + b"\n")
            if not sources:
                say(k, f"packages: sending {bundle.what} ({size})")
                process.stdin.write(tarball)
            while raw := await _next_line(process, STALL_WITHIN):
                try:
                    line = json.loads(raw)
                except ValueError:
                    continue  # not the relay's: something the host's Python printed
                if not isinstance(line, dict):
                    continue
                if "serving" in line:
                    ports[k].set_result(line["serving"] and int(line["serving"]))
                elif "fetching" in line:
                    parent = line["fetching"]
                    say(k, f"packages: fetching {bundle.what} ({size}) from node {parent}")
                elif "progress" in line:
                    step, moved = _progress(line["progress"])
                    if step and loop.time() - said_at >= SAY_EVERY:
                        said_at = loop.time()
                        say(k, f"packages: {step} {bundle.what}: {human_bytes(moved)} of {size}")
                elif "done" in line:
                    return
                elif "error" in line:
                    raise PackagesError(str(line["error"]))
        except asyncio.TimeoutError:  # an OSError too, from 3.11: first
            # Ended here, so that it neither holds the host's folder nor unpacks into it
            # while the bundle is sent from here.
            processes.remove(process)
            process.close()
            raise PackagesError(f"its relay made no progress for {STALL_WITHIN:.0f} s") from None
        except (asyncssh.Error, OSError) as exc:
            raise PackagesError(f"its relay's channel failed: {exc}") from None
        said = (await process.stderr.read()).decode(errors="replace").strip()
        raise PackagesError(
            "its relay ended before it had them" + (f": {said.splitlines()[-1]}" if said else "")
        )

    def say(k: int, text: str) -> None:
        progress(text, lacking[k].node.index, RankState.BOOTING)

    try:
        outcomes = await asyncio.gather(
            *(one(k) for k in range(len(lacking))), return_exceptions=True
        )
    finally:
        for process in processes:
            process.stdin.write_eof()  # every relay's last client is served: they end
        await asyncio.gather(*(_closed(process) for process in processes))
    for outcome in outcomes:
        if isinstance(outcome, BaseException):
            raise outcome


def _progress(said: Any) -> tuple[str | None, int]:
    """A relay's ``[STEP, BYTES]`` (no step: not that shape)."""
    if (
        isinstance(said, list)
        and len(said) == 2
        and isinstance(said[0], str)
        and isinstance(said[1], int)
    ):
        return said[0], said[1]
    return None, 0


async def _next_line(process: Any, within: float) -> bytes:
    """The relay's next line (empty at its end); ``asyncio.TimeoutError`` when it said none
    ``within`` seconds: it says one each second it moves on, so a silent one is stuck.
    """
    return bytes(await asyncio.wait_for(process.stdout.readline(), within))


async def _closed(process: Any) -> None:
    try:
        await asyncio.wait_for(process.wait_closed(), CLOSE_WITHIN)
    except asyncio.TimeoutError:
        process.close()

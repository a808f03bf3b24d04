"""EC2 instances for a pool, through boto3; once they answer SSH, the SSH provider starts ranks.

This module is the provider itself: the :class:`~.base.Provider` interface and the flow of a
pool's life. The work is split by job:

- :mod:`.aws_checks`: what is checked before anything is created (region, type, image, CIDR);
- :mod:`.aws_launch`: what a pool creates (key pair, security and placement groups, instances
  that verify by a host key made here and stop themselves through :mod:`.aws_watchdog`);
- :mod:`.aws_teardown`: ending a pool, or pools no live notebook owns, by tag alone;
- :mod:`.aws_client`: credentials, clients and AWS's errors in words;
- :mod:`.aws_catalog`: what ``--gpu`` means and what an instance costs.

Provisioning runs in a worker thread (boto3 blocks), checks for cancellation between calls, and
tears down whatever it created when it fails or is interrupted. Teardown terminates, deletes and
then waits until everything is gone; what it could not delete is raised, never swallowed.

Tests point boto3 at a moto server with ``endpoint_url`` and map instances onto local SSH hosts
with ``resolve``; users need neither.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import datetime
import secrets
import threading
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from botocore.exceptions import BotoCoreError, ClientError

from ..events import RankState
from ..gpus import NO_GPU
from . import aws_catalog, aws_teardown
from .aws_checks import check_cidr
from .aws_client import clients, error_message
from .aws_launch import AWSOptions, Instance, Launch, Reachable
from .base import (
    Node,
    Progress,
    Provider,
    ProviderError,
    ProviderOptions,
    ReapReport,
    no_progress,
)
from .ssh import SSHOptions, SSHProvider, SSHRank

if TYPE_CHECKING:
    from ..environments import NodeEnvironment, Packages
    from ..spec import PoolSpec

__all__ = ["AWSOptions", "AWSProvider", "Instance", "Reachable"]

HEARTBEAT_ENV = "SKYWARD_HEARTBEAT_FILE"


def _own(spec: PoolSpec) -> AWSOptions:
    assert isinstance(spec.options, AWSOptions), spec.options
    return spec.options


class AWSProvider(Provider):
    name = "aws"
    Options = AWSOptions
    examples = (("--provider aws --gpu A10G --nodes 2 --spot", "two spot EC2 instances"),)
    default_idle_minutes = 30.0
    installs_packages = True

    @classmethod
    def from_spec(cls, spec: PoolSpec, pool_name: str, extra: Mapping[str, Any]) -> AWSProvider:
        gpu = None if spec.gpu == NO_GPU else spec.gpu
        return cls(replace(_own(spec), pool_name=pool_name, gpu=gpu, **extra))

    @classmethod
    def where(cls, spec: PoolSpec) -> str:
        options = _own(spec)
        parts = [options.instance_type, options.region, "spot" if options.spot else None]
        return cls.name + "".join(f" {p}" for p in parts if p)

    def record(self, pids: Mapping[int, Sequence[int]]) -> dict[str, Any]:
        return self.teardown_record()

    @classmethod
    def reap(cls, record: Mapping[str, Any]) -> ReapReport:
        """Terminate the instances and delete the pool's key pair and groups, by its tag."""
        try:
            removed = aws_teardown.teardown_from_record(record)
        except ProviderError as exc:
            return ReapReport(notes=[str(exc)])
        return ReapReport(
            notes=[
                f"AWS pool {record.get('pool_tag')} in {record.get('region')}: removed "
                + (", ".join(removed) or "nothing (already gone)")
            ]
        )

    @classmethod
    def sweep(
        cls,
        *,
        live: Sequence[Mapping[str, Any]],
        yes: bool,
        all_owners: bool,
        options: ProviderOptions,
        extra: Mapping[str, Any],
    ) -> str:
        """Instances tagged by this product that no live pool owns, in ``--region`` (default:
        boto3's): listed, or with ``yes`` terminated with the rest of their pools (key pairs,
        security and placement groups).
        """
        assert isinstance(options, AWSOptions), options
        ec2, _, region = clients(options.region, extra.get("endpoint_url"))
        tags = {str(r.get("pool_tag", "")) for r in live}
        owner = None if all_owners else extra.get("owner") or aws_teardown.default_owner()
        return aws_teardown.sweep(ec2, region, tags, owner, yes)

    def __init__(self, options: AWSOptions) -> None:
        super().__init__()
        try:
            self.choice = aws_catalog.choose_type(options.gpu, options.instance_type)
        except ValueError as exc:
            raise ProviderError(str(exc)) from None
        if options.ssh_cidr is not None:
            check_cidr(options.ssh_cidr)
        self.options = options
        self.pool_tag = f"sky-{secrets.token_hex(6)}"
        self.owner = options.owner or aws_teardown.default_owner()
        self.created = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        self.node_price: float | None = None
        self._progress: Progress = no_progress
        self.release_timeout = options.delete_timeout + 60
        tags = aws_teardown.pool_tags(self.pool_tag, self.owner, self.created, options.pool_name)
        self._launch = Launch(
            options,
            self.choice.instance_type,
            tags,
            self.heartbeat_file,
            self._say,
            self.warnings.append,
        )
        self._work: concurrent.futures.Future[list[Reachable]] | None = None
        self._ssh: SSHProvider | None = None
        self._teardown_lock = asyncio.Lock()
        self._torn_down = False

    # ------------------------------------------------------------------ the pool's protocol

    async def provision(self, nodes: int, progress: Progress = no_progress) -> list[Node]:
        self._progress = progress
        self._work = concurrent.futures.Future()
        work = self._work
        threading.Thread(
            target=self._run_work, args=(work, nodes), name="skyward-aws-provision", daemon=True
        ).start()
        provisioned = asyncio.wrap_future(work)
        try:
            reachable = await asyncio.shield(provisioned)
            return await self._connect(reachable)
        except BaseException:
            # Interrupted while the thread still creates things: stop it, then remove them all.
            # Its own outcome (cancelled, or failed) is superseded by what is re-raised here.
            self._launch.cancelled.set()
            with contextlib.suppress(BaseException):
                await provisioned
            await self._teardown()
            raise

    async def build_environments(
        self, nodes: Sequence[Node], packages: Packages, progress: Progress
    ) -> dict[int, NodeEnvironment]:
        """The instances are SSH hosts: each builds the environment as one does."""
        assert self._ssh is not None, "provision() first"
        said = len(self._ssh.warnings)
        built = await self._ssh.build_environments(nodes, packages, progress)
        self.warnings.extend(self._ssh.warnings[said:])  # torch's build per node
        return built

    async def start_rank(self, node: Node, env: Mapping[str, str]) -> SSHRank:
        assert self._ssh is not None, "provision() first"
        return await self._ssh.start_rank(node, {**env, HEARTBEAT_ENV: self.heartbeat_file})

    async def release(self) -> None:
        """End the ranks' connections, then terminate and delete everything, waiting for it."""
        self._launch.cancelled.set()
        if self._work is not None:
            with contextlib.suppress(BaseException):
                await asyncio.wrap_future(self._work)
        if self._ssh is not None:
            await self._ssh.release()
        await self._teardown()

    @property
    def price_per_hour(self) -> float | None:
        """The pool's $/hour (what the panels show), where a price is known."""
        return None if self.node_price is None else self.node_price * len(self.instances)

    @property
    def heartbeat_file(self) -> str:
        return f"/tmp/skyward-heartbeat-{self.pool_tag}"

    @property
    def region(self) -> str | None:
        """The pool's region: the one asked for, then the one the credentials chose."""
        return self._launch.region

    @property
    def market(self) -> str:
        """ "spot" or "on-demand" (after a fallback when spot had no capacity)."""
        return self._launch.market

    @property
    def instances(self) -> list[Instance]:
        return self._launch.instances

    def teardown_record(self) -> dict[str, Any]:
        """What the registry keeps to end this pool without its kernel (no secrets)."""
        return {
            "region": self.region,
            "pool_tag": self.pool_tag,
            "instances": [i.instance_id for i in self.instances],
            "endpoint_url": self.options.endpoint_url,
            "owner": self.owner,
        }

    # ---------------------------------------------------------------------- internals

    def _say(self, text: str, node: int | None = None, state: RankState | None = None) -> None:
        self._progress(text, node, state)

    def _run_work(self, future: concurrent.futures.Future[list[Reachable]], nodes: int) -> None:
        future.set_running_or_notify_cancel()  # from now on only this thread completes it
        try:
            future.set_result(self._launch.run(nodes))
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting coroutine
            future.set_exception(exc)

    async def _teardown(self) -> None:
        async with self._teardown_lock:
            ec2 = self._launch.ec2
            if self._torn_down or ec2 is None:
                self._launch.remove_keys()
                return
            self._say(f"tearing down {self.pool_tag} ...")
            try:
                await asyncio.to_thread(
                    aws_teardown.teardown_pool,
                    ec2,
                    self.pool_tag,
                    self.options.delete_timeout,
                    self.options.poll,
                )
                self._torn_down = True
            finally:
                self._launch.remove_keys()

    async def _connect(self, reachable: list[Reachable]) -> list[Node]:
        key_dir = self._launch.key_dir
        assert key_dir is not None
        lines = []
        for r in reachable:
            name = r.host.host if r.host.port == 22 else f"[{r.host.host}]:{r.host.port}"
            lines.append(f"{name} {r.host_key}")
        known_hosts = key_dir / "known_hosts"
        known_hosts.write_text("\n".join(lines) + "\n")
        o = self.options
        self._ssh = SSHProvider(
            [r.host for r in reachable],
            SSHOptions(
                identity=str(key_dir / "id_ed25519"),
                known_hosts=str(known_hosts),
                python=o.python,
                head_addr=reachable[0].private_address,
                connect_timeout=o.connect_timeout,
            ),
        )
        self._ssh.notebook_silence = self.notebook_silence
        self._ssh.packages = self.packages
        nodes = await self._ssh.provision(len(reachable), self._progress)
        self.warnings.extend(self._ssh.warnings)
        self.node_price = await asyncio.to_thread(self._price)
        out = []
        for node, instance in zip(nodes, self.instances, strict=True):
            labels = {"instance_id": instance.instance_id, "market": self.market}
            if self.node_price is not None:
                labels["usd_per_hour"] = f"{self.node_price:.4f}"
            out.append(
                replace(
                    node,
                    gpu_type=node.gpu_type or self.options.gpu,
                    instance_type=self.choice.instance_type,
                    labels=labels,
                )
            )
        return out

    def _price(self) -> float | None:
        assert self.region is not None
        ec2 = self._launch.ec2
        if self.market == "spot" and ec2 is not None:
            try:
                return aws_catalog.spot_price(ec2, self.choice.instance_type)
            except (ClientError, BotoCoreError) as exc:  # a price is a display: the pool works
                self.warnings.append(
                    f"no spot price for {self.choice.instance_type}: {error_message(exc)}"
                )
                return None
        price = aws_catalog.on_demand_price(self.region, self.choice.instance_type)
        if price is None:
            self.warnings.append(
                f"no bundled price for {self.choice.instance_type} in {self.region}: no cost shown"
            )
        return price

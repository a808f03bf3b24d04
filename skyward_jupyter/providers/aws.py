"""EC2 instances for a pool, through boto3; once they answer SSH, the SSH provider starts ranks.

What one pool creates, every piece tagged ``skyward:pool=<tag>`` (with ``skyward:owner`` and
``skyward:created``), so that teardown, the server's reaper and ``%sky sweep`` find all of it by
tag alone:

- a key pair: an ed25519 key made here, its public half imported (the private half never leaves
  this machine and lives only in a 0600 file in a 0700 directory removed at release);
- a security group: SSH (22/tcp) from ``--ssh-cidr`` only, by default this notebook's public
  address as a /32 (never 0.0.0.0/0), and all traffic between the pool's own instances;
- a cluster placement group when the pool has more than one node;
- the instances: the Deep Learning AMI with PyTorch from AWS's public SSM parameter unless
  ``--ami``, spot on request with a fallback to on-demand when spot has no capacity, shutdown
  behaviour "terminate", IMDSv2 only, and user data that (1) installs a host key made here, so
  the SSH connection verifies the instance strictly instead of trusting the first key it sees,
  and (2) runs :mod:`.aws_watchdog`, which terminates the instance once the ranks' heartbeat
  file has been silent for a while: a dead notebook cannot leave it running.

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
import functools
import getpass
import ipaddress
import json
import secrets
import shutil
import socket
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from email.mime.multipart import MIMEMultipart
from email.mime.text import MIMEText
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import asyncssh
from botocore.exceptions import BotoCoreError, ClientError, EndpointConnectionError

from ..events import RankState
from . import aws_catalog
from .base import Node, Progress, Provider, ProviderError, ReapReport, no_progress
from .ssh import Host, SSHOptions, SSHProvider, SSHRank

if TYPE_CHECKING:
    import boto3
    from mypy_boto3_ec2 import EC2Client
    from mypy_boto3_ec2.type_defs import InstanceTypeDef, TagSpecificationTypeDef
    from mypy_boto3_ssm import SSMClient

    from ..spec import PoolSpec

TAG_POOL = "skyward:pool"
TAG_OWNER = "skyward:owner"
TAG_CREATED = "skyward:created"
TAG_NAME = "skyward:name"
DLAMI_PARAMETER = (
    "/aws/service/deeplearning/ami/x86_64/"
    "oss-nvidia-driver-gpu-pytorch-2.11-ubuntu-24.04/latest/ami-id"
)
"""AWS's public parameter naming the newest build of the Deep Learning AMI "OSS Nvidia Driver AMI
GPU PyTorch 2.11 (Ubuntu 24.04)" (GPU and CPU types). The name follows AWS's rule: the AMI's
name without "deep", "learning" and "ami"; a newer PyTorch line needs this updated, or ``--ami``."""
REMOTE_PYTHON = "/opt/pytorch/bin/python3"
"""The PyTorch environment's interpreter on that AMI (release notes: /opt/pytorch/bin/python)."""
ADDRESS_URL = "https://checkip.amazonaws.com"
"""Where this notebook learns its public address (the default ``--ssh-cidr``)."""
HEARTBEAT_ENV = "SKYWARD_HEARTBEAT_FILE"
WATCHDOG_CONFIG = "/etc/skyward/watchdog.json"
_CAPACITY = {
    "InsufficientInstanceCapacity",
    "InsufficientCapacity",
    "InsufficientHostCapacity",
    "InsufficientReservedInstanceCapacity",
    "SpotMaxPriceTooLow",
    "MaxSpotInstanceCountExceeded",
}
_QUOTA = {"VcpuLimitExceeded", "InstanceLimitExceeded", "MaxSpotInstanceCountExceeded"}
_LIVE_STATES = ["pending", "running", "stopping", "stopped", "shutting-down"]


class Cancelled(ProviderError):
    """Provisioning was stopped (Ctrl-C, the pool closed) before it finished."""


@dataclass(frozen=True, slots=True)
class Instance:
    """A launched instance as EC2 describes it."""

    index: int
    instance_id: str
    private_ip: str | None
    public_ip: str | None


@dataclass(frozen=True, slots=True)
class Reachable:
    """Where SSH finds an instance, the host key it must present, and its in-pool address."""

    host: Host
    host_key: str
    """``ssh-ed25519 AAAA...``: the only key accepted for this host."""
    private_address: str
    """How the other nodes reach it (the rendezvous address when it is the head)."""


Resolver = Callable[[Instance, str], Reachable]
"""``resolve(instance, pool_host_key)``: the default uses the public IP and the pool's host key."""


@dataclass(frozen=True, slots=True)
class AWSOptions:
    pool_name: str = "default"
    gpu: str | None = None
    instance_type: str | None = None
    region: str | None = None
    spot: bool = False
    ssh_cidr: str | None = None
    ami: str | None = None
    user: str = "ubuntu"
    python: str = REMOTE_PYTHON
    owner: str | None = None
    """The ``skyward:owner`` tag; default ``user@hostname`` of this notebook."""
    watchdog_timeout: float = 600.0
    """Seconds without a heartbeat after which an instance terminates itself."""
    watchdog_grace: float = 1200.0
    """Seconds after boot during which the watchdog never fires (install, first ranks)."""
    running_timeout: float = 600.0
    reachable_timeout: float = 300.0
    delete_timeout: float = 600.0
    poll: float = 5.0
    connect_timeout: float = 15.0
    endpoint_url: str | None = None
    """Another EC2/SSM endpoint (tests: a moto server); boto3 also reads ``AWS_ENDPOINT_URL``."""
    address_url: str = ADDRESS_URL
    resolve: Resolver | None = field(default=None, compare=False)


def default_owner() -> str:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


def _code(exc: BaseException) -> str:
    if isinstance(exc, ClientError):
        return str(exc.response.get("Error", {}).get("Code", ""))
    return ""


def _message(exc: BaseException) -> str:
    if isinstance(exc, ClientError):
        return str(exc.response.get("Error", {}).get("Message", exc))
    return str(exc)


def boto_session(region: str | None) -> boto3.Session:
    """A boto3 session from the usual chain; a clear error when it has no credentials."""
    import boto3
    import botocore.exceptions

    try:
        session = boto3.Session(region_name=region) if region else boto3.Session()
        credentials = session.get_credentials()
    except botocore.exceptions.BotoCoreError as exc:
        raise ProviderError(f"AWS credentials could not be read: {exc}") from None
    if credentials is None:
        raise ProviderError(
            "no AWS credentials found (environment, ~/.aws/credentials, AWS_PROFILE, SSO or an "
            "instance role); run `aws configure` or set AWS_PROFILE, then run the cell again. "
            "Nothing was created."
        )
    if not session.region_name:
        raise ProviderError(
            "no AWS region: pass --region (e.g. us-east-1) or set AWS_REGION. Nothing was created."
        )
    return session


def clients(region: str | None, endpoint_url: str | None) -> tuple[EC2Client, SSMClient, str]:
    from botocore.config import Config

    session = boto_session(region)
    config = Config(
        retries={"mode": "standard", "max_attempts": 3}, connect_timeout=10, read_timeout=60
    )
    ec2 = session.client("ec2", endpoint_url=endpoint_url, config=config)
    ssm = session.client("ssm", endpoint_url=endpoint_url, config=config)
    return ec2, ssm, str(session.region_name)


# ------------------------------------------------------------------------------- teardown


def _tag_filter(pool_tag: str) -> list[Any]:
    return [{"Name": f"tag:{TAG_POOL}", "Values": [pool_tag]}]


def live_instances(ec2: EC2Client, filters: Sequence[Any]) -> list[InstanceTypeDef]:
    found: list[InstanceTypeDef] = []
    state: Any = {"Name": "instance-state-name", "Values": _LIVE_STATES}
    for page in ec2.get_paginator("describe_instances").paginate(Filters=[*filters, state]):
        for reservation in page.get("Reservations", []):
            found.extend(reservation.get("Instances", []))
    return found


def teardown_pool(
    ec2: EC2Client, pool_tag: str, timeout: float = 600.0, poll: float = 5.0
) -> list[str]:
    """Terminate the pool's instances, delete its key pair, security group and placement group,
    and wait until they are gone. Returns what was removed; raises what could not be."""
    removed: list[str] = []
    failures: list[str] = []
    deadline = time.monotonic() + timeout

    def attempt(what: str, call: Callable[[], object]) -> bool:
        try:
            call()
        except (ClientError, BotoCoreError) as exc:  # collected and raised below
            failures.append(f"{what}: {_message(exc)}")
            return False
        return True

    ids = [i["InstanceId"] for i in live_instances(ec2, _tag_filter(pool_tag))]
    if ids and attempt(
        f"terminate {', '.join(ids)}", lambda: ec2.terminate_instances(InstanceIds=ids)
    ):
        while True:
            left = [i["InstanceId"] for i in live_instances(ec2, _tag_filter(pool_tag))]
            if not left:
                removed.extend(ids)
                break
            if time.monotonic() > deadline:
                failures.append(
                    f"instances {', '.join(left)} still not terminated after {timeout:.0f} s"
                )
                break
            time.sleep(poll)
    keys = ec2.describe_key_pairs(Filters=_tag_filter(pool_tag)).get("KeyPairs", [])
    for key in keys:
        name = key.get("KeyName", "")
        if attempt(f"delete key pair {name}", functools.partial(ec2.delete_key_pair, KeyName=name)):
            removed.append(name)
    groups = ec2.describe_security_groups(Filters=_tag_filter(pool_tag)).get("SecurityGroups", [])
    for group in groups:
        group_id = group["GroupId"]
        while True:  # an instance still shutting down keeps its group in use for a while
            try:
                ec2.delete_security_group(GroupId=group_id)
                removed.append(group_id)
                break
            except (ClientError, BotoCoreError) as exc:  # a dependency clears; others are raised
                if _code(exc) != "DependencyViolation" or time.monotonic() > deadline:
                    failures.append(f"delete security group {group_id}: {_message(exc)}")
                    break
                time.sleep(poll)
    placement = ec2.describe_placement_groups(Filters=_tag_filter(pool_tag)).get(
        "PlacementGroups", []
    )
    for pg in placement:
        name = pg.get("GroupName", "")
        delete = functools.partial(ec2.delete_placement_group, GroupName=name)
        if attempt(f"delete placement group {name}", delete):
            removed.append(name)
    if failures:
        raise ProviderError(
            f"teardown of pool {pool_tag} was incomplete: {'; '.join(failures)}. Delete what is "
            "left in the EC2 console (filter by tag skyward:pool) or run %sky sweep"
        )
    return removed


def teardown_from_record(teardown: Mapping[str, Any], timeout: float = 600.0) -> list[str]:
    """Tear a pool down from its registry record (the server's reaper: the owner is dead)."""
    ec2, _, _ = clients(teardown.get("region"), teardown.get("endpoint_url"))
    return teardown_pool(ec2, str(teardown["pool_tag"]), timeout)


@dataclass(frozen=True, slots=True)
class Orphan:
    instance_id: str
    pool_tag: str
    owner: str
    created: str
    instance_type: str
    state: str

    def describe(self) -> str:
        return (
            f"{self.instance_id} ({self.instance_type}, {self.state}) of pool {self.pool_tag}, "
            f"{self.owner}, created {self.created}"
        )


def find_orphans(ec2: EC2Client, live_pools: set[str], owner: str | None) -> list[Orphan]:
    """Instances tagged by this product whose pool is not live (of ``owner``; None: anyone's)."""
    filters: list[Any] = [{"Name": "tag-key", "Values": [TAG_POOL]}]
    if owner is not None:
        filters.append({"Name": f"tag:{TAG_OWNER}", "Values": [owner]})
    out = []
    for instance in live_instances(ec2, filters):
        tags = {t.get("Key", ""): t.get("Value", "") for t in instance.get("Tags", [])}
        if tags.get(TAG_POOL) in live_pools:
            continue
        out.append(
            Orphan(
                instance["InstanceId"],
                tags.get(TAG_POOL, ""),
                tags.get(TAG_OWNER, ""),
                tags.get(TAG_CREATED, ""),
                str(instance.get("InstanceType", "")),
                instance.get("State", {}).get("Name", ""),
            )
        )
    return out


# ------------------------------------------------------------------------------ user data


def user_data(host_key: asyncssh.SSHKey, watchdog: Mapping[str, Any]) -> str:
    """Cloud-init user data: a cloud-config part (host key, watchdog settings) and the watchdog.

    Everything variable is data (JSON, which cloud-init's YAML reader accepts); no shell is
    built here.
    """
    cloud_config = {
        "ssh_deletekeys": True,
        "ssh_genkeytypes": [],
        "ssh_keys": {
            "ed25519_private": host_key.export_private_key("openssh").decode(),
            "ed25519_public": host_key.export_public_key("openssh").decode().strip(),
        },
        "write_files": [
            {"path": WATCHDOG_CONFIG, "permissions": "0600", "content": json.dumps(dict(watchdog))}
        ],
    }
    message = MIMEMultipart()
    message.attach(MIMEText("#cloud-config\n" + json.dumps(cloud_config), "cloud-config"))
    script = Path(__file__).with_name("aws_watchdog.py").read_text()
    message.attach(MIMEText(script, "x-shellscript"))
    return message.as_string()


def public_cidr(url: str, timeout: float = 5.0) -> str:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            text = response.read(64).decode().strip()
        return str(ipaddress.ip_network(f"{ipaddress.ip_address(text)}/32"))
    except (OSError, ValueError) as exc:
        raise ProviderError(
            f"cannot tell this notebook's public address from {url} ({exc}); pass --ssh-cidr "
            "with the address range SSH will come from (e.g. 203.0.113.7/32)"
        ) from None


def check_cidr(text: str) -> str:
    try:
        network = ipaddress.ip_network(text, strict=False)
    except ValueError:
        raise ProviderError(
            f"--ssh-cidr {text!r} is not an address range like 203.0.113.7/32"
        ) from None
    if network.prefixlen == 0:
        raise ProviderError(
            f"--ssh-cidr {text}: refusing to open SSH to the whole internet; give your own "
            "address or network"
        )
    return str(network)


# ------------------------------------------------------------------------------ provider


class AWSProvider(Provider):
    name = "aws"
    default_idle_minutes = 30.0

    @classmethod
    def from_spec(cls, spec: PoolSpec, pool_name: str, extra: Mapping[str, Any]) -> AWSProvider:
        if spec.hosts:
            raise ProviderError("--hosts is for --provider ssh; --provider aws makes its own hosts")
        options = AWSOptions(
            pool_name=pool_name,
            gpu=spec.gpu,
            instance_type=spec.instance_type,
            region=spec.region,
            spot=bool(spec.spot),
            ssh_cidr=spec.ssh_cidr,
            ami=spec.ami,
        )
        if spec.python:
            options = replace(options, python=spec.python)
        return cls(replace(options, **extra))

    @classmethod
    def where(cls, spec: PoolSpec) -> str:
        parts = [spec.instance_type, spec.region, "spot" if spec.spot else None]
        return cls.name + "".join(f" {p}" for p in parts if p)

    def record(self, pids: Mapping[int, Sequence[int]]) -> dict[str, Any]:
        return self.teardown_record()

    @classmethod
    def reap(cls, record: Mapping[str, Any], grace: float) -> ReapReport:
        """Terminate the instances and delete the pool's key pair and groups, by its tag."""
        try:
            removed = teardown_from_record(record)
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
        region: str | None,
        all_owners: bool,
        extra: Mapping[str, Any],
    ) -> str:
        """Instances tagged by this product that no live pool owns: listed, or with ``yes``
        terminated with the rest of their pools (key pairs, security and placement groups)."""
        ec2, _, region = clients(region, extra.get("endpoint_url"))
        tags = {str(r.get("pool_tag", "")) for r in live}
        owner_tag = None if all_owners else extra.get("owner") or default_owner()
        orphans = find_orphans(ec2, tags, owner_tag)
        whose = "anyone's" if owner_tag is None else owner_tag
        if not orphans:
            return f"no orphaned instances in {region} ({whose})"
        lines = [f"orphaned instances in {region} ({whose}):"]
        lines += [f"  {o.describe()}" for o in orphans]
        if not yes:
            lines.append(
                "run %sky sweep --yes to terminate them and delete their pools' key pairs, "
                "security groups and placement groups"
            )
            return "\n".join(lines)
        for pool_tag in sorted({o.pool_tag for o in orphans}):
            removed = teardown_pool(ec2, pool_tag)
            lines.append(f"pool {pool_tag}: removed {', '.join(removed)}")
        return "\n".join(lines)

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
        self.owner = options.owner or default_owner()
        self.created = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        self.region: str | None = options.region
        self.market = "spot" if options.spot else "on-demand"
        self.instances: list[Instance] = []
        self.node_price: float | None = None
        self._progress: Progress = no_progress
        self.release_timeout = options.delete_timeout + 60
        self._cancel = threading.Event()
        self._work: concurrent.futures.Future[list[Reachable]] | None = None
        self._ssh: SSHProvider | None = None
        self._dir: Path | None = None
        self._ec2: EC2Client | None = None
        self._teardown_lock = asyncio.Lock()
        self._torn_down = False
        self._gpus = self.choice.gpus

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
            self._cancel.set()
            with contextlib.suppress(BaseException):
                await provisioned
            await self._teardown()
            raise

    async def start_rank(self, node: Node, env: Mapping[str, str]) -> SSHRank:
        assert self._ssh is not None, "provision() first"
        return await self._ssh.start_rank(node, {**env, HEARTBEAT_ENV: self.heartbeat_file})

    async def release(self) -> None:
        """End the ranks' connections, then terminate and delete everything, waiting for it."""
        self._cancel.set()
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

    def _check(self) -> None:
        if self._cancel.is_set():
            raise Cancelled(f"provisioning of pool {self.pool_tag} was cancelled")

    def _run_work(self, future: concurrent.futures.Future[list[Reachable]], nodes: int) -> None:
        future.set_running_or_notify_cancel()  # from now on only this thread settles it
        try:
            future.set_result(self._provision(nodes))
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting coroutine
            future.set_exception(exc)

    async def _teardown(self) -> None:
        async with self._teardown_lock:
            if self._torn_down or self._ec2 is None:
                self._remove_dir()
                return
            self._say(f"tearing down {self.pool_tag} ...")
            try:
                await asyncio.to_thread(
                    teardown_pool,
                    self._ec2,
                    self.pool_tag,
                    self.options.delete_timeout,
                    self.options.poll,
                )
                self._torn_down = True
            finally:
                self._remove_dir()

    def _remove_dir(self) -> None:
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def _tags(self, resource: str) -> list[TagSpecificationTypeDef]:
        tags = [
            {"Key": TAG_POOL, "Value": self.pool_tag},
            {"Key": TAG_OWNER, "Value": self.owner},
            {"Key": TAG_CREATED, "Value": self.created},
            {"Key": TAG_NAME, "Value": self.options.pool_name},
            {"Key": "Name", "Value": f"skyward-{self.options.pool_name}"},
        ]
        return [{"ResourceType": resource, "Tags": tags}]  # type: ignore[typeddict-item]

    def _provision(self, nodes: int) -> list[Reachable]:
        """Blocking: every EC2 call of a pool start, in order (a worker thread)."""
        o = self.options
        try:
            ec2, ssm, region = clients(o.region, o.endpoint_url)
            self.region = region
            self._check_region(ec2, region)
            self._check_type(ec2, region)
            ami = self._ami(ec2, ssm, region)
            cidr = check_cidr(o.ssh_cidr) if o.ssh_cidr else public_cidr(o.address_url)
            self._check()
            self._ec2 = ec2  # from here on, teardown has something to look for
            host_key = self._keys(ec2)
            group_id = self._security_group(ec2, cidr)
            if nodes > 1:
                self._check()
                ec2.create_placement_group(
                    GroupName=self.pool_tag,
                    Strategy="cluster",
                    TagSpecifications=self._tags("placement-group"),
                )
            self._check()
            self.instances = self._launch(ec2, nodes, ami, group_id, host_key)
            return self._reachable(host_key)
        except ClientError as exc:
            raise ProviderError(self._explain(exc)) from None
        except BotoCoreError as exc:
            raise ProviderError(f"AWS ({self.region or 'no region'}): {exc}") from None

    def _explain(self, exc: BaseException) -> str:
        code, text = _code(exc), _message(exc)
        where = f"{self.choice.instance_type} in {self.region}"
        if code in _QUOTA:
            return (
                f"your account's quota does not allow {where} ({code}: {text}); request an "
                "increase under Service Quotas > Amazon EC2 (e.g. 'Running On-Demand G and VT "
                "instances'), or use fewer or smaller instances"
            )
        if code in _CAPACITY:
            return (
                f"AWS has no capacity for {where} right now ({code}); try another --region, "
                "another --instance-type, or later"
            )
        if code in ("AuthFailure", "UnauthorizedOperation", "InvalidClientTokenId"):
            return (
                f"AWS refused the request in {self.region} ({code}): {text}; check your "
                "credentials and IAM permissions"
            )
        return f"AWS ({self.region}) {code}: {text}"

    def _check_region(self, ec2: EC2Client, region: str) -> None:
        """A region this boto3 knows (offline), then one EC2 says is enabled for the account."""
        import boto3

        known = boto3.Session().get_available_regions("ec2")
        if region not in known:
            raise ProviderError(
                f"region {region!r} is not an EC2 region; one of " + ", ".join(sorted(known))
            )
        try:
            regions = ec2.describe_regions(AllRegions=True)["Regions"]
        except EndpointConnectionError:
            raise ProviderError(f"cannot reach EC2 in region {region}") from None
        status = {r.get("RegionName"): r.get("OptInStatus") for r in regions}
        if status.get(region, "not-opted-in") == "not-opted-in":
            raise ProviderError(
                f"region {region} is not enabled for your account; enable it or pick another "
                "--region"
            )

    def _check_type(self, ec2: EC2Client, region: str) -> None:
        t, gpu = self.choice.instance_type, self.options.gpu
        try:
            info = ec2.describe_instance_types(InstanceTypes=cast(Any, [t]))["InstanceTypes"]
        except ClientError as exc:
            if _code(exc) in ("InvalidInstanceType", "InvalidParameterValue"):
                raise ProviderError(f"instance type {t!r} does not exist in EC2") from None
            raise
        offered = ec2.describe_instance_type_offerings(
            LocationType="region", Filters=[{"Name": "instance-type", "Values": [t]}]
        ).get("InstanceTypeOfferings", [])
        if not info or not offered:
            raise ProviderError(
                f"instance type {t} is not offered in {region}; try another --region"
            )
        gpus = info[0].get("GpuInfo", {}).get("Gpus", [])
        names = [g.get("Name", "") for g in gpus]
        if gpu and not any(gpu.lower() == n.lower() for n in names):
            has = f"has {', '.join(names)}" if names else "has no GPU"
            raise ProviderError(f"--gpu {gpu} with --instance-type {t}: that type {has}")
        self._gpus = sum(int(g.get("Count", 0)) for g in gpus)

    def _ami(self, ec2: EC2Client, ssm: SSMClient, region: str) -> str:
        ami = self.options.ami
        if ami is None:
            try:
                ami = ssm.get_parameter(Name=DLAMI_PARAMETER)["Parameter"].get("Value", "")
            except ClientError as exc:
                if _code(exc) != "ParameterNotFound":
                    raise
                raise ProviderError(
                    f"AMI not found: AWS's public parameter {DLAMI_PARAMETER} does not exist in "
                    f"{region}; pass --ami with a PyTorch image there"
                ) from None
        try:
            images = ec2.describe_images(ImageIds=[ami]).get("Images", [])
        except ClientError as exc:
            if not _code(exc).startswith("InvalidAMIID"):
                raise
            images = []
        if not images:
            raise ProviderError(f"AMI {ami} not found in {region}; pass --ami with an image there")
        return ami

    def _keys(self, ec2: EC2Client) -> asyncssh.SSHKey:
        """Import the pool's client key (kept in a 0600 file); return a fresh host key."""
        self._dir = Path(tempfile.mkdtemp(prefix=f"skyward-{self.pool_tag}-"))  # 0700
        client = asyncssh.generate_private_key("ssh-ed25519")
        key_path = self._dir / "id_ed25519"
        key_path.touch(mode=0o600)
        key_path.write_bytes(client.export_private_key("openssh"))
        self._say("importing the pool's key pair")
        ec2.import_key_pair(
            KeyName=self.pool_tag,
            PublicKeyMaterial=client.export_public_key("openssh"),
            TagSpecifications=self._tags("key-pair"),
        )
        return asyncssh.generate_private_key("ssh-ed25519")

    def _security_group(self, ec2: EC2Client, cidr: str) -> str:
        self._check()
        group_id = ec2.create_security_group(
            GroupName=self.pool_tag,
            Description=f"skyward_jupyter pool {self.options.pool_name}: SSH from {cidr}",
            TagSpecifications=self._tags("security-group"),
        )["GroupId"]
        ec2.authorize_security_group_ingress(
            GroupId=group_id,
            IpPermissions=[
                {
                    "IpProtocol": "tcp",
                    "FromPort": 22,
                    "ToPort": 22,
                    "IpRanges": [{"CidrIp": cidr, "Description": "SSH from the notebook"}],
                },
                {"IpProtocol": "-1", "UserIdGroupPairs": [{"GroupId": group_id}]},
            ],
        )
        return group_id

    def _launch(
        self, ec2: EC2Client, nodes: int, ami: str, group_id: str, host_key: asyncssh.SSHKey
    ) -> list[Instance]:
        o = self.options
        watchdog = {
            "heartbeat_file": self.heartbeat_file,
            "timeout": o.watchdog_timeout,
            "grace": o.watchdog_grace,
            "poll": 15,
            "command": ["shutdown", "-h", "now"],
            "log": "/var/log/skyward-watchdog.log",
        }
        params: dict[str, Any] = {
            "ImageId": ami,
            "InstanceType": self.choice.instance_type,
            "MinCount": nodes,
            "MaxCount": nodes,
            "KeyName": self.pool_tag,
            "SecurityGroupIds": [group_id],
            "UserData": user_data(host_key, watchdog),
            "InstanceInitiatedShutdownBehavior": "terminate",
            "MetadataOptions": {"HttpTokens": "required", "HttpEndpoint": "enabled"},
            "TagSpecifications": [*self._tags("instance"), *self._tags("volume")],
        }
        if nodes > 1:
            params["Placement"] = {"GroupName": self.pool_tag}
        for index in range(nodes):
            self._say(f"requesting {self.choice.instance_type}", index, RankState.PROVISIONING)
        launched = None
        if o.spot:
            self._say(f"requesting {nodes} x {self.choice.instance_type} (spot)")
            spot: Any = {
                "MarketType": "spot",
                "SpotOptions": {
                    "SpotInstanceType": "one-time",
                    "InstanceInterruptionBehavior": "terminate",
                },
            }
            try:
                launched = ec2.run_instances(**params, InstanceMarketOptions=spot)
            except ClientError as exc:
                if _code(exc) not in _CAPACITY:
                    raise
                self.market = "on-demand"
                note = (
                    f"no spot capacity for {self.choice.instance_type} ({_code(exc)}): "
                    "using on-demand"
                )
                self.warnings.append(note)
                self._say(note)
        if launched is None:
            self._check()
            self._say(f"requesting {nodes} x {self.choice.instance_type} (on-demand)")
            launched = ec2.run_instances(**params)
        ids = [i["InstanceId"] for i in launched["Instances"]]
        for index, iid in enumerate(ids):
            self._say(f"{iid} {self.market}, starting", index, RankState.BOOTING)
        return self._wait_running(ec2, ids)

    def _wait_running(self, ec2: EC2Client, ids: list[str]) -> list[Instance]:
        o = self.options
        deadline = time.monotonic() + o.running_timeout
        said: dict[str, str] = {}
        while True:
            self._check()
            found = {
                i["InstanceId"]: i
                for r in ec2.describe_instances(InstanceIds=ids).get("Reservations", [])
                for i in r.get("Instances", [])
            }
            states = {
                i: found[i].get("State", {}).get("Name", "?") if i in found else "?" for i in ids
            }
            for index, (iid, state) in enumerate(states.items()):
                if said.get(iid) != state:
                    said[iid] = state
                    booted = state == "running"
                    self._say(
                        f"{iid} {state}" + (", waiting for SSH" if booted else ""),
                        index,
                        RankState.CONNECTING if booted else RankState.BOOTING,
                    )
            dead = [i for i, s in states.items() if s in ("shutting-down", "terminated", "stopped")]
            if dead:
                reason = found[dead[0]].get("StateReason", {}).get("Message", "no reason given")
                raise ProviderError(f"instance {dead[0]} ended while starting ({reason})")
            if all(s == "running" for s in states.values()):
                return [
                    Instance(
                        n, i, found[i].get("PrivateIpAddress"), found[i].get("PublicIpAddress")
                    )
                    for n, i in enumerate(ids)
                ]
            if time.monotonic() > deadline:
                raise ProviderError(
                    f"instances did not reach 'running' within {o.running_timeout:.0f} s "
                    f"({', '.join(f'{i} {s}' for i, s in states.items())}); torn down"
                )
            time.sleep(o.poll)

    def _reachable(self, host_key: asyncssh.SSHKey) -> list[Reachable]:
        o = self.options
        public_key = host_key.export_public_key("openssh").decode().strip()
        found = []
        for instance in self.instances:
            if o.resolve is not None:
                found.append(o.resolve(instance, public_key))
                continue
            if not instance.public_ip or not instance.private_ip:
                raise ProviderError(
                    f"instance {instance.instance_id} has no public address (its subnet does not "
                    "assign public IPs); use a default VPC or a public subnet"
                )
            found.append(
                Reachable(Host(instance.public_ip, o.user), public_key, instance.private_ip)
            )
        deadline = time.monotonic() + o.reachable_timeout
        waiting = list(found)
        while waiting:
            self._check()
            waiting = [r for r in waiting if not _answers_ssh(r.host)]
            if waiting and time.monotonic() > deadline:
                names = ", ".join(str(r.host) for r in waiting)
                raise ProviderError(
                    f"instances never became reachable over SSH within {o.reachable_timeout:.0f} s "
                    f"({names}); check that --ssh-cidr covers this notebook's address. The pool "
                    "was torn down"
                )
            if waiting:
                time.sleep(min(o.poll, 1.0))
        self._say("instances answer SSH; starting ranks")
        return found

    async def _connect(self, reachable: list[Reachable]) -> list[Node]:
        assert self._dir is not None
        lines = []
        for r in reachable:
            name = r.host.host if r.host.port == 22 else f"[{r.host.host}]:{r.host.port}"
            lines.append(f"{name} {r.host_key}")
        known_hosts = self._dir / "known_hosts"
        known_hosts.write_text("\n".join(lines) + "\n")
        o = self.options
        self._ssh = SSHProvider(
            [r.host for r in reachable],
            SSHOptions(
                identity=str(self._dir / "id_ed25519"),
                known_hosts=str(known_hosts),
                python=o.python,
                head_addr=reachable[0].private_address,
                connect_timeout=o.connect_timeout,
            ),
        )
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
        if self.market == "spot" and self._ec2 is not None:
            try:
                return aws_catalog.spot_price(self._ec2, self.choice.instance_type)
            except (ClientError, BotoCoreError) as exc:  # a price is a display: the pool works
                self.warnings.append(
                    f"no spot price for {self.choice.instance_type}: {_message(exc)}"
                )
                return None
        price = aws_catalog.on_demand_price(self.region, self.choice.instance_type)
        if price is None:
            self.warnings.append(
                f"no bundled price for {self.choice.instance_type} in {self.region}: no cost shown"
            )
        return price


def _answers_ssh(host: Host) -> bool:
    try:
        with socket.create_connection((host.host, host.port), timeout=2.0) as s:
            s.settimeout(3.0)
            return s.recv(8).startswith(b"SSH-")
    except OSError:
        return False

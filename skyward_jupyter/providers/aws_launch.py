"""Creating one pool's EC2 resources, in order, until its instances answer SSH.

What a launch creates, every piece tagged (see :mod:`.aws_teardown`) so that teardown finds all
of it by tag alone:

- a key pair: an ed25519 key made here, its public half imported (the private half never leaves
  this machine and lives only in a 0600 file in a 0700 directory removed at release);
- a security group: SSH (22/tcp) from ``--ssh-cidr`` only, by default this notebook's public
  address as a /32 (never 0.0.0.0/0), and all traffic between the pool's own instances;
- a cluster placement group when the pool has more than one node;
- the instances: the Deep Learning AMI with PyTorch (:mod:`.aws_checks`) unless ``--ami``, spot
  on request with a fallback to on-demand when spot has no capacity, shutdown behaviour
  "terminate", IMDSv2 only, and user data that (1) installs a host key made here, so the SSH
  connection verifies the instance strictly instead of trusting the first key it sees, and
  (2) runs :mod:`.aws_watchdog`, which terminates the instance once the ranks' heartbeat file
  has been silent for a while: a dead notebook cannot leave it running.

Every call blocks (boto3), so the provider runs a launch in a worker thread; it checks for
cancellation between calls, and the provider tears down whatever it created when it fails.
"""

from __future__ import annotations

import json
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from email.mime.multipart import MIMEMultipart
from email.mime.text import MIMEText
from pathlib import Path
from typing import TYPE_CHECKING, Any

import asyncssh
from botocore.exceptions import BotoCoreError, ClientError

from ..events import RankState
from .aws_checks import ADDRESS_URL, check_cidr, check_region, check_type, find_ami, public_cidr
from .aws_client import CAPACITY, clients, error_code, explain
from .aws_teardown import TAG_POOL
from .base import PYTHON, Progress, ProviderError, ProviderOptions, option
from .ssh import Host

if TYPE_CHECKING:
    from mypy_boto3_ec2 import EC2Client
    from mypy_boto3_ec2.type_defs import TagSpecificationTypeDef

REMOTE_PYTHON = "/opt/pytorch/bin/python3"
"""The PyTorch environment's interpreter on that AMI (release notes: /opt/pytorch/bin/python)."""
WATCHDOG_CONFIG = "/etc/skyward/watchdog.json"


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
class AWSOptions(ProviderOptions):
    """The AWS provider's options: its ``--flags``, then the settings users never give."""

    instance_type: str | None = option("EC2 instance type (default: from --gpu)", metavar="TYPE")
    region: str | None = option("AWS region (default: boto3's)", metavar="REGION")
    spot: bool = option(
        "spot instances, on-demand when spot has no capacity", default=False, action="store_true"
    )
    ssh_cidr: str | None = option(
        "where SSH to the instances may come from (default: this notebook's address/32)",
        metavar="CIDR",
    )
    ami: str | None = option("image (default: the Deep Learning AMI)", metavar="ID")
    python: str = PYTHON.field(default=REMOTE_PYTHON)
    """The AMI's PyTorch environment unless given."""
    pool_name: str = "default"
    gpu: str | None = None
    user: str = "ubuntu"
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


class Launch:
    """One pool start: every EC2 call, in order, blocking; what it made so far stays readable.

    ``ec2`` is set once something may exist (teardown then has something to look for), ``key_dir``
    once the client key is written; ``instances`` once they run; ``market`` says whether they are
    spot or on-demand after a fallback.
    """

    def __init__(
        self,
        options: AWSOptions,
        instance_type: str,
        tags: Mapping[str, str],
        heartbeat_file: str,
        say: Progress,
        warn: Callable[[str], None],
    ) -> None:
        self.options = options
        self.instance_type = instance_type
        self.pool_tag = tags[TAG_POOL]
        self._tag_values = dict(tags)
        self.heartbeat_file = heartbeat_file
        self._say = say
        self._warn = warn
        self.cancelled = threading.Event()
        self.region: str | None = options.region
        self.market = "spot" if options.spot else "on-demand"
        self.instances: list[Instance] = []
        self.ec2: EC2Client | None = None
        self.key_dir: Path | None = None

    def check(self) -> None:
        """Raise :class:`Cancelled` once the provider asked the launch to stop."""
        if self.cancelled.is_set():
            raise Cancelled(f"provisioning of pool {self.pool_tag} was cancelled")

    def remove_keys(self) -> None:
        if self.key_dir is not None:
            shutil.rmtree(self.key_dir, ignore_errors=True)
            self.key_dir = None

    def run(self, nodes: int) -> list[Reachable]:
        """Check the request, create the pool, and wait until every instance answers SSH."""
        o = self.options
        try:
            ec2, ssm, region = clients(o.region, o.endpoint_url)
            self.region = region
            check_region(ec2, region)
            check_type(ec2, region, self.instance_type, o.gpu)
            ami = find_ami(ec2, ssm, region, o.ami)
            cidr = check_cidr(o.ssh_cidr) if o.ssh_cidr else public_cidr(o.address_url)
            self.check()
            self.ec2 = ec2  # from here on, teardown has something to look for
            host_key = self._keys(ec2)
            group_id = self._security_group(ec2, cidr)
            if nodes > 1:
                self.check()
                ec2.create_placement_group(
                    GroupName=self.pool_tag,
                    Strategy="cluster",
                    TagSpecifications=self._tags("placement-group"),
                )
            self.check()
            self.instances = self._launch(ec2, nodes, ami, group_id, host_key)
            return self._reachable(host_key)
        except ClientError as exc:
            raise ProviderError(explain(exc, self.instance_type, self.region)) from None
        except BotoCoreError as exc:
            raise ProviderError(f"AWS ({self.region or 'no region'}): {exc}") from None

    def _tags(self, resource: str) -> list[TagSpecificationTypeDef]:
        tags = [{"Key": k, "Value": v} for k, v in self._tag_values.items()]
        return [{"ResourceType": resource, "Tags": tags}]  # type: ignore[typeddict-item]

    def _keys(self, ec2: EC2Client) -> asyncssh.SSHKey:
        """Import the pool's client key (kept in a 0600 file); return a fresh host key."""
        self.key_dir = Path(tempfile.mkdtemp(prefix=f"skyward-{self.pool_tag}-"))  # 0700
        client = asyncssh.generate_private_key("ssh-ed25519")
        key_path = self.key_dir / "id_ed25519"
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
        self.check()
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
            "InstanceType": self.instance_type,
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
            self._say(f"requesting {self.instance_type}", index, RankState.PROVISIONING)
        launched = None
        if o.spot:
            self._say(f"requesting {nodes} x {self.instance_type} (spot)")
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
                if error_code(exc) not in CAPACITY:
                    raise
                self.market = "on-demand"
                note = (
                    f"no spot capacity for {self.instance_type} ({error_code(exc)}): "
                    "using on-demand"
                )
                self._warn(note)
                self._say(note)
        if launched is None:
            self.check()
            self._say(f"requesting {nodes} x {self.instance_type} (on-demand)")
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
            self.check()
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
            self.check()
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


def _answers_ssh(host: Host) -> bool:
    try:
        with socket.create_connection((host.host, host.port), timeout=2.0) as s:
            s.settimeout(3.0)
            return s.recv(8).startswith(b"SSH-")
    except OSError:
        return False

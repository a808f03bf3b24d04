"""The AWS provider against a moto server on loopback (tests/aws_server.py), and on real sshd
hosts in network namespaces once its instances are "up" (tests/hosts.py).

moto's instances have no machines behind their addresses: the tests never connect to them.
A :class:`~tests.aws_server.NamespaceResolver` maps instance i onto namespace host i.
"""

from __future__ import annotations

import base64
import email
import http.server
import json
import socket
import stat
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import asyncssh
import boto3
import pytest

from skyward_jupyter import Pool
from skyward_jupyter.display.state import PanelState
from skyward_jupyter.events import NodeStateChanged, RankState
from skyward_jupyter.gpus import same_gpu
from skyward_jupyter.providers import aws, aws_catalog, aws_checks, aws_teardown
from skyward_jupyter.providers.aws import AWSOptions, AWSProvider, Reachable
from skyward_jupyter.providers.base import ProviderError
from skyward_jupyter.providers.ssh import Host

from .aws_server import Ec2Stand, NamespaceResolver, running
from .conftest import ctrl_c, ssh_hosts_fixture, wait_for
from .hosts import Hosts, available

REGION = "us-east-1"
KNOWN_BEFORE = ("T4", "A10G", "L4", "L40S", "V100", "A100", "H100")
MY_ADDRESS = "203.0.113.7"
ALL_REDUCE = (
    "import torch, torch.distributed as dist\n"
    "t = torch.ones(1) * (dist.get_rank() + 1)\n"
    "dist.all_reduce(t)\n"
    "t.item()"
)
needs_hosts = pytest.mark.skipif(available() is not None, reason=str(available()))


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def stand() -> Iterator[Ec2Stand]:
    yield from running()


@pytest.fixture(autouse=True)
def aws_env(monkeypatch: pytest.MonkeyPatch, stand: Ec2Stand) -> None:
    """Credentials for moto only; no profile, no config file, no instance metadata lookups."""
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_REGION", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    stand.clear_faults()


@pytest.fixture(scope="module")
def dlami(stand: Ec2Stand) -> str:
    """AWS's public DLAMI parameter, published in moto's SSM, naming an image moto has."""
    image = _ec2(stand).describe_images(Owners=["amazon"])["Images"][0]["ImageId"]
    stand.publish_parameter(REGION, aws_checks.DLAMI_PARAMETER, image)
    return image


@pytest.fixture(scope="module")
def address_url() -> Iterator[str]:
    """What checkip answers from this notebook: a documentation address."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = f"{MY_ADDRESS}\n".encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


hosts = ssh_hosts_fixture(2, "aws-hosts")


def _ec2(stand: Ec2Stand, region: str = REGION) -> Any:
    return boto3.client(
        "ec2",
        region_name=region,
        endpoint_url=stand.url,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )


def _resolver(stand: Ec2Stand, hosts: Hosts) -> NamespaceResolver:
    return NamespaceResolver(
        stand.url,
        [(h.address, h.port) for h in hosts],
        str(hosts.known_hosts),
        str(hosts.client_key.parent / "authorized_keys"),
        hosts.user,
    )


def _nowhere(instance: aws.Instance, host_key: str) -> Reachable:
    """Never moto's 10.x/54.x addresses: a loopback port that nothing listens on."""
    return Reachable(Host("127.0.0.1", "root", _NOWHERE), host_key, "127.0.0.1")


_NOWHERE_SOCKET = socket.socket()
"""Bound and never listening, for the module's life: its port refuses connections, and nothing
else can listen there meanwhile (a port picked free and let go could be taken)."""
_NOWHERE_SOCKET.bind(("127.0.0.1", 0))
_NOWHERE = int(_NOWHERE_SOCKET.getsockname()[1])


def _options(stand: Ec2Stand, address_url: str, **changes: Any) -> AWSOptions:
    base = AWSOptions(
        resolve=_nowhere,
        region=REGION,
        endpoint_url=stand.url,
        address_url=address_url,
        python=sys.executable,
        owner="tester@test",
        poll=0.1,
        running_timeout=30,
        reachable_timeout=20,
        delete_timeout=30,
        connect_timeout=5,
    )
    return AWSOptions(**{**{f: getattr(base, f) for f in base.__dataclass_fields__}, **changes})


def leftovers(stand: Ec2Stand, pool_tag: str) -> dict[str, list[str]]:
    """Everything of the pool that still exists in EC2."""
    ec2 = _ec2(stand)
    tag = [{"Name": f"tag:{aws_teardown.TAG_POOL}", "Values": [pool_tag]}]
    return {
        "instances": [i["InstanceId"] for i in aws_teardown.live_instances(ec2, tag)],
        "key_pairs": [k["KeyName"] for k in ec2.describe_key_pairs(Filters=tag)["KeyPairs"]],
        "security_groups": [
            g["GroupId"] for g in ec2.describe_security_groups(Filters=tag)["SecurityGroups"]
        ],
        "placement_groups": [
            g.name
            for g in stand.placement_groups.values()
            if g.tags.get(aws_teardown.TAG_POOL) == pool_tag
        ],
    }


NOTHING: dict[str, list[str]] = {
    "instances": [],
    "key_pairs": [],
    "security_groups": [],
    "placement_groups": [],
}


# --------------------------------------------------------------------------- the catalog


def test_every_gpu_name_maps_to_a_type_that_ec2_says_carries_it(
    stand: Ec2Stand, address_url: str
) -> None:
    ec2 = _ec2(stand)
    for gpu, choices in aws_catalog.GPU_TYPES.items():
        for choice in choices:
            info = ec2.describe_instance_types(InstanceTypes=[choice.instance_type])
            gpus = info["InstanceTypes"][0]["GpuInfo"]["Gpus"]
            assert [same_gpu(gpu, aws_checks._named(g)) for g in gpus] == [True], choice
            assert sum(g["Count"] for g in gpus) == choice.gpus, choice
        provider = AWSProvider(_options(stand, address_url, gpu=gpu))
        assert provider.choice == choices[0] and choices[0].gpus >= 1
        aws_checks.check_type(ec2, REGION, provider.choice.instance_type, gpu)  # it passes
    for gpu in KNOWN_BEFORE:  # priced in the bundled snapshot (newer types may show no price)
        choices = aws_catalog.GPU_TYPES[gpu]
        assert any(aws_catalog.on_demand_price(REGION, c.instance_type) for c in choices), gpu
    # Today's types, under the names machines report (EC2's, nvidia-smi's), by model.
    for asked, instance_type in (
        ("H200", "p5en.48xlarge"),
        ("NVIDIA H200", "p5en.48xlarge"),
        ("B200", "p6-b200.48xlarge"),
        ("A100-80GB", "p4de.24xlarge"),
        ("NVIDIA A100-SXM4-80GB", "p4de.24xlarge"),
        ("A100", "p4d.24xlarge"),
        ("L40S", "g6e.xlarge"),
        ("H100", "p5.4xlarge"),
    ):
        assert aws_catalog.choose_type(asked, None).instance_type == instance_type, asked
    with pytest.raises(ProviderError, match=r"--gpu A100-80GB with --instance-type p4d.*A100 40GB"):
        aws_checks.check_type(ec2, REGION, "p4d.24xlarge", "A100-80GB")
    aws_checks.check_type(ec2, REGION, "p5en.48xlarge", "NVIDIA H200")
    cpu = AWSProvider(_options(stand, address_url))
    assert cpu.choice.instance_type == aws_catalog.CPU_TYPE
    assert not ec2.describe_instance_types(InstanceTypes=[aws_catalog.CPU_TYPE])["InstanceTypes"][
        0
    ].get("GpuInfo")
    assert aws_catalog.on_demand_price("ap-south-2", "g4dn.xlarge") is None  # no guess


# ----------------------------------------------------------------- a pool, every call checked


@needs_hosts
def test_two_node_pool_every_call_and_nothing_left(
    stand: Ec2Stand, dlami: str, address_url: str, hosts: Hosts
) -> None:
    before = len(stand.calls)
    provider = AWSProvider(_options(stand, address_url, gpu="T4", resolve=_resolver(stand, hosts)))
    tag = provider.pool_tag
    pool = Pool(nodes=2, provider=provider, heartbeat_timeout=10)
    boot = PanelState("default", "aws")  # the panel's fold of the pool's events
    states: list[tuple[int, RankState]] = []
    pool.subscribe(boot)
    pool.subscribe(
        lambda e: states.append((e.node, e.state)) if isinstance(e, NodeStateChanged) else None
    )
    with pool:
        # While it booted, each node went provisioning, booting, connecting, in that order.
        for node in (0, 1):
            mine = [s for n, s in states if n == node]
            firsts = list(dict.fromkeys(mine))  # each state where it first appeared
            assert firsts == [RankState.PROVISIONING, RankState.BOOTING, RankState.CONNECTING]
        assert pool.run(ALL_REDUCE).values == [3.0, 3.0]
        # Once the ranks are up, their states are the nodes' states in the panel.
        assert {row.state for row in boot.snapshot().nodes} == {RankState.IDLE}
        # The pool's private key: a 0600 file in a 0700 directory of this machine only.
        key = Path(str(provider._ssh.options.identity))  # type: ignore[union-attr]
        assert stat.S_IMODE(key.stat().st_mode) == 0o600
        assert stat.S_IMODE(key.parent.stat().st_mode) == 0o700
        # The ranks touch the watchdog's heartbeat file on each host (its own filesystem).
        for i in range(2):
            seen = hosts.inside_argv(i, "test", "-f", provider.heartbeat_file)
            wait_for(lambda seen=seen: subprocess.run(seen).returncode == 0, 10, "heartbeat file")
        assert [n.instance_type for n in pool.nodes] == ["g4dn.xlarge"] * 2
        assert pool.nodes[0].labels["usd_per_hour"] == "0.5260"
        assert provider.price_per_hour == pytest.approx(2 * 0.526)
        assert pool.nodes[0].address == hosts[0].address  # MASTER_ADDR: the private address
        during = leftovers(stand, tag)
        assert len(during["instances"]) == 2 and during["key_pairs"] == [tag]
        assert during["placement_groups"] == [tag] and len(during["security_groups"]) == 1
    assert leftovers(stand, tag) == NOTHING
    assert not key.parent.exists()

    calls = stand.calls[before:]
    actions = [c.action for c in calls]
    # The AMI: AWS's public DLAMI parameter, then the image checked.
    (lookup,) = [c for c in calls if c.action == "GetParameter"]
    assert json.loads(lookup.params["Name"]) == aws_checks.DLAMI_PARAMETER
    # The key pair: imported (made here), tagged.
    (imported,) = [c for c in calls if c.action == "ImportKeyPair"]
    assert imported.params["KeyName"] == tag
    material = base64.b64decode(imported.params["PublicKeyMaterial"]).decode()
    assert material.startswith("ssh-ed25519 ")
    owner = {aws_teardown.TAG_POOL: tag, aws_teardown.TAG_OWNER: "tester@test"}
    assert owner.items() <= imported.tags("key-pair").items()
    # The security group: SSH from this notebook's address only, all traffic inside the group.
    (created,) = [c for c in calls if c.action == "CreateSecurityGroup"]
    assert owner.items() <= created.tags("security-group").items()
    (ingress,) = [c for c in calls if c.action == "AuthorizeSecurityGroupIngress"]
    assert "0.0.0.0/0" not in json.dumps(ingress.params)
    rules = ingress.params
    assert rules["IpPermissions.1.IpProtocol"] == "tcp"
    assert (rules["IpPermissions.1.FromPort"], rules["IpPermissions.1.ToPort"]) == ("22", "22")
    assert rules["IpPermissions.1.IpRanges.1.CidrIp"] == f"{MY_ADDRESS}/32"
    assert rules["IpPermissions.2.IpProtocol"] == "-1"
    assert rules["IpPermissions.2.Groups.1.GroupId"] == rules["GroupId"]
    # The placement group: cluster, tagged.
    (placement,) = [c for c in calls if c.action == "CreatePlacementGroup"]
    assert placement.params["Strategy"] == "cluster" and placement.params["GroupName"] == tag
    assert owner.items() <= placement.tags("placement-group").items()
    # The instances.
    (run,) = [c for c in calls if c.action == "RunInstances"]
    p = run.params
    assert (p["ImageId"], p["InstanceType"], p["MinCount"], p["MaxCount"]) == (
        dlami,
        "g4dn.xlarge",
        "2",
        "2",
    )
    assert p["KeyName"] == tag and p["Placement.GroupName"] == tag
    assert p["InstanceInitiatedShutdownBehavior"] == "terminate"
    assert p["MetadataOptions.HttpTokens"] == "required"
    assert "InstanceMarketOptions.MarketType" not in p
    assert owner.items() <= run.tags("instance").items()
    assert (
        aws_teardown.TAG_CREATED in run.tags("instance")
        and owner.items() <= run.tags("volume").items()
    )
    parts = _user_data(p["UserData"])
    config = parts["text/cloud-config"]
    watchdog = json.loads(config["write_files"][0]["content"])
    assert watchdog["heartbeat_file"] == provider.heartbeat_file
    assert watchdog["command"] == ["shutdown", "-h", "now"]
    assert config["ssh_keys"]["ed25519_public"].startswith("ssh-ed25519 ")
    assert parts["text/x-shellscript"].startswith("#!/usr/bin/env python3")
    # Teardown: terminate, then delete key pair, security group and placement group.
    for action in ("TerminateInstances", "DeleteKeyPair", "DeleteSecurityGroup"):
        assert action in actions
    assert [c.params["GroupName"] for c in calls if c.action == "DeletePlacementGroup"] == [tag]
    assert actions.index("TerminateInstances") < actions.index("DeleteSecurityGroup")


def _user_data(encoded: str) -> dict[str, Any]:
    message = email.message_from_string(base64.b64decode(encoded).decode())
    parts: dict[str, Any] = {}
    for part in message.walk():
        if part.get_content_maintype() == "multipart":
            continue
        text = part.get_payload(decode=True).decode()
        if part.get_content_type() == "text/cloud-config":
            assert text.startswith("#cloud-config\n")
            parts["text/cloud-config"] = json.loads(text.split("\n", 1)[1])
        else:
            parts[part.get_content_type()] = text
    return parts


@needs_hosts
@pytest.mark.parametrize("capacity", [True, False], ids=["spot", "no-spot-capacity"])
def test_spot_and_its_fallback_to_on_demand(
    stand: Ec2Stand, dlami: str, address_url: str, hosts: Hosts, capacity: bool
) -> None:
    before = len(stand.calls)
    if not capacity:
        stand.fail(
            "RunInstances",
            "InsufficientInstanceCapacity",
            status=500,
            when=lambda p: p.get("InstanceMarketOptions.MarketType") == "spot",
        )
    provider = AWSProvider(
        _options(stand, address_url, gpu="A10G", spot=True, resolve=_resolver(stand, hosts))
    )
    with Pool(nodes=1, provider=provider) as pool:
        instance = pool.nodes[0].labels["instance_id"]
        described = _ec2(stand).describe_instances(InstanceIds=[instance])
        lifecycle = described["Reservations"][0]["Instances"][0].get("InstanceLifecycle")
        if capacity:
            assert lifecycle == "spot" and pool.nodes[0].labels["market"] == "spot"
            assert provider.price_per_hour == pytest.approx(0.00001)  # moto's spot history
        else:
            assert lifecycle is None and pool.nodes[0].labels["market"] == "on-demand"
            assert provider.price_per_hour == pytest.approx(1.006)
            assert any("no spot capacity" in w for w in provider.warnings)
    runs = stand.calls_of("RunInstances", before)
    assert runs[0].params["InstanceMarketOptions.MarketType"] == "spot"
    assert runs[0].params["InstanceMarketOptions.SpotOptions.InstanceInterruptionBehavior"] == (
        "terminate"
    )
    assert runs[-1].params["InstanceType"] == "g5.xlarge"
    if not capacity:
        assert "InstanceMarketOptions.MarketType" not in runs[-1].params
    assert not stand.calls_of("CreatePlacementGroup", before)  # one node: none needed
    assert leftovers(stand, provider.pool_tag) == NOTHING


# -------------------------------------------------------------- failures leave nothing behind


@pytest.mark.parametrize(
    ("action", "code", "status", "message"),
    [
        ("RunInstances", "VcpuLimitExceeded", 400, "quota does not allow g4dn.xlarge"),
        ("RunInstances", "InsufficientInstanceCapacity", 500, "no capacity for g4dn.xlarge"),
        ("CreatePlacementGroup", "InvalidParameterValue", 400, "InvalidParameterValue"),
        # Waiting for the launched instances fails (teardown's lookups by tag still work).
        ("DescribeInstances", "UnauthorizedOperation", 400, "AWS refused the request"),
    ],
)
def test_a_failure_midway_tears_down_what_was_created(
    stand: Ec2Stand,
    dlami: str,
    address_url: str,
    action: str,
    code: str,
    status: int,
    message: str,
) -> None:
    before = len(stand.calls)
    stand.fail(action, code, status=status, when=lambda p: "InstanceId.1" in p)
    if action != "DescribeInstances":
        stand.clear_faults()
        stand.fail(action, code, status=status)
    provider = AWSProvider(_options(stand, address_url, gpu="T4"))
    with pytest.raises(ProviderError, match=message):
        Pool(nodes=2, provider=provider).start()
    stand.clear_faults()
    assert stand.calls_of("ImportKeyPair", before) and stand.calls_of("CreateSecurityGroup", before)
    assert stand.calls_of("DeleteKeyPair", before) and stand.calls_of("DeleteSecurityGroup", before)
    assert leftovers(stand, provider.pool_tag) == NOTHING


def test_instances_that_never_answer_ssh_are_torn_down(
    stand: Ec2Stand, dlami: str, address_url: str
) -> None:
    provider = AWSProvider(_options(stand, address_url, reachable_timeout=1.5))
    with pytest.raises(ProviderError, match="never became reachable over SSH within 2 s"):
        Pool(nodes=2, provider=provider).start()
    assert len(provider.instances) == 2
    assert leftovers(stand, provider.pool_tag) == NOTHING


def test_ctrl_c_while_instances_boot_tears_down_what_was_created(
    stand: Ec2Stand, dlami: str, address_url: str
) -> None:
    """Ctrl-C (SIGINT to the notebook's main thread) while the pool waits for SSH."""
    provider = AWSProvider(_options(stand, address_url, reachable_timeout=120))
    before = len(stand.calls)

    def interrupt_once_booted() -> None:
        wait_for(lambda: stand.calls_of("RunInstances", before), 30, "the instances requested")
        wait_for(lambda: len(provider.instances) == 2, 30, "both instances running")
        ctrl_c()

    interrupter = threading.Thread(target=interrupt_once_booted)
    interrupter.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            Pool(nodes=2, provider=provider).start()
    finally:
        interrupter.join()
    assert leftovers(stand, provider.pool_tag) == NOTHING
    assert stand.calls_of("TerminateInstances", before)


def test_clear_errors_before_anything_is_created(
    stand: Ec2Stand, dlami: str, address_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    cases: list[tuple[dict[str, Any], str]] = [
        ({"region": "xx-nowhere-1"}, "region 'xx-nowhere-1' is not an EC2 region"),
        ({"instance_type": "g4dn.bogus"}, "instance type 'g4dn.bogus' does not exist"),
        ({"gpu": "T4", "instance_type": "g5.xlarge"}, "that type has A10G"),
        ({"gpu": "T4", "instance_type": "m5.xlarge"}, "that type has no GPU"),
        ({"ami": "ami-00000000"}, "AMI ami-00000000 not found in us-east-1"),
        ({"region": "us-west-2"}, "AMI not found: AWS's public parameter"),
    ]
    for changes, message in cases:
        before = len(stand.calls)
        with pytest.raises(ProviderError, match=message):
            Pool(nodes=1, provider=AWSProvider(_options(stand, address_url, **changes))).start()
        created = {"ImportKeyPair", "CreateSecurityGroup", "RunInstances"}
        assert not created & {c.action for c in stand.calls[before:]}, changes
    with pytest.raises(ProviderError, match="refusing to open SSH to the whole internet"):
        AWSProvider(_options(stand, address_url, ssh_cidr="0.0.0.0/0"))
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    before = len(stand.calls)
    with pytest.raises(ProviderError, match=r"no AWS credentials found.*Nothing was created"):
        Pool(nodes=1, provider=AWSProvider(_options(stand, address_url))).start()
    assert stand.calls[before:] == []


# ------------------------------------------------------------------------ sweep and reap


def _orphan(stand: Ec2Stand, dlami: str, pool_tag: str, owner: str) -> str:
    """What a pool whose notebook died leaves: tagged instance, key pair and security group."""
    ec2 = _ec2(stand)
    tags = [
        {"Key": aws_teardown.TAG_POOL, "Value": pool_tag},
        {"Key": aws_teardown.TAG_OWNER, "Value": owner},
    ]
    ec2.import_key_pair(
        KeyName=pool_tag,
        PublicKeyMaterial=asyncssh.generate_private_key("ssh-ed25519").export_public_key(),
        TagSpecifications=[{"ResourceType": "key-pair", "Tags": tags}],
    )
    group = ec2.create_security_group(
        GroupName=pool_tag,
        Description="x",
        TagSpecifications=[{"ResourceType": "security-group", "Tags": tags}],
    )["GroupId"]
    run = ec2.run_instances(
        ImageId=dlami,
        MinCount=1,
        MaxCount=1,
        SecurityGroupIds=[group],
        TagSpecifications=[{"ResourceType": "instance", "Tags": tags}],
    )
    return str(run["Instances"][0]["InstanceId"])


def test_sweep_shows_then_terminates_orphans_of_this_owner_only(
    stand: Ec2Stand, dlami: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from skyward_jupyter.registry import Owner, write_record
    from skyward_jupyter.session import Session

    monkeypatch.setenv("SKYWARD_REGISTRY_DIR", str(tmp_path))
    tmp_path.chmod(0o700)
    me, someone = "sweeper@test", "someone@else"
    orphan = _orphan(stand, dlami, "sky-orphan00001", me)
    live = _orphan(stand, dlami, "sky-livepool001", me)
    theirs = _orphan(stand, dlami, "sky-theirs00001", someone)
    # A live pool of another kernel on this machine: its record, owned by this (live) process.
    owner = Owner.current().as_dict()
    write_record(
        tmp_path,
        {
            "format": 1,
            "id": "0123456789ab",
            "owner": owner,
            "teardown": {"provider": "aws", "pool_tag": "sky-livepool001"},
        },
    )
    session = Session()
    session.provider_options["aws"] = {"endpoint_url": stand.url, "owner": me}
    # Where to look: the configured options (%sky config), which those given override.
    session.defaults = session.spec_from({"provider": "aws", "region": "eu-west-1"})
    assert orphan not in session.sweep()
    shown = session.sweep({"region": REGION})
    assert orphan in shown and live not in shown and theirs not in shown
    assert "run %sky sweep --yes" in shown
    assert len(aws_teardown.live_instances(_ec2(stand), [])) >= 3  # showing terminates nothing
    done = session.sweep({"region": REGION}, yes=True)
    assert f"pool sky-orphan00001: removed {orphan}" in done
    assert leftovers(stand, "sky-orphan00001") == NOTHING
    assert leftovers(stand, "sky-livepool001")["instances"] == [live]
    assert leftovers(stand, "sky-theirs00001")["instances"] == [theirs]
    for tag in ("sky-livepool001", "sky-theirs00001"):
        aws_teardown.teardown_pool(_ec2(stand), tag, poll=0.1)


def test_the_server_reaps_an_orphaned_aws_pool_from_its_record(stand: Ec2Stand, dlami: str) -> None:
    from skyward_jupyter.server.reap import reap

    instance = _orphan(stand, dlami, "sky-reapme00001", "dead@kernel")
    record = {
        "provider": "aws",
        "teardown": {
            "provider": "aws",
            "region": REGION,
            "pool_tag": "sky-reapme00001",
            "instances": [instance],
            "endpoint_url": stand.url,
        },
    }
    report = reap(record)
    assert any(instance in note for note in report.notes), report.notes
    assert leftovers(stand, "sky-reapme00001") == NOTHING


# -------------------------------------------------------------------- end to end, a kernel


DDP_STEP = """\
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
torch.manual_seed(0)
model = DDP(torch.nn.Linear(4, 2))
model(torch.randn(8, 4) * (dist.get_rank() + 1)).sum().backward()
torch.optim.SGD(model.parameters(), lr=0.1).step()
weights = [p.detach().tolist() for p in model.parameters()]
every = [None] * dist.get_world_size()
dist.all_gather_object(every, weights)
(all(w == weights for w in every), dist.get_world_size())
"""


@needs_hosts
def test_sky_provider_aws_in_a_real_kernel(
    stand: Ec2Stand, dlami: str, address_url: str, hosts: Hosts
) -> None:
    from .test_magics import Kernel

    before = len(stand.calls)
    kernel = Kernel()
    try:
        kernel.ok("%load_ext skyward_jupyter")
        resolver = (
            f"NamespaceResolver({stand.url!r}, {[(h.address, h.port) for h in hosts]!r}, "
            f"{str(hosts.known_hosts)!r}, {str(hosts.client_key.parent / 'authorized_keys')!r})"
        )
        kernel.ok(
            "from tests.aws_server import NamespaceResolver\n"
            "get_ipython()._skyward_session.provider_options['aws'] = dict(\n"
            f"    endpoint_url={stand.url!r}, address_url={address_url!r}, poll=0.1,\n"
            f"    resolve={resolver}, reachable_timeout=20, connect_timeout=5)\n"
        )
        cell = kernel.ok(
            f"%%sky --provider aws --nodes 2 --gpu T4 --region {REGION} --python {sys.executable}\n"
            + DDP_STEP
        )
        assert "(True, 2)" in " ".join(cell.shown), str(cell)
        status = kernel.ok("%sky status").stdout
        assert "2 nodes x 1 rank per GPU or CPU, aws us-east-1, T4" in status, status
        tag = kernel.eval("get_ipython()._skyward_session.pools['default'].pool.provider.pool_tag")
        price = kernel.eval(
            "get_ipython()._skyward_session.pools['default'].pool.provider.price_per_hour"
        )
        assert price == pytest.approx(2 * 0.526)
        assert len(leftovers(stand, tag)["instances"]) == 2
        kernel.ok("%sky down")
        assert leftovers(stand, tag) == NOTHING
    finally:
        kernel.km.shutdown_kernel(now=True)
        kernel.kc.stop_channels()
    assert stand.calls_of("RunInstances", before)


def test_pip_packages_reach_every_instance_through_its_ssh_host(
    stand: Ec2Stand, dlami: str, address_url: str, hosts: Hosts
) -> None:
    """``--pip`` on EC2: each instance, once reachable over SSH, builds the environment as an
    SSH host does (the hosts' index: this machine's file index; they have no route out).
    """
    from skyward_jupyter.environments import Packages

    provider = AWSProvider(_options(stand, address_url, gpu="T4", resolve=_resolver(stand, hosts)))
    packages = Packages(("--index-url=file:///opt/pypi/simple", "tabulate"))
    with Pool(nodes=2, provider=provider, heartbeat_timeout=10, packages=packages) as pool:
        assert pool.run("import tabulate\ntabulate.__name__").values == ["tabulate"] * 2
        assert sorted(pool.environments) == [0, 1]
        assert all(e.packages == 1 for e in pool.environments.values())
    assert leftovers(stand, provider.pool_tag) == NOTHING

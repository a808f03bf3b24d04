"""Ending AWS pools by tag: a pool is whatever carries its ``skyward:pool`` tag.

Every piece a pool creates (instances, their volumes, the key pair, the security group, the
placement group) is tagged with the pool, its owner and its creation time. So ending a pool
needs only its tag and a region: the provider at release, the server's reaper after the kernel
died, and ``%sky sweep`` for pools no live notebook owns all come here. Teardown waits until
everything is gone; what it could not delete is raised, never swallowed.
"""

from __future__ import annotations

import functools
import getpass
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from botocore.exceptions import BotoCoreError, ClientError

from .aws_client import clients, error_code, error_message
from .base import ProviderError

if TYPE_CHECKING:
    from mypy_boto3_ec2 import EC2Client
    from mypy_boto3_ec2.type_defs import InstanceTypeDef

TAG_POOL = "skyward:pool"
TAG_OWNER = "skyward:owner"
TAG_CREATED = "skyward:created"
TAG_NAME = "skyward:name"
_LIVE_STATES = ["pending", "running", "stopping", "stopped", "shutting-down"]


def default_owner() -> str:
    """The ``skyward:owner`` of this notebook's pools: ``user@hostname``."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


def pool_tags(pool_tag: str, owner: str, created: str, pool_name: str) -> dict[str, str]:
    """The tags every resource of a pool carries (``Name`` is what the EC2 console shows)."""
    return {
        TAG_POOL: pool_tag,
        TAG_OWNER: owner,
        TAG_CREATED: created,
        TAG_NAME: pool_name,
        "Name": f"skyward-{pool_name}",
    }


def _tag_filter(pool_tag: str) -> list[Any]:
    return [{"Name": f"tag:{TAG_POOL}", "Values": [pool_tag]}]


def live_instances(ec2: EC2Client, filters: Sequence[Any]) -> list[InstanceTypeDef]:
    """The instances matching ``filters`` that are not terminated yet."""
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
    and wait until they are gone. Returns what was removed; raises what could not be.
    """
    removed: list[str] = []
    failures: list[str] = []
    deadline = time.monotonic() + timeout

    def attempt(what: str, call: Callable[[], object]) -> bool:
        try:
            call()
        except (ClientError, BotoCoreError) as exc:  # collected and raised below
            failures.append(f"{what}: {error_message(exc)}")
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
                if error_code(exc) != "DependencyViolation" or time.monotonic() > deadline:
                    failures.append(f"delete security group {group_id}: {error_message(exc)}")
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
    """An instance of this product whose pool no live notebook owns."""

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


def sweep(ec2: EC2Client, region: str, live_pools: set[str], owner: str | None, yes: bool) -> str:
    """``%sky sweep``: list the orphans (of ``owner``; None: anyone's), or with ``yes`` end
    their pools whole (instances, key pairs, security and placement groups).
    """
    orphans = find_orphans(ec2, live_pools, owner)
    whose = "anyone's" if owner is None else owner
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

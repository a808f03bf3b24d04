"""What ``--gpu NAME`` means on EC2, and what an instance costs: bundled data, no API needed.

The GPU table maps a GPU model (as EC2's ``GpuInfo`` names it, with a memory size where one
model comes in two) to the instance types that carry it, smallest first, with the number of
GPUs each has. ``--gpu T4`` picks the smallest (one GPU per node); ``--instance-type`` picks
another. ``--gpu`` is read by model (``NVIDIA H200`` is H200, ``A100-80GB`` the 80 GB A100), and
the provider checks the choice against ``describe_instance_types`` in the region (the type exists
there and carries that GPU), so this table only has to be right about names.

On-demand prices are a dated snapshot of AWS's public price list (Linux, shared tenancy, USD per
hour) for the regions people mostly train in; AWS's pricing API is not used because it needs
separate permissions and is slow. A region or type missing here has no price: the panel then
shows none rather than a guess. Spot prices come from ``describe_spot_price_history`` at launch.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..gpus import gpu_memory, same_gpu

if TYPE_CHECKING:
    from mypy_boto3_ec2 import EC2Client


@dataclass(frozen=True, slots=True)
class InstanceChoice:
    instance_type: str
    gpus: int


GPU_TYPES: Mapping[str, tuple[InstanceChoice, ...]] = {
    "T4": (
        InstanceChoice("g4dn.xlarge", 1),
        InstanceChoice("g4dn.12xlarge", 4),
        InstanceChoice("g4dn.metal", 8),
    ),
    "A10G": (
        InstanceChoice("g5.xlarge", 1),
        InstanceChoice("g5.12xlarge", 4),
        InstanceChoice("g5.48xlarge", 8),
    ),
    "L4": (
        InstanceChoice("g6.xlarge", 1),
        InstanceChoice("g6.12xlarge", 4),
        InstanceChoice("g6.48xlarge", 8),
    ),
    "L40S": (
        InstanceChoice("g6e.xlarge", 1),
        InstanceChoice("g6e.12xlarge", 4),
        InstanceChoice("g6e.48xlarge", 8),
    ),
    "RTX PRO 4500": (
        InstanceChoice("g7.2xlarge", 1),
        InstanceChoice("g7.12xlarge", 2),
        InstanceChoice("g7.24xlarge", 4),
        InstanceChoice("g7.48xlarge", 8),
    ),
    "RTX PRO 6000": (  # EC2 says "RTX PRO Server 6000"
        InstanceChoice("g7e.2xlarge", 1),
        InstanceChoice("g7e.12xlarge", 2),
        InstanceChoice("g7e.24xlarge", 4),
        InstanceChoice("g7e.48xlarge", 8),
    ),
    "V100": (InstanceChoice("p3dn.24xlarge", 8),),  # EC2 no longer lists the smaller p3
    "A100": (InstanceChoice("p4d.24xlarge", 8),),  # 40 GB
    "A100 80GB": (InstanceChoice("p4de.24xlarge", 8),),
    "H100": (InstanceChoice("p5.4xlarge", 1), InstanceChoice("p5.48xlarge", 8)),
    "H200": (InstanceChoice("p5en.48xlarge", 8), InstanceChoice("p5e.48xlarge", 8)),
    "B200": (InstanceChoice("p6-b200.48xlarge", 8),),
    "B300": (InstanceChoice("p6-b300.48xlarge", 8),),
}
CPU_TYPE = "m5.xlarge"
"""Without ``--gpu``: 4 vCPUs, 16 GiB, a general-purpose type offered in every region."""

PRICES_AS_OF = datetime.date(2025, 6, 1)
_US_EAST_1: dict[str, float] = {
    "m5.xlarge": 0.192,
    "g4dn.xlarge": 0.526,
    "g4dn.12xlarge": 3.912,
    "g4dn.metal": 7.824,
    "g5.xlarge": 1.006,
    "g5.12xlarge": 5.672,
    "g5.48xlarge": 16.288,
    "g6.xlarge": 0.8048,
    "g6.12xlarge": 4.6016,
    "g6.48xlarge": 13.3504,
    "g6e.xlarge": 1.861,
    "g6e.12xlarge": 10.493,
    "g6e.48xlarge": 30.131,
    "p3dn.24xlarge": 31.212,
    "p4d.24xlarge": 32.7726,
    "p5.48xlarge": 55.04,
}
ON_DEMAND_USD_PER_HOUR: Mapping[str, Mapping[str, float]] = {
    "us-east-1": _US_EAST_1,
    "us-east-2": _US_EAST_1,  # the same list prices as us-east-1
    "us-west-2": _US_EAST_1,
    "eu-west-1": {
        "m5.xlarge": 0.214,
        "g4dn.xlarge": 0.587,
        "g4dn.12xlarge": 4.362,
        "g5.xlarge": 1.123,
        "g5.12xlarge": 6.332,
        "g6.xlarge": 0.8976,
        "p4d.24xlarge": 35.3928,
    },
}


def gpu_choices(gpu: str) -> tuple[InstanceChoice, ...]:
    """The types carrying ``gpu``, read by model: a memory size picks that model's variant
    (``A100 80GB``), without one the model's first entry (``A100``).
    """
    matches = [name for name in GPU_TYPES if same_gpu(gpu, name)]
    exact = [name for name in matches if gpu_memory(name) == gpu_memory(gpu)]
    found = exact or matches
    return GPU_TYPES[found[0]] if found else ()


def choose_type(gpu: str | None, instance_type: str | None) -> InstanceChoice:
    """The instance type for ``--gpu``/``--instance-type``; ValueError names what is known."""
    if instance_type:
        if gpu:
            known = {c.instance_type: c for c in gpu_choices(gpu)}
            if instance_type in known:
                return known[instance_type]
        return InstanceChoice(instance_type, 0)  # the GPU count is read from EC2
    if gpu is None:
        return InstanceChoice(CPU_TYPE, 0)
    choices = gpu_choices(gpu)
    if not choices:
        raise ValueError(
            f"no EC2 instance type in the bundled catalog carries GPU {gpu!r} (it has "
            f"{', '.join(GPU_TYPES)}); pass --instance-type TYPE for another"
        )
    return choices[0]


def on_demand_price(region: str, instance_type: str) -> float | None:
    """USD per hour from the bundled table (as of :data:`PRICES_AS_OF`); None when unknown."""
    return ON_DEMAND_USD_PER_HOUR.get(region, {}).get(instance_type)


def spot_price(ec2: EC2Client, instance_type: str, zone: str | None = None) -> float | None:
    """The newest spot price of ``instance_type`` (in ``zone``, else the cheapest zone)."""
    now = datetime.datetime.now(datetime.timezone.utc)
    history = ec2.describe_spot_price_history(
        InstanceTypes=[instance_type],  # type: ignore[list-item]
        ProductDescriptions=["Linux/UNIX", "Linux/UNIX (Amazon VPC)"],
        StartTime=now,
        MaxResults=100,
    )["SpotPriceHistory"]
    newest: dict[str, tuple[datetime.datetime, float]] = {}
    for item in history:
        az, at, price = (
            item.get("AvailabilityZone", ""),
            item.get("Timestamp"),
            item.get("SpotPrice"),
        )
        if at is None or price is None or (zone and az != zone):
            continue
        if az not in newest or at > newest[az][0]:
            newest[az] = (at, float(price))
    return min((p for _, p in newest.values()), default=None)

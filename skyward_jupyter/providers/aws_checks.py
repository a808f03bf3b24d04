"""What is checked before a pool creates anything in EC2: the region, the instance type (and
its GPU), the image, and the address range SSH is opened to.

Each check fails with a :class:`ProviderError` that names the option to change, so a typo costs
a message rather than a half-created pool that has to be torn down.
"""

from __future__ import annotations

import ipaddress
import urllib.request
from typing import TYPE_CHECKING, Any, cast

from botocore.exceptions import ClientError, EndpointConnectionError

from ..gpus import same_gpu
from .aws_client import error_code
from .base import ProviderError

if TYPE_CHECKING:
    from mypy_boto3_ec2 import EC2Client
    from mypy_boto3_ssm import SSMClient

DLAMI_PARAMETER = (
    "/aws/service/deeplearning/ami/x86_64/"
    "oss-nvidia-driver-gpu-pytorch-2.11-ubuntu-24.04/latest/ami-id"
)
"""AWS's public parameter naming the newest build of the Deep Learning AMI "OSS Nvidia Driver AMI
GPU PyTorch 2.11 (Ubuntu 24.04)" (GPU and CPU types). The name follows AWS's rule: the AMI's
name without "deep", "learning" and "ami"; a newer PyTorch line needs this updated, or ``--ami``."""
ADDRESS_URL = "https://checkip.amazonaws.com"
"""Where this notebook learns its public address (the default ``--ssh-cidr``)."""


def check_region(ec2: EC2Client, region: str) -> None:
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
            f"region {region} is not enabled for your account; enable it or pick another --region"
        )


def check_type(ec2: EC2Client, region: str, instance_type: str, gpu: str | None) -> None:
    """The type exists, is offered in ``region``, and carries ``gpu`` when one was asked for."""
    t = instance_type
    try:
        info = ec2.describe_instance_types(InstanceTypes=cast(Any, [t]))["InstanceTypes"]
    except ClientError as exc:
        if error_code(exc) in ("InvalidInstanceType", "InvalidParameterValue"):
            raise ProviderError(f"instance type {t!r} does not exist in EC2") from None
        raise
    offered = ec2.describe_instance_type_offerings(
        LocationType="region", Filters=[{"Name": "instance-type", "Values": [t]}]
    ).get("InstanceTypeOfferings", [])
    if not info or not offered:
        raise ProviderError(f"instance type {t} is not offered in {region}; try another --region")
    gpus = info[0].get("GpuInfo", {}).get("Gpus", [])
    names = [_named(g) for g in gpus]
    if gpu and not any(same_gpu(gpu, n) for n in names):
        has = f"has {', '.join(names)}" if names else "has no GPU"
        raise ProviderError(f"--gpu {gpu} with --instance-type {t}: that type {has}")


def _named(gpu: Any) -> str:
    """EC2's name for a GPU with its memory (``A100 80GB``): the model alone does not tell the
    80 GB A100 from the 40 GB one.
    """
    mib = gpu.get("MemoryInfo", {}).get("SizeInMiB")
    return f"{gpu.get('Name', '')} {round(mib / 1024)}GB" if mib else str(gpu.get("Name", ""))


def find_ami(ec2: EC2Client, ssm: SSMClient, region: str, ami: str | None) -> str:
    """``ami``, or the newest Deep Learning AMI, once EC2 confirms it exists in ``region``."""
    if ami is None:
        try:
            ami = ssm.get_parameter(Name=DLAMI_PARAMETER)["Parameter"].get("Value", "")
        except ClientError as exc:
            if error_code(exc) != "ParameterNotFound":
                raise
            raise ProviderError(
                f"AMI not found: AWS's public parameter {DLAMI_PARAMETER} does not exist in "
                f"{region}; pass --ami with a PyTorch image there"
            ) from None
    try:
        images = ec2.describe_images(ImageIds=[ami]).get("Images", [])
    except ClientError as exc:
        if not error_code(exc).startswith("InvalidAMIID"):
            raise
        images = []
    if not images:
        raise ProviderError(f"AMI {ami} not found in {region}; pass --ami with an image there")
    return ami


def public_cidr(url: str, timeout: float = 5.0) -> str:
    """This notebook's public address as a /32, asked of ``url`` (the default ``--ssh-cidr``)."""
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
    """``--ssh-cidr`` as a network; never the whole internet."""
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

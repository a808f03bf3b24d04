"""Reaching AWS: a boto3 session from the usual credential chain, the EC2 and SSM clients, and
AWS's errors read back into words a user can act on.

Kept apart from the provider because the server's reaper and ``%sky sweep`` need clients too,
long after the provider that made a pool is gone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from botocore.exceptions import ClientError

from .base import ProviderError

if TYPE_CHECKING:
    import boto3
    from mypy_boto3_ec2 import EC2Client
    from mypy_boto3_ssm import SSMClient

CAPACITY = {
    "InsufficientInstanceCapacity",
    "InsufficientCapacity",
    "InsufficientHostCapacity",
    "InsufficientReservedInstanceCapacity",
    "SpotMaxPriceTooLow",
    "MaxSpotInstanceCountExceeded",
}
"""Error codes that mean AWS has no room for the request now (spot falls back to on-demand)."""
QUOTA = {"VcpuLimitExceeded", "InstanceLimitExceeded", "MaxSpotInstanceCountExceeded"}
"""Error codes that mean the account's quota is too small for the request."""


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
    """EC2 and SSM clients for ``region`` (None: the configured one), and that region's name."""
    from botocore.config import Config

    session = boto_session(region)
    config = Config(
        retries={"mode": "standard", "max_attempts": 3}, connect_timeout=10, read_timeout=60
    )
    ec2 = session.client("ec2", endpoint_url=endpoint_url, config=config)
    ssm = session.client("ssm", endpoint_url=endpoint_url, config=config)
    return ec2, ssm, str(session.region_name)


def error_code(exc: BaseException) -> str:
    """AWS's code for a failed call (``InvalidAMIID.NotFound``); empty for any other error."""
    if isinstance(exc, ClientError):
        return str(exc.response.get("Error", {}).get("Code", ""))
    return ""


def error_message(exc: BaseException) -> str:
    """AWS's message for a failed call, without botocore's wrapping."""
    if isinstance(exc, ClientError):
        return str(exc.response.get("Error", {}).get("Message", exc))
    return str(exc)


def explain(exc: BaseException, instance_type: str, region: str | None) -> str:
    """What a failed pool start means and what to do about it (quota, capacity, permissions)."""
    code, text = error_code(exc), error_message(exc)
    where = f"{instance_type} in {region}"
    if code in QUOTA:
        return (
            f"your account's quota does not allow {where} ({code}: {text}); request an "
            "increase under Service Quotas > Amazon EC2 (e.g. 'Running On-Demand G and VT "
            "instances'), or use fewer or smaller instances"
        )
    if code in CAPACITY:
        return (
            f"AWS has no capacity for {where} right now ({code}); try another --region, "
            "another --instance-type, or later"
        )
    if code in ("AuthFailure", "UnauthorizedOperation", "InvalidClientTokenId"):
        return (
            f"AWS refused the request in {region} ({code}): {text}; check your "
            "credentials and IAM permissions"
        )
    return f"AWS ({region}) {code}: {text}"

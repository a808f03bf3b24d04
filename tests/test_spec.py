"""A pool's description: what a replacement message says changed, and the provider's part."""

from __future__ import annotations

import pytest

from skyward_jupyter.gpus import LayoutError
from skyward_jupyter.providers.aws import AWSOptions
from skyward_jupyter.providers.base import ProviderError
from skyward_jupyter.providers.ray import RayOptions
from skyward_jupyter.providers.slurm import SlurmOptions
from skyward_jupyter.providers.ssh import SSHOptions
from skyward_jupyter.session import Session
from skyward_jupyter.spec import PoolSpec, SpecError, backend_problem


def test_a_replacement_names_only_what_changed() -> None:
    two = PoolSpec(nodes=2)
    assert two.differences(PoolSpec(nodes=2, env=(("A", "1"),))) == "--env (default) -> A=1"
    assert two.differences(PoolSpec(nodes=3, gpu="T4")) == "--nodes 2 -> 3, --gpu (default) -> T4"
    assert two.differences(PoolSpec(nodes=2)) == "nothing"
    secret = PoolSpec(nodes=2, env=(("HF_TOKEN", "hf_abc"), ("MODE", "fast")))
    assert two.differences(secret) == "--env (default) -> HF_TOKEN=***,MODE=fast"


def test_a_pool_that_did_not_start_names_the_options_given_for_it() -> None:
    """What to give again, as given (``--nodes 2``), not as a change from the defaults."""
    defaults = PoolSpec()
    assert PoolSpec(nodes=2).given_over(defaults) == "--nodes 2"
    secret = PoolSpec(nodes=2, env=(("HF_TOKEN", "hf_abc"),))
    assert secret.given_over(defaults) == "--nodes 2, --env HF_TOKEN=***"
    assert defaults.given_over(defaults) == "the defaults"


def test_each_provider_describes_its_own_pools() -> None:
    assert PoolSpec(nodes=2).describe() == "2 nodes x 1 rank per GPU or CPU, local"
    ssh = PoolSpec(provider="ssh", options=SSHOptions(hosts=("a@h1", "a@h2"))).settled()
    assert ssh.nodes == 2 and ssh.describe().endswith("ssh to a@h1, a@h2")
    aws = PoolSpec(provider="aws", options=AWSOptions(region="us-east-1", spot=True))
    assert aws.describe().endswith("aws us-east-1 spot") and aws.idle_minutes() == 30
    # What a replacement says changed names the provider's options as its flags.
    other = PoolSpec(provider="ssh", options=SSHOptions(hosts=("a@h1",))).settled()
    assert ssh.differences(other) == "--nodes 2 -> 1, --hosts a@h1,a@h2 -> a@h1"
    assert PoolSpec().differences(aws) == (
        "--provider local -> aws, --region (default) -> us-east-1, --spot (default) -> True"
    )
    assert aws.differences(PoolSpec(provider="aws")) == (
        "--region us-east-1 -> (default), --spot True -> (default)"
    )


def test_pool_arguments_carry_sync_frameworks_and_the_hang_doctors_limits() -> None:
    from skyward_jupyter.frameworks import TORCH_ONLY, Frameworks

    default = {"sync": ("/nb",), "sync_chosen": False, "frameworks": TORCH_ONLY}
    assert PoolSpec().pool_arguments("/nb", {}) == default
    given = PoolSpec(
        sync=("/a", "/b"),
        sync_cap=1.5,
        heartbeat_timeout=8,
        desync_after=0.5,
        frameworks=("jax",),
        hf_token_env="MY_TOKEN",
    )
    assert given.pool_arguments("/nb", {"MY_TOKEN": "t"}) == {
        "sync": ("/a", "/b"),
        "sync_chosen": True,
        "sync_cap_bytes": int(1.5 * 2**20),
        "heartbeat_timeout": 8,
        "desync_after": 0.5,
        "frameworks": Frameworks(torch=False, jax=True, hf_token_env="MY_TOKEN"),
    }
    no_sync = PoolSpec(no_sync=True, sync=("/a",)).pool_arguments("/nb", {})
    assert no_sync["sync"] == ()


def test_slurm_and_ray_options_make_their_providers() -> None:
    from skyward_jupyter.providers import provider_class

    session = Session()
    spec = session.spec_from({"partition": "gpu", "time": "1:00:00", "slurm_arg": ["--exclusive"]})
    assert spec.provider == "slurm"  # a Slurm option alone chooses the provider
    provider = provider_class("slurm").from_spec(spec, "p", {})
    assert provider.options.partition == "gpu" and provider.options.extra == ("--exclusive",)  # type: ignore[attr-defined]
    assert "--time=1:00:00" in provider._sbatch(2)  # type: ignore[attr-defined]
    ray_spec = session.spec_from({"ray_address": "10.0.0.1:6379"})
    assert ray_spec.provider == "ray"
    assert provider_class("ray").from_spec(ray_spec, "p", {}).address == "10.0.0.1:6379"  # type: ignore[attr-defined]


def test_the_options_given_choose_the_provider_that_takes_them_all() -> None:
    """An option two providers share (``--gpus-per-node``: Slurm's and Ray's) is each one's:
    with one of them it goes to that one, alone it must be told which.
    """
    session = Session()
    spec = session.spec_from({"ray_address": "10.0.0.1:6379", "gpus_per_node": "1"})
    assert spec.provider == "ray" and spec.options == RayOptions("10.0.0.1:6379", 1)
    spec = session.spec_from({"partition": "gpu", "gpus_per_node": "2"})
    assert spec.provider == "slurm" and spec.options.gpus_per_node == 2  # type: ignore[attr-defined]
    with pytest.raises(SpecError, match=r"^--gpus-per-node: an option of the ray, slurm providers"):
        session.spec_from({"gpus_per_node": "1"})
    # The configured provider takes a shared option without being named again.
    session.defaults = session.spec_from({"provider": "slurm", "partition": "gpu"})
    spec = session.spec_from({"gpus_per_node": "1"})
    assert spec.provider == "slurm" and spec.options == SlurmOptions("gpu", gpus_per_node=1)
    with pytest.raises(SpecError) as mixed:
        Session().spec_from({"ray_address": "a:1", "partition": "gpu"})
    assert str(mixed.value) == (
        "no one provider takes --partition, --ray-address (--ray-address is ray's; "
        "--partition is slurm's): give one provider's only"
    )
    with pytest.raises(
        SpecError, match=r"^--provider aws does not take --hosts \(--hosts is ssh's\)"
    ):
        Session().spec_from({"provider": "aws", "hosts": "me@gpu1"})
    with pytest.raises(ProviderError, match=r"^--hosts: bad port in 'me@gpu1:0'"):
        Session().spec_from({"hosts": "me@gpu1:0"})
    with pytest.raises(LayoutError, match="--gpu none asks for CPU ranks, --gpus-per-node 2"):
        Session().spec_from({"gpu": "none", "provider": "ray", "gpus_per_node": "2"})


def test_nccl_is_refused_naming_what_the_ranks_lack() -> None:
    """The cause for each way NCCL cannot run (this machine's torch shows only one of them);
    nothing is said for gloo, a torch that runs it, or a missing torch (named on its own).
    """
    where = "rank 1 (node 1, gpu2)"
    no_nccl = backend_problem("nccl", where, "2.5.1+cpu", False, 0)
    assert no_nccl == (
        "--backend nccl: rank 1 (node 1, gpu2) has torch 2.5.1+cpu, which is built without "
        "NCCL; use --backend gloo, or a CUDA build of torch"
    )
    no_gpu = backend_problem("nccl", where, "2.5.1+cu124", True, 0)
    assert no_gpu == (
        "--backend nccl: rank 1 (node 1, gpu2) has no GPU that torch can use, and NCCL runs on "
        "GPUs only; use --backend gloo"
    )
    assert backend_problem("nccl", where, "2.5.1+cu124", True, 1) is None
    assert backend_problem("gloo", where, "2.5.1+cpu", False, 0) is None
    assert backend_problem(None, where, "2.5.1+cpu", False, 0) is None
    assert backend_problem("nccl", where, None, None, 0) is None

"""A pool's description: what a replacement message says changed, and the provider's part."""

from __future__ import annotations

from skyward_jupyter.spec import PoolSpec, backend_problem


def test_a_replacement_names_only_what_changed() -> None:
    two = PoolSpec(nodes=2)
    assert two.differences(PoolSpec(nodes=2, env=(("A", "1"),))) == "--env (default) -> A=1"
    assert two.differences(PoolSpec(nodes=3, gpu="T4")) == "--nodes 2 -> 3, --gpu (default) -> T4"
    assert two.differences(PoolSpec(nodes=2)) == "nothing"
    secret = PoolSpec(nodes=2, env=(("HF_TOKEN", "hf_abc"), ("MODE", "fast")))
    assert two.differences(secret) == "--env (default) -> HF_TOKEN=***,MODE=fast"


def test_each_provider_describes_its_own_pools() -> None:
    assert PoolSpec(nodes=2).describe() == "2 nodes x 1 rank per GPU or CPU, local"
    ssh = PoolSpec(provider="ssh", hosts=("a@h1", "a@h2")).settled()
    assert ssh.nodes == 2 and ssh.describe().endswith("ssh to a@h1, a@h2")
    aws = PoolSpec(provider="aws", region="us-east-1", spot=True)
    assert aws.describe().endswith("aws us-east-1 spot") and aws.idle_minutes() == 30


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
    from skyward_jupyter.magics import SkyMagics  # noqa: F401 - the option table is complete
    from skyward_jupyter.providers import provider_class
    from skyward_jupyter.session import Session

    session = Session()
    spec = session.spec_from({"partition": "gpu", "time": "1:00:00", "slurm_args": ["--exclusive"]})
    assert spec.provider == "slurm"  # a Slurm option alone chooses the provider
    provider = provider_class("slurm").from_spec(spec, "p", {})
    assert provider.options.partition == "gpu" and provider.options.extra == ("--exclusive",)  # type: ignore[attr-defined]
    assert "--time=1:00:00" in provider._sbatch(2)  # type: ignore[attr-defined]
    ray_spec = session.spec_from({"ray_address": "10.0.0.1:6379"})
    assert ray_spec.provider == "ray"
    assert provider_class("ray").from_spec(ray_spec, "p", {}).address == "10.0.0.1:6379"  # type: ignore[attr-defined]


def test_nccl_is_refused_naming_what_the_ranks_lack() -> None:
    """The cause for each way NCCL cannot run (this machine's torch shows only one of them);
    nothing is said for gloo, a torch that runs it, or a missing torch (named on its own)."""
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

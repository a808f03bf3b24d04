"""GPUs as the machines report them: names compared by model, layouts the GPUs can carry, a CPU
pool on a GPU machine, and NCCL layouts refused before anything starts.

This machine has no GPU. Where a test needs one, a stand-in ``nvidia-smi`` on ``PATH`` prints
what the real one prints on a machine with one H200 (the same queries, the same format): it
exercises how the pool reads and lays out GPUs, nothing more. The ranks still run here, on CPUs;
what needs a real GPU (NCCL) is in ``scripts/gpu_check.py``, run on a GPU machine.
"""

from __future__ import annotations

import argparse
import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import pytest

from skyward_jupyter import Pool
from skyward_jupyter.gpus import (
    NO_GPU,
    LayoutError,
    check_gpu_layout,
    gpu_model,
    lay_out,
    parse_gpu,
    same_gpu,
)
from skyward_jupyter.options import POOL_OPTIONS
from skyward_jupyter.providers import provider_class
from skyward_jupyter.providers.base import ProviderError
from skyward_jupyter.providers.local import LocalProvider, split_gpus, visible_gpus
from skyward_jupyter.providers.slurm import SlurmOptions, check_gres_gpu
from skyward_jupyter.providers.ssh import Host, check_host_gpu
from skyward_jupyter.session import PoolEntry, Session, _serves
from skyward_jupyter.spec import PoolSpec

from .conftest import agent_pids, wait_for
from .hosts import available, ssh_hosts, ssh_provider
from .slurm_cluster import available as slurm_available
from .slurm_cluster import slurm_cluster
from .test_magics import Kernel, normalised

ROOT = Path(__file__).resolve().parents[1]

# What nvidia-smi prints for the pool's queries on a machine with one H200 (driver 570+).
FAKE_NVIDIA_SMI = """#!/bin/sh
case "$*" in
  *--query-gpu=index,name*) echo "0, NVIDIA H200" ;;
  *--query-gpu=name*) echo "NVIDIA H200" ;;
  *) echo "unexpected query: $*" >&2; exit 2 ;;
esac
"""

REPORTED = {
    # nvidia-smi --query-gpu=name, Slurm GRES types and EC2 GpuInfo names of current machines
    "NVIDIA H200": "H200",
    "NVIDIA H100 80GB HBM3": "H100",
    "NVIDIA H100 PCIe": "H100",
    "NVIDIA A100-SXM4-80GB": "A100",
    "NVIDIA GH200 480GB": "GH200",
    "NVIDIA B200": "B200",
    "NVIDIA GeForce RTX 4090": "RTX 4090",
    "NVIDIA RTX A6000": "RTX A6000",
    "NVIDIA RTX 6000 Ada Generation": "RTX 6000 ADA",
    "NVIDIA L40S": "L40S",
    "Tesla V100-SXM2-16GB": "V100",
    "Tesla T4": "T4",
    "nvidia_h100_80gb_hbm3": "H100",
    "RTX PRO Server 6000": "RTX PRO 6000",
}


@pytest.fixture
def one_h200(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A stand-in ``nvidia-smi`` for one H200 first on PATH, for this process and its
    children (kernels started in the test).
    """
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir()
    smi.write_text(FAKE_NVIDIA_SMI)
    smi.chmod(smi.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{smi.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    yield smi.parent


def _local(spec: PoolSpec) -> LocalProvider:
    """The local provider for ``spec``, checked first as the session checks it."""
    local = provider_class("local")
    local.check(spec.settled())
    provider = local.from_spec(spec.settled(), "default", {})
    assert isinstance(provider, LocalProvider)
    return provider


# ------------------------------------------------------------------------------- names


def test_any_gpu_name_a_machine_reports_is_accepted_and_compared_by_model() -> None:
    for reported, model in REPORTED.items():
        assert gpu_model(reported) == model, reported
        assert same_gpu(model, reported) and same_gpu(reported, reported), reported
        assert parse_gpu(reported) == reported  # no list of known GPUs refuses it
    assert same_gpu("h200", "NVIDIA H200") and same_gpu("4090", "NVIDIA GeForce RTX 4090")
    assert same_gpu("A100-80GB", "NVIDIA A100-SXM4-80GB")
    assert not same_gpu("A100-80GB", "NVIDIA A100-SXM4-40GB")  # memory, where both say it
    assert not same_gpu("H200", "NVIDIA GH200 480GB") and not same_gpu("H100", "NVIDIA H200")
    assert parse_gpu("none") == parse_gpu("CPU") == NO_GPU
    with pytest.raises(ValueError, match="expected a GPU model"):
        parse_gpu("H100;rm")
    # The option itself takes them (the magics' parser is built from this table).
    parser = argparse.ArgumentParser(exit_on_error=False)
    next(o for o in POOL_OPTIONS if o.flag == "--gpu").add_to(parser)
    assert parser.parse_args(["--gpu", "NVIDIA H200"]).gpu == "NVIDIA H200"
    assert parser.parse_args(["--gpu", "B200"]).gpu == "B200"


def test_local_gpu_is_checked_by_model_against_what_nvidia_smi_reports(one_h200: Path) -> None:
    assert visible_gpus() == (("0",), "NVIDIA H200")
    for asked in ("H200", "h200", "NVIDIA H200"):
        _local(PoolSpec(gpu=asked))  # accepted: this machine's GPU
    with pytest.raises(ProviderError, match="--gpu A100: this machine's GPUs are NVIDIA H200; "):
        _local(PoolSpec(gpu="A100"))


def test_ssh_and_slurm_gpus_are_checked_by_model() -> None:
    host = Host("gpu1", "alice")
    check_host_gpu(host, "NVIDIA H200", "H200")
    check_host_gpu(host, "NVIDIA GeForce RTX 4090", "RTX 4090")
    with pytest.raises(ProviderError, match="alice@gpu1 has NVIDIA A100-SXM4-80GB; pass --gpu"):
        check_host_gpu(host, "NVIDIA A100-SXM4-80GB", "H200")
    with pytest.raises(ProviderError, match="alice@gpu1 reports no GPU"):
        check_host_gpu(host, None, "H200")
    # scontrol show node -o: Gres=gpu:<type>:<count>(S:<sockets>)
    assert check_gres_gpu("n1", "gpu:nvidia_h200:8(S:0-1)", "H200") == "H200"
    assert check_gres_gpu("n1", "gpu:h100:4(S:0),shard:h100:16", "NVIDIA H100 80GB HBM3") == "H100"
    assert check_gres_gpu("n1", "gpu:4", "B200") is None  # no type: the model cannot be told
    with pytest.raises(ProviderError, match="slurm node n1 has a100 "):
        check_gres_gpu("n1", "gpu:a100:8", "H200")
    with pytest.raises(ProviderError, match="slurm node n1 has no GPU"):
        check_gres_gpu("n1", "(null)", "H200")
    slurm = provider_class("slurm")
    with pytest.raises(ProviderError, match="--gpu H200 on slurm: pass --gpus-per-node N"):
        slurm.from_spec(PoolSpec(provider="slurm", gpu="H200"), "default", {})
    with pytest.raises(LayoutError, match="would run 4 NCCL ranks on 2 GPUs"):
        slurm.from_spec(
            PoolSpec(
                provider="slurm",
                gpu="H200",
                procs_per_node=4,
                options=SlurmOptions(gpus_per_node=2),
            ),
            "d",
            {},
        )


@pytest.mark.skipif(available() is not None, reason=str(available()))
def test_ssh_hosts_gpu_is_checked_by_model_before_any_rank_starts(
    one_h200: Path, tmp_path: Path
) -> None:
    """A real sshd host whose ``nvidia-smi`` (the stand-in, through a ``--python`` wrapper that
    puts it on PATH) reports an H200.
    """
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nPATH="{one_h200}:$PATH" exec {sys.executable} "$@"\n')
    python.chmod(0o755)
    with ssh_hosts(1, tmp_path / "hosts", private=False) as hosts:
        before = agent_pids()
        with pytest.raises(
            ProviderError, match=r"--gpu A100: root@\S+ has NVIDIA H200; pass --gpu H200"
        ):
            Pool(provider=ssh_provider(hosts, 1, tmp_path, python=str(python), gpu="A100")).start()
        crowded = ssh_provider(hosts, 1, tmp_path, python=str(python), gpu="H200")
        with pytest.raises(LayoutError, match="would run 2 NCCL ranks on 1 GPU"):
            Pool(procs_per_node=2, provider=crowded, gpu="H200").start()
        assert agent_pids() <= before, "a rank started for a layout NCCL cannot run"
        for asked in ("H200", "NVIDIA H200"):
            provider = ssh_provider(hosts, 1, tmp_path, python=str(python), gpu=asked)
            with Pool(provider=provider, gpu=asked) as pool:
                assert [n.gpu_type for n in pool.nodes] == ["NVIDIA H200"]
                assert pool.run("1 + 1").values == [2]


@pytest.mark.skipif(slurm_available() is not None, reason=str(slurm_available()))
def test_slurm_gpu_is_checked_by_model_against_the_nodes_gres(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real slurmctld and slurmd whose node has one GRES GPU typed as sites name them
    (``nvidia_h200``; a device file stands in for the GPU).
    """
    with slurm_cluster(1, tmp_path, gpu_type="nvidia_h200") as cluster:
        for name, value in cluster.env().items():
            monkeypatch.setenv(name, value)

        def provider(gpu: str) -> object:
            options = SlurmOptions(gpus_per_node=1, python=sys.executable)
            spec = PoolSpec(provider="slurm", gpu=gpu, options=options)
            return provider_class("slurm").from_spec(spec, "default", {})

        for asked in ("H200", "NVIDIA H200"):
            with Pool(provider=provider(asked), gpu=asked) as pool:  # type: ignore[arg-type]
                assert [n.gpu_type for n in pool.nodes] == ["H200"]
                assert pool.run("1 + 1").values == [2]
        refused = Pool(provider=provider("A100"), gpu="A100")  # type: ignore[arg-type]
        with pytest.raises(ProviderError, match="--gpu A100: slurm node node0 has nvidia_h200 "):
            refused.start()
        refused.close()
        wait_for(
            lambda: not subprocess.run(["squeue", "-h"], capture_output=True, text=True).stdout,
            15,
            "the refused pool's job to leave the queue",
        )


# ------------------------------------------------------------------------------ layouts


def test_uneven_local_splits_run_the_layout_they_can() -> None:
    assert split_gpus(("0", "1", "2", "3"), 2) == ([("0", "1"), ("2", "3")], "")
    assert split_gpus((), 3) == ([(), (), ()], "")
    shares, note = split_gpus(("0", "1", "2"), 2)
    assert shares == [("0",), ("1",)] and "GPU 2 unused" in note
    shares, note = split_gpus(("0",), 2)
    assert shares == [(), ()]
    assert note.startswith("1 GPU cannot be split across 2 local nodes: the ranks run on CPUs")


def test_nccl_layouts_with_more_ranks_than_gpus_are_refused_naming_the_fix() -> None:
    with pytest.raises(LayoutError) as refused:
        check_gpu_layout([1], 2, "nccl", None)
    assert str(refused.value) == (
        "--backend nccl: node would run 2 NCCL ranks on 1 GPU (NCCL needs a GPU for each "
        "rank); use --backend gloo, or at most 1 per node (--procs-per-node 1)"
    )
    with pytest.raises(LayoutError, match=r"--gpu H200 \(NCCL, a GPU per rank\): node 1 would"):
        check_gpu_layout([2, 1], 2, None, "H200")
    check_gpu_layout([1], 2, "gloo", "H200")  # gloo shares a GPU: asked for
    check_gpu_layout([2, 2], None, "nccl", None)
    # No backend chosen: the crowded node's ranks go to CPUs, with gloo, said in one line.
    layout = lay_out([1], 2, None, None)
    assert (layout.ranks, layout.cpu_nodes, layout.backend) == ((2,), frozenset({0}), "gloo")
    assert "\n" not in layout.note and "2 ranks on 1 GPU" in layout.note
    assert lay_out([8, 8], None, None, None).backend is None  # one rank per GPU: NCCL stands
    mixed = lay_out([2, 0], None, None, None)  # hosts with and without GPUs: one backend, gloo
    assert (mixed.ranks, mixed.cpu_nodes, mixed.backend) == ((2, 1), frozenset(), "gloo")
    assert mixed.note.startswith("some nodes have no GPU: the pool uses gloo")
    assert lay_out([1, 1], None, None, NO_GPU).cpu_nodes == {0, 1}


def test_local_nccl_layouts_are_refused_before_the_running_pool_is_touched(
    one_h200: Path,
) -> None:
    with pytest.raises(LayoutError, match="1 GPU cannot give each of 2 local nodes one"):
        _local(PoolSpec(nodes=2, backend="nccl"))
    with pytest.raises(LayoutError, match="--gpu H200: this machine's 1 GPU cannot give each"):
        _local(PoolSpec(nodes=2, gpu="H200"))
    with pytest.raises(LayoutError, match="local node would run 2 NCCL ranks on 1 GPU"):
        _local(PoolSpec(procs_per_node=2, backend="nccl"))
    with pytest.raises(LayoutError, match="--gpu none --backend nccl"):
        PoolSpec(gpu=NO_GPU, backend="nccl")
    _local(PoolSpec(nodes=2))  # no backend asked: it runs on CPUs (below)
    _local(PoolSpec(procs_per_node=2, backend="gloo"))


def test_pool_refuses_nccl_on_a_crowded_gpu_before_any_rank_starts() -> None:
    before = agent_pids()
    pool = Pool(procs_per_node=2, backend="nccl", provider=LocalProvider(gpus=("0",)))
    with pytest.raises(LayoutError, match="would run 2 NCCL ranks on 1 GPU"):
        pool.start()
    pool.close()
    assert agent_pids() <= before, "a rank started for a layout NCCL cannot run"


_SEEN = (
    "import os, torch.distributed as dist\n"
    "(os.environ.get('CUDA_VISIBLE_DEVICES'), os.environ['ACCELERATE_USE_CPU'], "
    "dist.get_backend(), dist.get_world_size())"
)


def test_crowded_gpus_without_a_backend_give_cpu_ranks_and_say_so() -> None:
    provider = LocalProvider(gpus=("0",), gpu_type="NVIDIA H200")
    with Pool(procs_per_node=2, provider=provider) as pool:
        assert pool.run(_SEEN).values == [("", "True", "gloo", 2)] * 2
        assert [n.gpus for n in pool.nodes] == [()]
    [note] = provider.warnings
    assert note.startswith("node 0 runs 2 ranks on 1 GPU: those ranks run on CPUs")


def test_gpu_none_gives_a_cpu_pool_on_a_gpu_machine(one_h200: Path) -> None:
    # One node on a one-GPU machine: without --gpu none its rank would see GPU 0.
    spec = Session().spec_from({"gpu": NO_GPU})
    with Pool(provider=_local(spec), **spec.pool_arguments(str(ROOT), {})) as pool:
        assert pool.run(_SEEN).values == [("", "True", "gloo", 1)]
        assert [n.gpus for n in pool.nodes] == [()]


def test_gpu_none_replaces_a_pool_whose_ranks_chose_nccl() -> None:
    """A cell asking ``--gpu none`` of a warm pool on GPUs (whose ranks chose NCCL) replaces it
    with CPU ranks; the comparison must not fill NCCL into the new description and refuse it
    ("--gpu none --backend nccl"), as it once did on a real GPU. A stand-in for the running
    pool: CPU ranks never choose NCCL.
    """
    session = Session()
    on_gpus = session.spec_from({"gpu": "H200"})
    chose_nccl = SimpleNamespace(group_problem=None, group_backend="nccl", ranks=[_on_node(0)])
    entry = PoolEntry("gpus", on_gpus, cast(Pool, chose_nccl))
    assert not _serves(entry, session.spec_from({"gpu": NO_GPU}))
    assert _serves(entry, session.spec_from({"gpu": "H200", "backend": "nccl"}))


def _on_node(index: int) -> SimpleNamespace:
    return SimpleNamespace(node=index)


def test_two_nodes_on_a_one_gpu_machine_work_and_say_their_layout(one_h200: Path) -> None:
    """The README's first cell on a machine with one GPU, in a real kernel; then a description
    NCCL cannot run is refused in one line, with the working pool left as it was.
    """
    kernel = Kernel()
    try:
        kernel.ok("%load_ext skyward_jupyter")
        imports, seen = _SEEN.splitlines()
        cell = kernel.ok(f"%%sky --nodes 2 --stdout all\n{imports}\nprint(repr({seen}))")
        assert cell.stdout.count("('', 'True', 'gloo', 2)") == 2, str(cell)
        layout = [line for line in cell.stderr.splitlines() if "cannot be split" in line]
        assert layout == [
            "warning: 1 GPU cannot be split across 2 local nodes: the ranks run on CPUs (no GPU "
            "visible) with gloo; --nodes 1 gives each node a GPU"
        ], cell.stderr
        status, pids = normalised(kernel.status()), set(kernel.pool_pids())
        refused = kernel.fails("%%sky --nodes 2 --backend nccl\nprint('THE CELL RAN')")
        assert "1 GPU cannot give each of 2 local nodes one" in refused.reply["evalue"]
        assert "THE CELL RAN" not in refused.stdout
        assert normalised(kernel.status()) == status and set(kernel.pool_pids()) == pids
    finally:
        kernel.close()


def test_gpu_check_script_skips_cleanly_without_cuda() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: run scripts/gpu_check.py itself for its cases")
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_check.py")],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip().splitlines()[-1].startswith("gpu_check: skipped, no CUDA"), done

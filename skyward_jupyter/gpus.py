"""GPUs as the machines report them: their names, and how a pool's ranks are laid out on them.

``--gpu`` takes any name a machine reports (``nvidia-smi``, Slurm's GRES types, EC2's GPU
names): there is no list of known GPUs to fall behind the hardware. Names are compared by model,
so ``H100``, ``NVIDIA H100 80GB HBM3`` and Slurm's ``nvidia_h100_80gb_hbm3`` are one GPU, and a
memory size is compared only where both names carry one (``A100-80GB`` is not ``A100-SXM4-40GB``).

NCCL needs a GPU of its own for every rank (two ranks on one GPU fail every collective with
NCCL's "Duplicate GPU detected"). :func:`lay_out` gives each node its ranks; where a node's ranks
outnumber its GPUs, a pool that chose no backend runs on CPUs with gloo and says so, and a pool
that asked for NCCL (``--backend nccl``, or ``--gpu``) is refused by :func:`check_gpu_layout`
before any rank starts.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from .providers.base import ProviderError

NO_GPU = "none"
"""``--gpu none`` (or ``cpu``): a CPU pool, even on machines with GPUs."""
_NO_GPU_SPELLINGS = frozenset({"none", "cpu"})
_BRANDS = frozenset({"NVIDIA", "TESLA", "GEFORCE", "QUADRO"})
_VARIANT = re.compile(r"\d+GB|HBM\d*E?|PCIE|SXM\d*|NVL|SERVER|EDITION|GENERATION|BLACKWELL")
"""Words naming a card's memory, form factor or edition, not its model."""
_MEMORY = re.compile(r"(\d+)GB")


class LayoutError(ProviderError):
    """Ranks the GPUs cannot carry as asked; the message names the layout and the fix."""


def parse_gpu(text: str) -> str:
    """``--gpu``'s value: any GPU name as written, or :data:`NO_GPU` for ``none``/``cpu``."""
    name = text.strip()
    if name.lower() in _NO_GPU_SPELLINGS:
        return NO_GPU
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9 _.+-]*", name) or not gpu_model(name):
        raise ValueError(
            f"expected a GPU model (H100, NVIDIA H200, RTX 4090, ...) or none, got {text!r}"
        )
    return name


def _words(name: str) -> list[str]:
    return re.split(r"[\s_-]+", name.upper().strip())


def gpu_model(name: str) -> str:
    """The model in a GPU's name, upper case: ``NVIDIA H100 80GB HBM3`` -> ``H100``,
    ``NVIDIA GeForce RTX 4090`` -> ``RTX 4090``, ``nvidia_a100-sxm4-80gb`` -> ``A100``.
    """
    return " ".join(w for w in _words(name) if w and w not in _BRANDS and not _VARIANT.fullmatch(w))


def gpu_memory(name: str) -> int | None:
    """The memory size a GPU's name carries, in GB (``A100-SXM4-80GB`` -> 80), else None."""
    sizes = [int(m.group(1)) for w in _words(name) if (m := _MEMORY.fullmatch(w))]
    return sizes[0] if sizes else None


def same_gpu(asked: str, reported: str) -> bool:
    """Whether the GPU a machine reports is the model asked for: equal models, or the asked
    words ending the reported model (``4090`` for ``RTX 4090``); memory sizes, where both say.
    """
    want, have = gpu_model(asked), gpu_model(reported)
    if not want or not have:
        return False
    joined = want.replace(" ", "") == have.replace(" ", "")
    model = want == have or have.endswith(" " + want) or joined
    memory = gpu_memory(asked), gpu_memory(reported)
    return model and (None in memory or memory[0] == memory[1])


# ---------------------------------------------------------------------------------- layout


@dataclass(frozen=True, slots=True)
class Layout:
    """Where a pool's ranks go on its nodes' GPUs."""

    ranks: tuple[int, ...]
    """Ranks per node."""
    cpu_nodes: frozenset[int]
    """Nodes whose ranks see no GPU (``CUDA_VISIBLE_DEVICES`` empty)."""
    backend: str | None
    """The process group's backend (None: the ranks choose, nccl with CUDA, else gloo)."""
    note: str = ""
    """The one line that tells the user a layout they did not spell out ("" when none)."""


def _ranks(gpus: Sequence[int], procs_per_node: int | None) -> list[int]:
    return [procs_per_node or count or 1 for count in gpus]


def _plural(count: int, word: str) -> str:
    return f"{count} {word}{'s' * (count != 1)}"


def check_cpu_or_gpus(gpu: str | None, gpus: int | None, flag: str) -> None:
    """Refuse ``--gpu none`` (CPU ranks) together with a provider's count of GPUs per node
    (``gpus``, given as its option ``flag``).
    """
    if gpu == NO_GPU and gpus:
        raise LayoutError(
            f"--gpu none asks for CPU ranks, {flag} {gpus} for GPUs: leave out one of them"
        )


def check_gpu_layout(
    gpus: Sequence[int],
    procs_per_node: int | None,
    backend: str | None,
    gpu: str | None,
    where: str = "node",
) -> None:
    """Refuse, before anything starts, a pool asking for NCCL (``--backend nccl``, or ``--gpu``
    without ``--backend gloo``) on which a node would run more ranks than it has GPUs.

    ``gpus`` is each node's GPU count, as the provider knows it; ``where`` names a node in the
    message ("local node"). A node without GPUs is not this check's: ``--gpu`` on it is refused
    by its provider (the machine reports no GPU), NCCL by the ranks' torch.
    """
    if gpu == NO_GPU:
        if backend == "nccl":
            raise LayoutError("--gpu none --backend nccl: NCCL needs GPUs; use --backend gloo")
        return
    if backend != "nccl" and not (gpu and backend is None):
        return
    why = "--backend nccl" if backend == "nccl" else f"--gpu {gpu} (NCCL, a GPU per rank)"
    for index, (count, ranks) in enumerate(zip(gpus, _ranks(gpus, procs_per_node), strict=True)):
        if 0 < count < ranks:
            node = f"{where} {index}" if len(gpus) > 1 else where
            raise LayoutError(
                f"{why}: {node} would run {_plural(ranks, 'NCCL rank')} on "
                f"{_plural(count, 'GPU')} (NCCL needs a GPU for each rank); use --backend gloo, "
                f"or at most {count} per node (--procs-per-node {count})"
            )


def lay_out(
    gpus: Sequence[int], procs_per_node: int | None, backend: str | None, gpu: str | None
) -> Layout:
    """Each node's ranks (``procs_per_node``, else one per GPU, else one) and what they see.

    Raises :class:`LayoutError` where :func:`check_gpu_layout` refuses. A pool that chose no
    backend, on nodes some of whose ranks NCCL cannot carry, runs on gloo; a node whose ranks
    outnumber its GPUs runs them on CPUs (a GPU shared by ranks is ``--backend gloo``'s, asked
    for).
    """
    check_gpu_layout(gpus, procs_per_node, backend, gpu)
    ranks = tuple(_ranks(gpus, procs_per_node))
    if gpu == NO_GPU:
        return Layout(ranks, frozenset(range(len(gpus))), "gloo")
    if backend is not None:
        return Layout(ranks, frozenset(), backend)
    crowded = frozenset(i for i, (c, r) in enumerate(zip(gpus, ranks, strict=True)) if 0 < c < r)
    mixed = any(gpus) and not all(gpus)
    if not crowded and not mixed:
        return Layout(ranks, frozenset(), None)
    if crowded:
        i = min(crowded)
        nodes = f"node {i}" + (f" and {len(crowded) - 1} more" if len(crowded) > 1 else "")
        note = (
            f"{nodes} runs {_plural(ranks[i], 'rank')} on {_plural(gpus[i], 'GPU')}: those ranks "
            f"run on CPUs (no GPU visible) with gloo; --procs-per-node {gpus[i]} gives each rank "
            "a GPU with NCCL, --backend gloo shares the GPUs"
        )
    else:
        note = "some nodes have no GPU: the pool uses gloo (NCCL needs a GPU on every node)"
    return Layout(ranks, crowded, "gloo", note)

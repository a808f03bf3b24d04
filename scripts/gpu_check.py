"""The GPU cases that only a machine with CUDA can check, as a user meets them in a notebook.

``python scripts/gpu_check.py`` (from the repository root) runs each case as cells of a real
Jupyter kernel with ``%load_ext skyward_jupyter``, on the local provider:

1. ``%%sky --nodes N+1`` on a machine with N GPUs (one GPU: two nodes) works, on CPU ranks with
   gloo, and says its layout in one line;
2. ``--procs-per-node N+1 --backend nccl`` is refused before anything starts (the working pool
   and its ranks stay as they were);
3. ``--gpu`` with the name the machine reports (``nvidia-smi``'s, and its model alone) is
   accepted, and a 1-node NCCL pool all-reduces a CUDA tensor;
4. ``--gpu none`` gives CPU ranks (no GPU visible, gloo).

Without CUDA it prints one line saying it skipped, and exits 0 (CI has no GPU). Exits 1 when a
case fails, after running the others.
"""

from __future__ import annotations

import ast
import os
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CELL_TIMEOUT = 300.0


def cuda_gpus() -> int:
    """How many GPUs torch sees here (0 without torch or CUDA)."""
    try:
        import torch
    except ImportError:
        return 0
    return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0


class Notebook:
    """A real kernel in the repository root, with the extension loaded."""

    def __init__(self) -> None:
        from jupyter_client.manager import KernelManager

        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        }
        self.km = KernelManager(kernel_name="python3")
        self.km.start_kernel(cwd=str(ROOT), env=env)
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=60)
        self.cell("%load_ext skyward_jupyter")

    def cell(self, code: str) -> tuple[dict[str, Any], str, str]:
        """Run ``code``: its reply's content, stdout and stderr."""
        out: dict[str, list[str]] = {"stdout": [], "stderr": []}

        def hook(msg: dict[str, Any]) -> None:
            if msg["msg_type"] == "stream":
                out[msg["content"]["name"]].append(msg["content"]["text"])
            elif msg["msg_type"] == "error":
                out["stderr"].append(f"{msg['content']['ename']}: {msg['content']['evalue']}\n")

        reply = self.kc.execute_interactive(code, timeout=CELL_TIMEOUT, output_hook=hook)
        return reply["content"], "".join(out["stdout"]), "".join(out["stderr"])

    def close(self) -> None:
        self.cell("%sky down --all")
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=False)


SEEN = (
    "import os, torch, torch.distributed as dist\n"
    "print(repr((os.environ.get('CUDA_VISIBLE_DEVICES'), torch.cuda.is_available(), "
    "dist.get_backend(), dist.get_world_size())))"
)
ALL_REDUCE = (
    "import torch, torch.distributed as dist\n"
    "t = torch.ones(4, device='cuda') * (dist.get_rank() + 1)\n"
    "dist.all_reduce(t)\n"
    "print(repr((dist.get_backend(), t.device.type, t.tolist())))"
)


def _seen(stdout: str) -> list[tuple[Any, ...]]:
    """The tuples the ranks printed (``--stdout all`` prefixes each line with its rank)."""
    found = []
    for line in stdout.splitlines():
        text = line[line.index("(") :] if "(" in line else ""
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            continue
        if isinstance(value, tuple):
            found.append(value)
    return found


def check(gpus: int, model: str) -> list[tuple[str, Callable[[Notebook], str | None]]]:
    """The cases: each says what went wrong, or None."""
    nodes = gpus + 1

    def default_layout(nb: Notebook) -> str | None:
        reply, stdout, stderr = nb.cell(f"%%sky --nodes {nodes} --stdout all --name gpus\n{SEEN}")
        seen = _seen(stdout)
        if reply["status"] != "ok" or seen != [("", False, "gloo", nodes)] * nodes:
            return f"--nodes {nodes}: {reply['status']}, ranks saw {seen}\n{stdout}{stderr}"
        said = [line for line in stderr.splitlines() if "cannot be split across" in line]
        return None if len(said) == 1 else f"no one-line layout note:\n{stderr}"

    def crowded_nccl(nb: Notebook) -> str | None:
        _, before, _ = nb.cell("%sky status")
        options = f"--nodes 1 --procs-per-node {nodes} --backend nccl --name gpus"
        reply, stdout, stderr = nb.cell(f"%%sky {options}\nprint('THE CELL RAN')")
        _, after, _ = nb.cell("%sky status")
        evalue = str(reply.get("evalue", ""))
        if reply["status"] != "error" or "NCCL ranks on" not in evalue or "THE CELL RAN" in stdout:
            return f"{options} was not refused in one line: {reply['status']} {evalue}\n{stderr}"
        pids = [re.findall(r"local pid (\d+)", status) for status in (before, after)]
        if not pids[0] or pids[0] != pids[1]:
            return f"the refusal changed the pools:\n{before}\n{after}"
        return None

    def named_gpu(nb: Notebook) -> str | None:
        from skyward_jupyter.gpus import gpu_model

        for name in (model, gpu_model(model)):
            reply, stdout, stderr = nb.cell(
                f"%%sky --nodes 1 --gpu '{name}' --name gpus\n{ALL_REDUCE}"
            )
            seen = _seen(stdout)
            want = ("nccl", "cuda", [float(sum(range(1, gpus + 1)))] * 4)
            if reply["status"] != "ok" or seen[:1] != [want]:
                return f"--gpu {name!r}: {reply['status']}, saw {seen}\n{stdout}{stderr}"
        return None

    def cpu_pool(nb: Notebook) -> str | None:
        reply, stdout, stderr = nb.cell(
            f"%%sky --nodes 2 --gpu none --stdout all --name gpus\n{SEEN}"
        )
        seen = _seen(stdout)
        if reply["status"] != "ok" or seen != [("", False, "gloo", 2)] * 2:
            return f"--gpu none: {reply['status']}, ranks saw {seen}\n{stdout}{stderr}"
        return None

    return [
        (
            f"%%sky --nodes {nodes} on {gpus} GPU(s): CPU ranks, gloo, one layout line",
            default_layout,
        ),
        (f"--procs-per-node {nodes} --backend nccl refused before start", crowded_nccl),
        (f"--gpu {model!r} (and its model) accepted; NCCL all_reduce on cuda", named_gpu),
        ("--gpu none: CPU ranks with gloo", cpu_pool),
    ]


def main() -> int:
    gpus = cuda_gpus()
    if not gpus:
        print("gpu_check: skipped, no CUDA on this machine (torch sees no GPU)")
        return 0
    sys.path.insert(0, str(ROOT))
    from skyward_jupyter.providers.local import visible_gpus

    ids, model = visible_gpus()
    if not model:
        print("gpu_check: FAILED, torch sees CUDA but nvidia-smi reports no GPU name")
        return 1
    print(f"gpu_check: {len(ids)} x {model} (torch sees {gpus})")
    nb = Notebook()
    failed = 0
    try:
        for title, case in check(len(ids), model):
            started = time.perf_counter()
            try:
                why = case(nb)
            except (TimeoutError, RuntimeError) as exc:  # a failed case; the others still run
                why = f"{type(exc).__name__}: {exc}"
            took = time.perf_counter() - started
            print(f"{'ok  ' if why is None else 'FAIL'} {title} ({took:.1f} s)")
            if why is not None:
                failed += 1
                print("     " + why.replace("\n", "\n     "))
    finally:
        nb.close()
    print(f"gpu_check: {'all passed' if not failed else f'{failed} failed'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

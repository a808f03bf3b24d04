"""Run a notebook headless in a real Jupyter kernel and print what its cells printed.

The README's main command: ``make demo`` runs ``notebooks/01_quickstart.ipynb`` this way. Exits
non-zero if a cell fails.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import nbformat
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError


def _text(output: nbformat.NotebookNode) -> str:
    if output.get("output_type") == "stream":
        return str(output.get("text", ""))
    data = output.get("data", {})
    return str(data.get("text/plain", "")) + "\n" if data else ""


def execute(path: str, timeout: float = 600) -> nbformat.NotebookNode:
    """The notebook at ``path`` run in a fresh kernel, in its own directory, with its outputs;
    raises CellExecutionError naming the first cell that failed.
    """
    nb = nbformat.read(path, as_version=4)
    # IPC sockets in a private runtime dir: nothing listens on TCP, and the kernel does not warn
    # about unencrypted TCP on every run.
    runtime = tempfile.mkdtemp(prefix="skyward-demo-")
    km = KernelManager(kernel_name="python3", transport="ipc", ip=os.path.join(runtime, "kernel"))
    client = NotebookClient(
        nb,
        km=km,
        timeout=timeout,
        kernel_name="python3",
        resources={"metadata": {"path": str(Path(path).parent)}},
    )
    try:
        client.execute()
    finally:
        if km.has_kernel:
            km.shutdown_kernel()  # a kernel we passed in is ours to end, not nbclient's
        shutil.rmtree(runtime, ignore_errors=True)
    return nb


def main(path: str) -> int:
    started = time.perf_counter()
    try:
        nb = execute(path)
    except CellExecutionError as exc:
        print(exc, file=sys.stderr)
        return 1
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        print(f">>> {cell.source.splitlines()[0]}")
        for output in cell.get("outputs", []):
            print(_text(output), end="")
    print(f"notebook ran in {time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "notebooks/01_quickstart.ipynb"))

"""Run a notebook headless in a real Jupyter kernel and print what its cells printed.

The README's main command: ``make demo`` runs ``notebooks/01_quickstart.ipynb`` this way. Exits
non-zero if a cell fails.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError


def _text(output: nbformat.NotebookNode) -> str:
    if output.get("output_type") == "stream":
        return str(output.get("text", ""))
    data = output.get("data", {})
    return str(data.get("text/plain", "")) + "\n" if data else ""


def main(path: str) -> int:
    nb = nbformat.read(path, as_version=4)
    started = time.perf_counter()
    client = NotebookClient(
        nb,
        timeout=600,
        kernel_name="python3",
        resources={"metadata": {"path": str(Path(path).parent)}},
    )
    try:
        client.execute()
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

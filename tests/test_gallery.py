"""The gallery in ``notebooks/``: each notebook runs headless in a real kernel, as ``make demo``
runs the quickstart, and its results are what the notebook says they are (issue 16).

A notebook's "result" cell (tagged so in ``scripts/make_gallery.py``) shows a dict; with
``--all`` one per rank. The quickstart's result is its training cell's value.
"""

from __future__ import annotations

import ast
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import nbformat
import pytest

from scripts.run_notebook import execute

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
Result = list[dict[str, Any]]


def _plain(cell: nbformat.NotebookNode, *kinds: str) -> str:
    """The text of a cell's outputs of these kinds (streams, displays, its value)."""
    texts = []
    for output in cell.get("outputs", []):
        if output["output_type"] not in kinds:
            continue
        texts.append(output.get("text") or output.get("data", {}).get("text/plain", ""))
    return "".join(texts)


def _values(cell: nbformat.NotebookNode) -> Result:
    """The dict a cell showed as its value, or one per rank (``[rank N] {...}`` lines)."""
    value = _plain(cell, "execute_result").strip()
    if not value.startswith("[rank "):
        return [ast.literal_eval(value)]
    return [ast.literal_eval(line.split("] ", 1)[1]) for line in value.splitlines()]


def result_of(nb: nbformat.NotebookNode) -> Result:
    tagged = [c for c in nb.cells if "result" in c.metadata.get("tags", [])]
    # the quickstart's result is its training cell's value
    cell = tagged[0] if tagged else next(c for c in nb.cells if c.source.startswith("%%sky --n"))
    return _values(cell)


def printed(nb: nbformat.NotebookNode) -> str:
    kinds = ("stream", "display_data", "execute_result")
    return "".join(_plain(c, *kinds) for c in nb.cells if c.cell_type == "code")


def quickstart(result: Result, nb: nbformat.NotebookNode) -> None:
    (value,) = result
    assert value["world_size"] == 2 and value["accuracy"] > 80, value
    assert "True" in printed(nb)  # DDP kept the replicas equal


def fsdp2(result: Result, nb: nbformat.NotebookNode) -> None:
    (value,) = result
    assert value["world_size"] == 2 and value["shard_fraction"] == 0.5
    assert value["same_model_on_every_rank"] is True
    assert value["loss"] < value["first_loss"] / 10, value


def hf_trainer(result: Result, nb: nbformat.NotebookNode) -> None:
    (value,) = result
    assert value["world_size"] == 2 and value["parallel_mode"] == "ParallelMode.DISTRIBUTED"
    assert value["steps"] == 40 and math.isfinite(value["loss"])


def accelerate(result: Result, nb: nbformat.NotebookNode) -> None:
    (value,) = result
    assert value["num_processes"] == 2 and value["distributed_type"] == "DistributedType.MULTI_CPU"
    assert value["batches_per_rank"] == 16 and value["loss"] < 0.5, value
    assert "the pool formed it again" in printed(nb)  # end_training() destroyed the group


def lightning(result: Result, nb: nbformat.NotebookNode) -> None:
    (value,) = result
    assert value["world_size"] == 2 and value["environment"] == "TorchElasticEnvironment"
    assert value["finished"] is True and value["loss"] < 0.5, value


def torchrun_script(result: Result, nb: nbformat.NotebookNode) -> None:
    assert result == [{"world_size": 2, "all_reduce": 2.0}]
    text = printed(nb)
    assert "epoch 2: accuracy" in text and "epoch 1: accuracy" in text
    assert "on 2048 samples from 2 ranks" in text


def jax(result: Result, nb: nbformat.NotebookNode) -> None:
    (value,) = result
    assert (value["processes"], value["devices"], value["psum"]) == (2, 2, 3.0)
    assert value["w"] == [2.0, -3.0, 0.5] and value["b"] == 1.0 and value["loss"] < 1e-3
    assert "2 processes, 2 devices: psum 3.0" in printed(nb)


def keras_jax(result: Result, nb: nbformat.NotebookNode) -> None:
    assert len(result) == 2 and result[0] == result[1]  # one model on both ranks
    assert result[0]["backend"] == "jax" and result[0]["devices"] == 2
    assert result[0]["accuracy"] > 0.9, result  # seeded: the same run every time


GALLERY: dict[str, Callable[[Result, nbformat.NotebookNode], None]] = {
    "01_quickstart": quickstart,
    "02_fsdp2": fsdp2,
    "03_hf_trainer": hf_trainer,
    "04_accelerate": accelerate,
    "05_lightning": lightning,
    "06_torchrun_script": torchrun_script,
    "07_jax": jax,
    "08_keras_jax": keras_jax,
}


def test_every_notebook_is_in_the_gallery() -> None:
    assert sorted(p.stem for p in NOTEBOOKS.glob("*.ipynb")) == sorted(GALLERY)


@pytest.mark.parametrize("name", sorted(GALLERY))
def test_the_notebook_runs_and_shows_its_results(name: str) -> None:
    nb = execute(str(NOTEBOOKS / f"{name}.ipynb"), timeout=300)
    GALLERY[name](result_of(nb), nb)

"""Writes the gallery, notebooks/02_*.ipynb to 08_*.ipynb, from the cells in ``gallery_torch.py``
and ``gallery_jax.py`` (the notebooks are committed too; tests/test_gallery.py runs each headless
and checks its "result" cell).

Keeping the source here makes the notebooks reviewable as code; re-run after editing:
``python scripts/make_gallery.py``.
"""

from __future__ import annotations

from pathlib import Path

import nbformat as nbf
from gallery_cells import Cell
from gallery_jax import JAX
from gallery_torch import TORCH

OUT = Path(__file__).resolve().parents[1] / "notebooks"


def write(name: str, cells: list[Cell]) -> None:
    book = nbf.v4.new_notebook()
    book.metadata = {
        "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
        "language_info": {"name": "python"},
    }
    for kind, text, *tags in cells:
        text = text.strip("\n")
        cell = nbf.v4.new_markdown_cell(text) if kind == "md" else nbf.v4.new_code_cell(text)
        if tags:
            cell.metadata["tags"] = list(tags)
        book.cells.append(cell)
    for i, cell in enumerate(book.cells):
        cell["id"] = f"{name.split('_')[0]}-{i}"
    nbf.write(book, OUT / f"{name}.ipynb")


def main() -> None:
    for name, cells in {**TORCH, **JAX}.items():
        write(name, cells)
        print(f"wrote {OUT / name}.ipynb")


if __name__ == "__main__":
    main()

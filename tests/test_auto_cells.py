"""Which cells ``%sky auto`` sends to the pool: the transformer on its own (the kernel tests in
``test_magics.py`` run it in a real kernel).
"""

from __future__ import annotations

import pytest

from skyward_jupyter.auto_cells import AutoCells


def _lines(cell: str) -> list[str]:
    return cell.splitlines(keepends=True)


@pytest.mark.parametrize(
    "cell",
    [
        "%time f()\n",
        "x = 1\n%matplotlib inline\n",
        "%%timeit\nf()\n",
        "!ls\n",
        "x = 1\nfiles = !ls\n",
        "model?\n",
        "# a note, nothing to run\n\n",
        "",
        "def broken(:\n",
        "%%sky --nodes 2\nx = 1\n",
    ],
)
def test_a_cell_that_is_not_plain_python_with_a_statement_stays_as_it_is(cell: str) -> None:
    auto = AutoCells(shell=None)
    auto.enabled = True
    assert auto(_lines(cell)) == _lines(cell)


def test_plain_cells_go_under_sky_only_while_on_and_local_cells_never() -> None:
    auto = AutoCells(shell=None)
    plain = _lines("import torch\nclass Box:\n    pass\nBox()\n")
    assert auto(plain) == plain
    auto.enabled = True
    assert auto(plain) == ["%%sky\n", *plain]
    local = _lines("%%local\nimport os\nos.getpid()\n")
    assert auto(local) == local[1:]
    auto.enabled = False
    assert auto(local) == local[1:]

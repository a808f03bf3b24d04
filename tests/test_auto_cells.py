"""Which cells ``%sky auto`` sends to the pool: the transformer on its own (the kernel tests in
``test_magics.py`` run it in a real kernel).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from skyward_jupyter.auto_cells import AutoCells


def _lines(cell: str) -> list[str]:
    return cell.splitlines(keepends=True)


SHELL = SimpleNamespace(execution_count=3)
"""A shell as the transformer reads one: the number of the cell it transforms."""


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
    auto = AutoCells(shell=SHELL)
    auto.enabled = True
    assert auto(_lines(cell)) == _lines(cell)


def test_a_sky_cells_syntax_error_is_raised_before_the_magic_runs() -> None:
    """As IPython raises a plain cell's: shown at its line, with no frames above it."""
    with pytest.raises(SyntaxError) as raised:
        AutoCells(shell=SHELL)(_lines("%%sky --nodes 2\nx = 1\ndef broken(:\n"))
    assert (raised.value.filename, raised.value.lineno) == ("<In [3]>", 2)


def test_plain_cells_go_under_sky_only_while_on_and_local_cells_never() -> None:
    auto = AutoCells(shell=SHELL)
    plain = _lines("import torch\nclass Box:\n    pass\nBox()\n")
    assert auto(plain) == plain
    auto.enabled = True
    assert auto(plain) == ["%%sky\n", *plain]
    local = _lines("%%local\nimport os\nos.getpid()\n")
    assert auto(local) == local[1:]
    auto.enabled = False
    assert auto(local) == local[1:]

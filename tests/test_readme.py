"""The README's comparison with its peers: every row names the tests that check what this product
claims in it, and those tests exist (a renamed or removed test fails here, not in a reader's
trust).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SECTION = "## Compared with nbdistributed and ipyparallel"


def _rows() -> list[list[str]]:
    text = (ROOT / "README.md").read_text()
    assert SECTION in text, f"the README has no section {SECTION!r}"
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in line.strip("|").split(" | ")] for line in lines[2:]]


def _tests_in(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}


def test_every_row_names_tests_that_exist() -> None:
    rows = _rows()
    assert len(rows) >= 10, rows
    for row in rows:
        assert len(row) == 5, f"a row of five columns expected: {row}"
        named = re.findall(r"`(tests/[\w/]+\.py)(?:::(\w+))?`", row[4])
        assert named, f"the row {row[0]!r} names no test"
        for file, name in named:
            path = ROOT / file
            if not name:  # a file of tests being written beside this one: named, not checked
                continue
            assert path.is_file(), f"the row {row[0]!r} names {file}, which is not there"
            assert name in _tests_in(path), f"the row {row[0]!r} names {file}::{name}: not there"

"""An honest node's Python for tests and benchmarks: torch, cloudpickle and pip (with what they
need; or without torch), linked from the notebook's venv into a venv of the base interpreter,
and nothing else of the notebook's. It lives under /var/tmp, which tests/hosts.py's private
hosts see.
"""

from __future__ import annotations

import contextlib
import importlib.metadata as metadata
import re
import secrets
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

HONEST_DISTS = ("torch", "cloudpickle", "pip")
WITHOUT_TORCH = ("cloudpickle", "pip")
"""A node's Python that lacks torch at all."""


def _with_requirements(names: tuple[str, ...]) -> set[str]:
    """``names`` and every distribution they need (extras left out)."""
    found: set[str] = set()
    todo = list(names)
    while todo:
        name = todo.pop()
        if name.lower() in found:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        found.add(name.lower())
        for requirement in dist.requires or ():
            if "extra ==" not in requirement:
                todo.append(re.split(r"[\s<>=!~;\[(]", requirement, maxsplit=1)[0])
    return found


@contextlib.contextmanager
def honest_python(dists: tuple[str, ...] = HONEST_DISTS) -> Iterator[str]:
    """The honest Python's path, removed at the end; ``dists``: what it has (with what they
    need) of the notebook's.
    """
    top = Path("/var/tmp") / f"sky-honest-{secrets.token_hex(4)}"
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--without-pip", str(top / "venv")], check=True)
    try:
        deps = top / "deps"
        deps.mkdir()
        for name in sorted(_with_requirements(dists)):
            dist = metadata.distribution(name)
            where = Path(str(dist.locate_file("")))
            for first in {Path(str(f)).parts[0] for f in dist.files or ()} - {"..", "__pycache__"}:
                if (where / first).exists() and not (deps / first).exists():
                    (deps / first).symlink_to(where / first)
        site = next((top / "venv" / "lib").glob("python3*/site-packages"))
        (site / "_honest.pth").write_text(f"{deps}\n")
        yield str(top / "venv" / "bin" / "python")
    finally:
        shutil.rmtree(top)

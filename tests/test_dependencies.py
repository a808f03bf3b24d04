"""The package's runtime needs are its declared dependencies.

Every third-party module the package imports must come from a distribution that
``pyproject.toml`` declares, except the optional ones listed here with the reason. (An earlier
wheel imported ``jupyter_core`` without declaring it, and said so only at run time.)
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
OPTIONAL = {
    "torch": "needed on the ranks; installed by the user to pick the build (README)",
    "pandas": "only makes %sky metrics a DataFrame when present",
    "psutil": "a fallback where /proc is missing",
    "jupyter_server": "the server extension is loaded only by a Jupyter server, which brings it",
    "tornado": "the server extension's handlers, loaded only by a Jupyter server",
    "ray": "only the ray provider needs it (the `ray` extra); without it, it says so",
    "jax": "only --framework jax needs it on the ranks (the `jax` extra); without it, it says so",
    "keras": "only --keras-backend jax imports it on the ranks (the `keras` extra)",
    "matplotlib": "the ranks' backend module, which only matplotlib imports, once a cell does",
}


def _imported_modules() -> set[str]:
    found = set()
    for path in (ROOT / "skyward_jupyter").rglob("*.py"):
        tree = ast.parse(path.read_text())
        type_only = {
            id(node)
            for block in ast.walk(tree)
            if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
            for node in ast.walk(block)
        }
        for node in ast.walk(tree):
            if id(node) in type_only:
                continue
            if isinstance(node, ast.Import):
                found.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
    return {m for m in found if m not in sys.stdlib_module_names and m != "skyward_jupyter"}


def _declared() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return {
        re.split(r"[<>=!~\[ ;]", req, maxsplit=1)[0].lower().replace("_", "-")
        for req in project["dependencies"]
    }


def test_every_imported_module_is_declared_or_optional() -> None:
    providers = importlib.metadata.packages_distributions()
    declared = _declared()
    missing = {}
    for module in sorted(_imported_modules() - set(OPTIONAL)):
        dists = {d.lower().replace("_", "-") for d in providers.get(module, [module])}
        if not dists & declared:
            missing[module] = sorted(dists)
    assert not missing, f"imported but not declared in pyproject.toml: {missing}"

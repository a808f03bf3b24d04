"""The shape of the code (DESIGN.md): layers only downward, no import cycles. Read from the
source, so a change that breaks it fails here. Modules are as long as their job needs: there is
no line cap to squeeze code under.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "skyward_jupyter"


def _module(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    """Module -> the package's modules it imports at run time (not under TYPE_CHECKING)."""
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        name = _module(path)
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        tree = ast.parse(path.read_text())
        typing_only = {
            id(n)
            for block in ast.walk(tree)
            if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
            for n in ast.walk(block)
        }
        found = set()
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.ImportFrom):
                base = package.split(".")
                if node.level:
                    base = base[: len(base) - node.level + 1]
                    target = ".".join([*base, *([node.module] if node.module else [])])
                else:
                    target = node.module or ""
                if target.startswith("skyward_jupyter"):
                    # ``from . import x`` loads the submodule x, not the (already loading) package
                    if node.module:
                        found.add(target)
                    found.update(f"{target}.{a.name}" for a in node.names)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name.startswith("skyward_jupyter"))
        graph[name] = found
    known = set(graph)
    return {m: {t for t in targets if t in known and t != m} for m, targets in graph.items()}


def test_the_package_has_no_import_cycle() -> None:
    graph = _imports()
    edges = graph
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            raise AssertionError(
                "import cycle: " + " -> ".join([*path[path.index(module) :], module])
            )
        if module in done:
            return
        for target in sorted(edges[module]):
            visit(target, [*path, module])
        done.add(module)

    for module in sorted(edges):
        visit(module, [])


def _reaches(module: str, prefix: str) -> bool:
    return any(t == prefix or t.startswith(prefix + ".") for t in _imports()[module])


def test_layers_only_downward() -> None:
    graph = _imports()
    assert graph["skyward_jupyter.magics"] <= {
        "skyward_jupyter.session",
        "skyward_jupyter.options",
    }, "magics talks to the session (and reads its own option table) alone"
    for module in ("skyward_jupyter.session", "skyward_jupyter.registry.record"):
        assert not _reaches(module, "skyward_jupyter.display"), f"{module} imports the display"
    assert not any(
        t.startswith("skyward_jupyter.providers.") and t != "skyward_jupyter.providers.base"
        for t in graph["skyward_jupyter.session"]
    ), "the session knows providers only through their interface and the registry of names"
    for module in graph:
        if module.startswith("skyward_jupyter.registry"):
            assert not _reaches(module, "skyward_jupyter.display"), module
            assert not _reaches(module, "skyward_jupyter.session"), module


_FIGURE = re.compile(
    r"\b\d+(?:\.\d+)?\s?(?:ms|µs|ns)\b"  # a time taken: "took 100 ms"
    r"|\b\d+(?:\.\d+)?%\s(?:faster|slower|shorter|longer)\b"  # a measured gain: "6% shorter"
    r"|\b\d+(?:\.\d+)?x\s(?:faster|slower)\b"
)


def _prose(path: Path) -> list[tuple[int, str]]:
    """The docstrings and comments of a module, with their line numbers."""
    source = path.read_text()
    found = [
        (node.body[0].lineno, text)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and (text := ast.get_docstring(node, clean=False))
    ]
    found += [
        (token.start[0], token.string)
        for token in tokenize.generate_tokens(io.StringIO(source).readline)
        if token.type == tokenize.COMMENT
    ]
    return found


def test_figures_live_in_benchmarks_not_in_docstrings() -> None:
    """What a part costs goes stale in a docstring as BENCHMARKS.md is regenerated: the code
    says why, and BENCHMARKS.md how much.
    """
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: {match.group(0)}"
        for path in PACKAGE.rglob("*.py")
        for line, text in _prose(path)
        if (match := _FIGURE.search(text))
    ]
    where = "; ".join(found)
    assert not found, f"figures in docstrings or comments (move them to BENCHMARKS.md): {where}"

"""A provider is its own modules' business: outside ``providers/<name>*.py`` no code names a
built-in provider or one of its options. Read from the source, so a change that leaks one (a
provider's field on the pool's spec, a flag in a core message, a branch on a name) fails here.

Prose is not code: docstrings and comments may mention providers (the package's docs do). A
provider's modules may build on another provider's (the AWS one starts its ranks with the SSH
one's); the core may not.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from skyward_jupyter.flags import Option
from skyward_jupyter.providers import BUILT_IN, DEFAULT, base, provider_class, provider_classes
from skyward_jupyter.providers.base import Provider, ProviderOptions, option

PACKAGE = Path(__file__).resolve().parents[1] / "skyward_jupyter"

GENERIC_NAMES = {
    "python": "the interpreter, everywhere (a rank reports its Python)",
    "time": "the standard library's module",
    "head_addr": "instance_info().head_addr: every rank's head address, whatever the provider",
    "instance_type": "Node.instance_type: what kind of machine a node is, for every provider",
}
"""Identifiers that are also a provider option's name and mean something generic where used."""


def _provider_modules() -> set[Path]:
    return {
        path
        for name in BUILT_IN
        for path in (PACKAGE / "providers").glob(f"{name}*.py")
        if path.stem == name or path.stem.startswith(f"{name}_")
    }


def _docstrings(tree: ast.AST) -> set[int]:
    """The string constants that are docstrings (of modules, classes, functions, attributes)."""
    found = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if not isinstance(body, list):
            continue
        for i, statement in enumerate(body):
            is_text = isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant)
            if is_text and isinstance(statement.value.value, str):
                first = i == 0 and not isinstance(node, ast.If | ast.For | ast.While | ast.With)
                after_assignment = i > 0 and isinstance(body[i - 1], ast.Assign | ast.AnnAssign)
                if first or after_assignment:
                    found.add(id(statement.value))
    return found


def _fallback_list(tree: ast.AST) -> set[int]:
    """The strings of ``BUILT_IN``, the entry points read before the metadata has them."""
    return {
        id(constant)
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign | ast.AnnAssign)
        and "BUILT_IN" in ast.unparse(node.targets[0] if isinstance(node, ast.Assign) else node)
        for constant in ast.walk(node)
    }


def _identifier(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.keyword | ast.arg):
        return node.arg
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return node.name
    if isinstance(node, ast.alias):
        return node.asname or node.name
    if isinstance(node, ast.ImportFrom):
        return node.module
    return None


def _words(identifier: str) -> set[str]:
    """``SSHProvider`` -> {ssh, provider}; ``aws_teardown`` -> {aws, teardown}."""
    return {w.lower() for w in re.findall(r"[A-Z]+(?![a-z])|[A-Z]?[a-z0-9]+", identifier)}


def leaks(
    source: str, where: str, providers: dict[str, tuple[list[str], set[str]]]
) -> Iterator[str]:
    """What ``source`` (the module at ``where``) says of the providers: ``providers`` is
    name -> (its flags, their dests).
    """
    tree = ast.parse(source)
    prose = _docstrings(tree) | _fallback_list(tree)
    for name, (flags, dests) in providers.items():
        named = re.compile(rf"(?<![\w.-]){name}(?![\w-])", re.I)
        flagged = re.compile("|".join(rf"(?<![\w-]){re.escape(f)}(?![\w-])" for f in flags))
        for node in ast.walk(tree):
            text = node.value if isinstance(node, ast.Constant) else None
            said = isinstance(text, str) and (named.search(text) or flagged.search(text))
            if said and id(node) not in prose:
                yield f"{where}:{getattr(node, 'lineno', '?')}: {text!r} names the {name} provider"
            identifier = _identifier(node)
            if identifier is None or identifier in GENERIC_NAMES:
                continue
            if name in _words(identifier) or identifier in dests:
                line = getattr(node, "lineno", "?")
                yield f"{where}:{line}: {identifier} is the {name} provider's"


def _providers() -> dict[str, tuple[list[str], set[str]]]:
    found = {}
    for name in BUILT_IN:
        if name == DEFAULT:
            continue  # "local" is an ordinary word; the default provider has no options
        options = provider_class(name).Options.declared().values()
        found[name] = ([o.flag for o in options], {o.dest for o in options})
    return found


def _without_shared(
    providers: dict[str, tuple[list[str], set[str]]],
) -> dict[str, tuple[list[str], set[str]]]:
    """``providers`` less the options that ``providers/base.py`` declares for several of them
    (:class:`SharedOption`): there they are declared, and they are no one provider's.
    """
    flags = {o.flag for o in _shared()}
    dests = {f.lstrip("-").replace("-", "_") for f in flags}
    return {
        name: ([f for f in own if f not in flags], own_dests - dests)
        for name, (own, own_dests) in providers.items()
    }


def test_no_core_module_names_a_provider_or_its_options() -> None:
    own, providers = _provider_modules(), _providers()
    shared_declared = PACKAGE / "providers" / "base.py"
    found = [
        leak
        for path in sorted(PACKAGE.rglob("*.py"))
        if path not in own
        for leak in leaks(
            path.read_text(),
            str(path.relative_to(PACKAGE.parent)),
            _without_shared(providers) if path == shared_declared else providers,
        )
    ]
    assert not found, "\n".join(found)


def copies(classes: list[type[Provider]]) -> list[str]:
    """The flags that ``classes`` declare more than once, each its own way (help, parser,
    range): a flag several providers take is one :class:`SharedOption` that each includes.
    """
    declared: dict[str, list[tuple[Option, list[str]]]] = {}
    for cls in classes:
        for flag in cls.Options.declared().values():
            ways = declared.setdefault(flag.flag, [])
            same = [names for way, names in ways if way == flag]
            if same:
                same[0].append(cls.name)
            else:
                ways.append((flag, [cls.name]))
    return [
        f"{flag}: " + "; ".join(f'{", ".join(names)}: "{o.help}"' for o, names in ways)
        for flag, ways in declared.items()
        if len(ways) > 1
    ]


def test_a_flag_several_providers_take_is_declared_once() -> None:
    """``--python`` (SSH, AWS, Slurm) and ``--gpus-per-node`` (Slurm, Ray) each have one help
    and one parser; the check is tested too, on a provider that declares its own ``--python``.
    """
    classes = provider_classes()
    takers = {o.flag: [c.name for c in classes if o.flag in _flags(c)] for o in _shared()}
    assert takers == {"--python": ["aws", "slurm", "ssh"], "--gpus-per-node": ["ray", "slurm"]}
    assert copies(classes) == []

    @dataclass(frozen=True)
    class OwnPython(ProviderOptions):
        python: str = option("Python on the hosts (python3)", default="python3")

    class Copy(provider_class("local")):  # type: ignore[misc, valid-type]
        name = "copy"
        Options = OwnPython

    assert copies([*classes, Copy]) == [
        '--python: aws, slurm, ssh: "Python on the nodes, a path or a command on their PATH '
        '(default: the provider\'s)"; copy: "Python on the hosts (python3)"'
    ]


def _shared() -> list[base.SharedOption]:
    return [o for o in vars(base).values() if isinstance(o, base.SharedOption)]


def _flags(cls: type[Provider]) -> set[str]:
    return {o.flag for o in cls.Options.declared().values()}


@pytest.mark.parametrize(
    "source",
    [
        "class PoolSpec:\n    hosts: tuple[str, ...] = ()\n",
        "x = spec.ray_address\n",
        "if spec.provider == 'aws':\n    pass\n",
        "HELP = f'machines over SSH, {n} (implies --provider ssh)'\n",
        "ERROR = 'pass --partition P'\n",
        "from .providers.slurm import SlurmOptions\n",
        "check(region=None)\n",
        "n = spec.options.gpus_per_node\n",  # a shared option is still no core module's
        "ERROR = 'give --gpus-per-node G'\n",
    ],
)
def test_the_reader_finds_each_kind_of_leak(source: str) -> None:
    """The reader is tested, not trusted: each way a provider leaks is found."""
    assert list(leaks(source, "probe.py", _providers())), source


def test_prose_and_generic_names_are_not_leaks() -> None:
    source = (
        '"""Ranks over SSH, on EC2 or in a Slurm job: --hosts, --partition."""\n'
        "import time\n"
        "def f(python: str) -> None:\n"
        '    """Also the aws provider\'s --region."""\n'
        "    time.sleep(0)  # the ssh provider's --hosts\n"
    )
    assert list(leaks(source, "probe.py", _providers())) == []

"""Run a cell's source in a namespace that persists across cells, the way IPython runs one.

The source is compiled under a per-cell file name and registered in ``linecache``, so a
traceback shows the cell's own lines. A final expression statement is evaluated separately and
its value becomes the cell's value. The namespace is the ``__main__`` module of the rank, so
classes and functions a cell defines pickle the way they would in a notebook.
"""

from __future__ import annotations
import __future__

import ast
import builtins
import contextlib
import dis
import functools
import linecache
import os
import sys
import traceback
import types
from typing import Any

from .earlier_groups import StaleGroupError


class Namespace:
    def __init__(self) -> None:
        self.module = types.ModuleType("__main__")
        self.module.__dict__["__builtins__"] = __builtins__
        sys.modules["__main__"] = self.module
        self._future = 0
        """``__future__`` features earlier cells imported: they hold for later cells, as in
        IPython (``from __future__ import annotations`` in one cell applies to the next)."""
        self._ready: dict[str, Any] = {}
        """The ready names (``rank``, ``device``, ...) still ours: a new formation updates
        them."""
        self._theirs: set[str] = set()
        """Names the user took: shipped from the notebook, or bound or deleted by a cell."""

    def ready(self, values: dict[str, Any]) -> None:
        """Bind the ready names a cell finds, leaving alone every one that is the user's (a
        name the notebook shipped or a cell bound, also to an equal value, or deleted).
        """
        for name, value in values.items():
            taken = name in self._ready and self.globals.get(name) is not self._ready[name]
            if taken or (name not in self._ready and name in self.globals):
                self._disown(name)
            if name not in self._theirs:
                self.globals[name] = self._ready[name] = value

    def _disown(self, name: str) -> None:
        self._ready.pop(name, None)
        self._theirs.add(name)

    @property
    def globals(self) -> dict[str, Any]:
        return self.module.__dict__

    def bind(self, name: str, value: Any) -> None:
        """Bind a value shipped from the notebook.

        A function (or a class's methods) defined in the notebook is rebound to this namespace,
        as if the cell had defined it here: it then sees the names earlier cells bound on this
        rank, not a frozen copy of the notebook's globals.
        """
        self._disown(name)
        self.globals[name] = self._rebound(value)

    def _rebound(self, value: Any) -> Any:
        if isinstance(value, types.FunctionType) and value.__module__ == "__main__":
            fn = types.FunctionType(
                value.__code__, self.globals, value.__name__, value.__defaults__, value.__closure__
            )
            fn.__kwdefaults__ = value.__kwdefaults__
            fn.__qualname__ = value.__qualname__
            fn.__doc__ = value.__doc__
            fn.__dict__.update(value.__dict__)
            fn.__annotations__ = value.__annotations__
            return fn
        if isinstance(value, type) and value.__module__ == "__main__":
            for attr, member in list(vars(value).items()):
                if isinstance(member, types.FunctionType):
                    setattr(value, attr, self._rebound(member))
        return value

    def run(self, source: str, filename: str) -> Any:
        """Execute ``source``; return the value of its last expression (None when it has none)."""
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        body, last = _compiled(source, filename, self._future)
        self._future |= body.co_flags & _FUTURE_FLAGS
        for name in _stored_globals(body):
            self._disown(name)
        exec(_cell_named(body, filename), self.globals)
        if last is None:
            return None
        return eval(_cell_named(last, filename), self.globals)


_FUTURE_FLAGS = functools.reduce(
    int.__or__,
    (getattr(__future__, name).compiler_flag for name in __future__.all_feature_names),
)


def _compiled(
    source: str, filename: str, future: int
) -> tuple[types.CodeType, types.CodeType | None]:
    """The cell's statements and its final expression (if any), compiled under ``filename``
    with the ``future`` features earlier cells imported.
    """
    try:
        return _compiled_once(source, future)
    except SyntaxError as exc:
        exc.filename = filename  # the error names the cell, as the code would
        raise


@functools.lru_cache(maxsize=64)
def _compiled_once(source: str, future: int) -> tuple[types.CodeType, types.CodeType | None]:
    """Compiled once per source and ``__future__`` features (the cell's and earlier cells'
    only, not this module's: a cell's annotations are evaluated, as Python does). A cell run
    again (a training loop, a benchmark) is not parsed and compiled again: on a trivial cell that
    is much of a rank's work (BENCHMARKS.md, "Measurements behind the code"). A run takes it
    renamed for its file name (:func:`_cell_named`).
    """
    tree = compile(source, _UNNAMED, "exec", future | ast.PyCF_ONLY_AST, dont_inherit=True)
    last: ast.expr | None = None
    if tree.body and isinstance(final := tree.body[-1], ast.Expr):
        tree.body.pop()
        last = final.value
    body = compile(tree, _UNNAMED, "exec", future, dont_inherit=True)
    if last is None:
        return body, None
    future |= body.co_flags & _FUTURE_FLAGS  # the cell's own imports hold for its last line
    return body, compile(ast.Expression(last), _UNNAMED, "eval", future, dont_inherit=True)


_UNNAMED = "<sky-cell>"
_MODULE_STORES = {"STORE_NAME", "DELETE_NAME", "STORE_GLOBAL", "DELETE_GLOBAL"}
_GLOBAL_STORES = {"STORE_GLOBAL", "DELETE_GLOBAL"}


@functools.lru_cache(maxsize=64)
def _stored_globals(code: types.CodeType, module: bool = True) -> frozenset[str]:
    """The globals ``code`` binds or deletes: at the cell's top level, and through ``global``
    in the functions it defines (a class body's names are the class's). Read from the code, so
    ``world_size = 2`` makes ``world_size`` the cell's even where the value is ours too.
    """
    stores = _MODULE_STORES if module else _GLOBAL_STORES
    names = {i.argval for i in dis.get_instructions(code) if i.opname in stores}
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _stored_globals(const, module=False)
    return frozenset(names)


@functools.lru_cache(maxsize=64)
def _cell_named(code: types.CodeType, filename: str) -> types.CodeType:
    """A cell's code renamed for ``filename`` (:func:`_named`), kept as its compiled code is: a
    cell run again under the same name (a loop calling one cell) is not copied again. Only a
    cell's whole code is kept: code objects compare equal whatever their qualified names, which
    a nested function's takes from the code around it.
    """
    return _named(code, filename)


def _named(code: types.CodeType, filename: str) -> types.CodeType:
    """``code`` as if compiled from ``filename``, functions and classes defined in it too (a
    traceback names the cell that ran, and shows its lines from ``linecache``).
    """
    return code.replace(
        co_filename=filename,
        co_consts=tuple(
            _named(c, filename) if isinstance(c, types.CodeType) else c for c in code.co_consts
        ),
    )


class ScriptExit(Exception):
    """A script ended with ``sys.exit`` and a failing status."""


def run_script(source: str, path: str, argv: tuple[str, ...], main: types.ModuleType) -> None:
    """Run ``source`` as ``python PATH ARGV[1:]...`` would, in this process (``ARGV[0]``: the
    path as given, a directory for its ``__main__.py``).

    The script gets a fresh ``__main__`` (the cells' namespace is untouched), ``sys.argv``, its
    directory first on ``sys.path`` and as the working directory (when this machine has it);
    all of it is put back afterwards, ``main`` is ``__main__`` again and the modules it imported
    from its directory are unloaded. ``sys.exit(0)`` is a
    success, another status an error naming it.
    """
    module = types.ModuleType("__main__")
    module.__dict__.update(__builtins__=builtins, __file__=path, __cached__=None)
    directory = os.path.dirname(path)
    saved_argv, saved_path, saved_cwd = sys.argv, list(sys.path), os.getcwd()
    loaded = set(sys.modules)
    linecache.cache[path] = (len(source), None, source.splitlines(True), path)
    sys.argv = list(argv)
    # First and once, as ``python PATH`` has it: the notebook's own directory may be the same
    # one, and a second entry would be searched again by every import that misses.
    sys.path[:] = [directory, *(entry for entry in sys.path if entry != directory)]
    sys.modules["__main__"] = module
    try:
        if os.path.isdir(directory):
            os.chdir(directory)
        exec(compile(source, path, "exec", dont_inherit=True), module.__dict__)
    except SystemExit as exc:
        if exc.code is None or exc.code == 0:
            return
        name = os.path.basename(path)
        if isinstance(exc.code, int):
            raise ScriptExit(f"{name} exited with status {exc.code}") from None
        raise ScriptExit(f"{name} exited: {exc.code}") from None
    finally:
        sys.argv = saved_argv
        sys.path[:] = saved_path
        with contextlib.suppress(OSError):  # the directory may be gone; the rank goes on
            os.chdir(saved_cwd)
        sys.modules["__main__"] = main
        _forget_modules_from(directory, set(sys.modules) - loaded)


def _forget_modules_from(directory: str, names: set[str]) -> None:
    """Unload the modules a run imported from the script's directory: the next run imports them
    afresh (edited, or another project's module of the same name), as a new process would.
    """
    inside = os.path.join(os.path.abspath(directory), "")
    for name in names:
        origin = getattr(sys.modules.get(name), "__file__", None)
        if origin and os.path.abspath(origin).startswith(inside):
            del sys.modules[name]


_AGENT_DIR = os.path.dirname(os.path.abspath(__file__))


def _without_agent_frames(te: traceback.TracebackException) -> None:
    frames = list(te.stack)
    if te.exc_type is StaleGroupError:
        # Raised in torch's place, before any collective: torch's frames on the way are noise.
        torch = os.path.dirname(getattr(sys.modules.get("torch"), "__file__", None) or _AGENT_DIR)
        while frames and os.path.abspath(frames[-1].filename).startswith((_AGENT_DIR, torch)):
            frames.pop()
    te.stack = traceback.StackSummary.from_list(
        [f for f in frames if not os.path.abspath(f.filename).startswith(_AGENT_DIR)]
    )
    for chained in (te.__cause__, te.__context__):
        if chained is not None:
            _without_agent_frames(chained)


def format_remote_traceback(exc: BaseException) -> str:
    """The traceback as the user's code made it: the agent's own frames (the runner around the
    cell, the SIGINT handler that raised KeyboardInterrupt) are noise and are left out.
    """
    te = traceback.TracebackException.from_exception(exc)
    _without_agent_frames(te)
    return "".join(te.format())

"""What a rank's namespace binds, listed without its values: the notebook's Tab completion of
the ranks' names and ``%sky who`` read it.

It is answered on whichever thread reads the wire, also while a cell runs (see :mod:`.inbox`):
it only reads the namespace (names, types, ``dir()``, a tensor's or an array's shape) and never
pickles a value, so a large model costs no more to list than an int. The attributes along a
dotted path are the user's code (a property, ``__getattr__``): they are read on a thread of
their own, and one that takes longer than :data:`PATH_WITHIN` is left to finish there, the
request answered without it, so that a slow property never holds the wire (and the next cell).
"""

from __future__ import annotations

import inspect
import threading
from typing import Any

from .. import protocol as p


def answer(request: p.NamesRequest, namespace: dict[str, Any]) -> p.Names:
    """The namespace's names, or the attribute names of the object at ``request.path``."""
    if not request.path:
        bound = dict(namespace)  # one copy: a cell running on main may bind names meanwhile
        return p.Names(request.request, tuple(_name(n, v) for n, v in bound.items()))
    first = request.path[0]
    value = namespace.get(first, _UNBOUND)  # read here: a cell may delete it meanwhile
    if value is _UNBOUND:
        return p.Names(request.request, error=f"{first!r} is not bound on this rank")
    answered: list[p.Names] = []
    reader = threading.Thread(
        target=lambda: answered.append(_attributes(request, value)),
        name="skyward-names",
        daemon=True,
    )
    reader.start()
    reader.join(PATH_WITHIN)
    if not answered:
        where = ".".join(request.path)
        return p.Names(request.request, error=f"{where}: reading it took over {PATH_WITHIN} s")
    return answered[0]


_UNBOUND = object()
PATH_WITHIN = 0.25
"""Seconds the attributes along a path may take (the notebook waits 0.3 s for the answer)."""


def _attributes(request: p.NamesRequest, value: Any) -> p.Names:
    """The attribute names of ``value`` followed along the rest of the request's path."""
    where = request.path[0]
    try:
        for attribute in request.path[1:]:
            value = getattr(value, attribute)
            where += f".{attribute}"
        found = dir(value)
    # A property or __getattr__/__dir__ of the user's may raise anything: it is the answer.
    except Exception as exc:  # noqa: BLE001
        return p.Names(request.request, error=f"{where}: {type(exc).__name__}: {exc}")
    attributes = (_attribute(value, n) for n in found if isinstance(n, str))
    return p.Names(request.request, tuple(attributes))


def _name(name: str, value: Any) -> p.Name:
    shape, dtype, device = _array(value)
    return p.Name(name, type(value).__name__, _kind(value), shape, dtype, device)


def _attribute(owner: Any, name: str) -> p.Name:
    """An attribute's name and kind, read as it is stored (no property or ``__getattr__`` runs);
    no type: that would need its value.
    """
    try:
        found = inspect.getattr_static(owner, name)
    except AttributeError:  # made by __getattr__ (an nn.Module's submodules): left unread
        return p.Name(name, "", "instance")
    return p.Name(name, "", "property" if isinstance(found, property) else _kind(found))


def _kind(value: Any) -> str:
    """What IPython's completer calls it: ``module``, ``class``, ``function`` or ``instance``."""
    if inspect.ismodule(value):
        return "module"
    if isinstance(value, type):
        return "class"
    return "function" if inspect.isroutine(value) else "instance"


def _array(value: Any) -> tuple[tuple[int, ...] | None, str | None, str | None]:
    """A tensor's or an array's shape, dtype and device (a numpy array's is ``cpu``); Nones
    for any other value. Read from any class that has ``shape`` and ``dtype`` (torch, numpy,
    JAX, CuPy), without importing one.
    """
    cls = type(value)
    if isinstance(value, type) or not (hasattr(cls, "shape") and hasattr(cls, "dtype")):
        return None, None, None
    try:
        shape = tuple(int(d) for d in value.shape)
        dtype = str(value.dtype).removeprefix("torch.")
        device = getattr(value, "device", None)
    # An object whose shape is not a tuple of sizes, or whose properties fail: no detail.
    except Exception:  # noqa: BLE001
        return None, None, None
    if device is None and cls.__module__ == "numpy":
        device = "cpu"
    return shape, dtype, None if device is None else str(device)

"""A finished cell as the wire carries it back: its value, or its error, made safe to send.

The value travels pickled when it can be (the notebook then gets the object) and always as a
bounded repr (a value that does not pickle still shows). An error travels as its type name, its
message and a traceback formatted here, where the source lines are, plus the exception pickled
when it can be. Nothing here may raise: a broken ``__repr__`` or ``__reduce__`` in user code
must not cost the rank its answer.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .. import protocol as p
from .cells import format_remote_traceback

_REPR_LIMIT = 20_000


def cell_done(
    cell_id: int,
    value: Any,
    error: BaseException | None,
    seconds: float,
    after_interrupt: bool,
    *,
    bound: tuple[str, ...] = (),
    group_destroyed: bool = False,
    notes: tuple[str, ...] = (),
    collectives: tuple[tuple[str, int], ...] | None = (),
    deleted: tuple[str, ...] = (),
) -> p.CellDone:
    """The :class:`~skyward_jupyter.protocol.CellDone` for a cell that ended this way."""
    pickled: p.Pickled | None = None
    shown: str | None = None
    info: p.ErrorInfo | None = None
    if error is not None:
        info = dataclasses.replace(_error_info(error), after_interrupt=after_interrupt)
    elif value is not None:
        try:
            pickled = p.Pickled.dump(value)
        except Exception:  # noqa: BLE001 - an unpicklable value still shows as its repr
            pickled = None
        shown = _safe_repr(value)
    return p.CellDone(
        cell_id,
        pickled,
        shown,
        info,
        seconds,
        bound,
        group_destroyed,
        notes,
        collectives,
        deleted,
        after_interrupt,
    )


def _safe_repr(value: Any) -> str:
    try:
        text = repr(value)
    except Exception as exc:  # noqa: BLE001 - a broken __repr__ must not fail the cell
        return f"<{type(value).__name__} (repr failed: {exc!r})>"
    return text if len(text) <= _REPR_LIMIT else text[:_REPR_LIMIT] + " ...[truncated]"


def _error_info(exc: BaseException) -> p.ErrorInfo:
    try:
        pickled: p.Pickled | None = p.Pickled.dump(exc)
    except Exception:  # noqa: BLE001 - the text form below always travels
        pickled = None
    module = type(exc).__module__
    return p.ErrorInfo(
        type_name=type(exc).__qualname__
        if module == "builtins" or module.startswith("skyward_jupyter.")
        else f"{module}.{type(exc).__qualname__}",
        message=str(exc),
        traceback=format_remote_traceback(exc),
        exception=pickled,
    )

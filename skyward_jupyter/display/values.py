"""How a cell's result shows in the notebook: as the head's value (``--all``: every rank's).

Registered with IPython's display formatters, so :class:`RunResult` stays free of IPython and the
notebook shows ``3.0`` for a cell ending in ``t.item()``, with the rich form (a DataFrame's table)
when the value could be loaded here.
"""

from __future__ import annotations

from typing import Any

from ..results import RunResult


def _show(result: RunResult) -> None:
    from IPython.display import display

    if result.show_all:
        for rank in result:
            print(f"[rank {rank.rank}] {rank.value_repr}")
        return
    head = result[0]
    if head.value is not None:
        display(head.value)  # type: ignore[no-untyped-call]
    elif head.value_repr is not None:
        print(head.value_repr)


def register(shell: Any) -> None:
    formatter = shell.display_formatter.ipython_display_formatter
    formatter.for_type(RunResult, _show)

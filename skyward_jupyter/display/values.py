"""How a cell's result shows in the notebook: as the head's value (``--all``: every rank's).

Registered with IPython's formatters, so :class:`RunResult` stays free of IPython: the cell's
``Out[n]`` is the head's value in every form IPython knows for it (a DataFrame shows as a table),
while ``Out[n]`` itself still holds the per-rank result object.
"""

from __future__ import annotations

from typing import Any

from ..results import RunResult


def register(shell: Any) -> None:
    formatters = shell.display_formatter

    def mimebundle(result: RunResult, include: Any = None, exclude: Any = None) -> dict[str, Any]:
        if result.show_all:
            lines = [f"[rank {r.rank}] {r.value_repr}" for r in result]
            return {"text/plain": "\n".join(lines)}
        head = result[0]
        if head.value is None:
            return {"text/plain": head.value_repr or ""}
        data, _ = formatters.format(head.value, include=include, exclude=exclude)
        return dict(data)

    formatters.mimebundle_formatter.for_type(RunResult, mimebundle)

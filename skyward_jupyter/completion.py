"""Tab completion in the notebook of the names bound on the head rank: ``mod<Tab>`` offers
``model`` and ``model.<Tab>`` its attributes, though only the ranks hold it.

An IPython matcher (the completer's API v2) that the extension adds to the shell's completer.
For a dotted name before the cursor it asks the current pool's head, through the session, for
names only (no value leaves the rank), and gives up after :data:`DEADLINE`: with no pool ready,
or a head that cannot answer in time (a cell holding its GIL), it offers nothing, and the
notebook's own completions stand as they would without it.
"""

from __future__ import annotations

from collections.abc import Callable

from IPython.core.completer import (
    CompletionContext,
    SimpleCompletion,
    SimpleMatcherResult,
    context_matcher,
)

from .session import Session

DEADLINE = 0.3
"""Seconds a Tab waits for the head's names before the notebook's own completions show alone."""
IDENTIFIER = "skyward_jupyter.rank_names"
"""The matcher's name in IPython's completer (its ``suppress_competing_matchers`` setting)."""

Matcher = Callable[[CompletionContext], SimpleMatcherResult]


def rank_names_matcher(session: Session) -> Matcher:
    """The matcher for ``session``'s current pool."""

    @context_matcher(identifier=IDENTIFIER)  # type: ignore[untyped-decorator]  # IPython's decorator is untyped
    def rank_names(context: CompletionContext) -> SimpleMatcherResult:
        parts = _dotted(context.token)
        if parts is None:
            return {"completions": [], "suppress": False}
        *path, prefix = parts
        answer = session.head_names(tuple(path), DEADLINE)
        if answer is None or answer.error is not None:
            return {"completions": [], "suppress": False}
        before = "".join(f"{part}." for part in path)
        hidden = not prefix.startswith("_")  # _names only when asked for, as IPython does
        completions = [
            SimpleCompletion(before + n.name, type=n.kind or None)
            for n in answer.names
            if n.name.startswith(prefix) and not (hidden and n.name.startswith("_"))
        ]
        return {"completions": completions, "suppress": False}

    return rank_names  # type: ignore[no-any-return]


def _dotted(token: str) -> list[str] | None:
    """``model.fc.we`` as ``["model", "fc", "we"]`` (the last part may be empty); None for a
    token that is not a dotted name (nothing to ask the head for).
    """
    parts = token.split(".")
    if not parts[0].isidentifier() or not all(p.isidentifier() for p in parts[1:-1]):
        return None
    if parts[-1] and not parts[-1].isidentifier():
        return None
    return parts

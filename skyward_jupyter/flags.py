"""One ``--flag`` of the magics, and the parsers that check the form of what it is given.

Both the pool's own options (:mod:`skyward_jupyter.options`) and each provider's
(:class:`~skyward_jupyter.providers.base.ProviderOptions`) are declared as :class:`Option` rows,
so the magics build one parser, one help and one kind of error from them. A parser checks a
value's form only (a whole number in range, KEY=VALUE); what it means is for its reader.
"""

from __future__ import annotations

import argparse
import builtins
import keyword
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from .limits import MAX_RANKS, LimitError, Range


@dataclass(frozen=True, slots=True)
class Option:
    """One ``--flag``: its help and argparse's keywords (``type`` is its parser)."""

    flag: str
    help: str
    kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def dest(self) -> str:
        return str(self.kwargs.get("dest") or self.flag.lstrip("-").replace("-", "_"))

    def add_to(self, parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
        parser.add_argument(self.flag, help=self.help, **self.kwargs)

    def as_text(self) -> Option:
        """The same flag keeping the text it is given (not given: None), for a reader that
        parses it itself (a provider, once the pool's provider is known).
        """
        kwargs = {k: v for k, v in self.kwargs.items() if k not in ("type", "default")}
        return Option(self.flag, self.help, {**kwargs, "default": None})

    def parse(self, given: Any) -> Any:
        """What :meth:`as_text` kept, parsed (a repeated option: a tuple), or ValueError
        naming the flag.
        """
        action = self.kwargs.get("action")
        if action == "store_true":
            return bool(given)
        parse = self.kwargs.get("type", str)
        try:
            if action == "append":
                return tuple(parse(text) for text in given)
            return parse(given)
        except (argparse.ArgumentTypeError, ValueError) as exc:
            raise ValueError(f"{self.flag}: {exc}") from None


def ranged(limit: Range) -> Callable[[str], float]:
    """A parser for a number option, checked against its range (finite, within bounds)."""

    def parse(text: str) -> float:
        try:
            return limit.parse(text)
        except LimitError as exc:
            raise argparse.ArgumentTypeError(exc.why) from None

    return parse


def int_at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return parse


def identifier(text: str) -> str:
    if not text.isidentifier():
        raise argparse.ArgumentTypeError(f"expected a name (letters, digits, _), got {text!r}")
    return text


def is_variable_name(text: str) -> bool:
    """Whether the notebook's code can read ``text`` as a name: an identifier, not a keyword."""
    return text.isidentifier() and not keyword.iskeyword(text)


def variable_name(text: str) -> str:
    if not is_variable_name(text):
        raise argparse.ArgumentTypeError(f"expected a variable name, got {text!r}")
    return text


def result_name(text: str) -> str:
    """``--out``'s name: one the notebook can read, and not a builtin's, which the result would
    hide in the notebook (``--out print``: every later ``print`` fails, until ``del print``).
    """
    name = variable_name(text)
    if hasattr(builtins, name):
        raise argparse.ArgumentTypeError(
            f"{name!r} is Python's builtin {name}, which the result would hide in the notebook; "
            "choose another name"
        )
    return name


def switch(**kwargs: Any) -> dict[str, Any]:
    """A boolean option that is None (not given) rather than False, so defaults can fill it."""
    return {"action": "store_true", "default": None, **kwargs}


def rank_set(text: str) -> tuple[int, ...]:
    """``0,2-3`` as ranks (0, 2, 3), sorted and once each: what :func:`rank_span` writes."""
    if not re.fullmatch(r"\d+(-\d+)?(,\d+(-\d+)?)*", text.replace(" ", "")):
        raise argparse.ArgumentTypeError(f"expected ranks such as 0, 0,2 or 0,2-3, got {text!r}")
    found: set[int] = set()
    for part in text.replace(" ", "").split(","):
        ends = part.split("-")  # one or two: the pattern above allows no more
        low, high = int(ends[0]), int(ends[-1])
        if high < low:
            raise argparse.ArgumentTypeError(f"{part}: a range goes up, as in {high}-{low}")
        if high >= MAX_RANKS:
            raise argparse.ArgumentTypeError(
                f"no pool has rank {high}: a pool has at most {MAX_RANKS} ranks (MAX_RANKS)"
            )
        found.update(range(low, high + 1))
    return tuple(sorted(found))


def rank_span(ranks: Iterable[int]) -> str:
    """``0,2-3`` for ranks {0, 2, 3}: runs of consecutive ranks are written as ranges."""
    runs: list[list[int]] = []
    for rank in sorted(set(ranks)):
        if runs and rank == runs[-1][1] + 1:
            runs[-1][1] = rank
        else:
            runs.append([rank, rank])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)

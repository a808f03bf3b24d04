"""One ``--flag`` of the magics, and the parsers that check the form of what it is given.

Both the pool's own options (:mod:`skyward_jupyter.options`) and each provider's
(:class:`~skyward_jupyter.providers.base.ProviderOptions`) are declared as :class:`Option` rows,
so the magics build one parser, one help and one kind of error from them. A parser checks a
value's form only (a whole number in range, KEY=VALUE); what it means is for its reader.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .limits import LimitError, Range


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
        parses it itself (a provider, once the pool's provider is known)."""
        kwargs = {k: v for k, v in self.kwargs.items() if k not in ("type", "default")}
        return Option(self.flag, self.help, {**kwargs, "default": None})

    def parse(self, given: Any) -> Any:
        """What :meth:`as_text` kept, parsed (a repeated option: a tuple), or ValueError
        naming the flag."""
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
        raise argparse.ArgumentTypeError(f"expected a variable name, got {text!r}")
    return text


def switch(**kwargs: Any) -> dict[str, Any]:
    """A boolean option that is None (not given) rather than False, so defaults can fill it."""
    return {"action": "store_true", "default": None, **kwargs}

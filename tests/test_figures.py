"""The ranks' matplotlib backend replaces the inline one a kernel names, not the user's."""

from __future__ import annotations

import os

import pytest

from skyward_jupyter.agent import figures


@pytest.mark.parametrize(
    ("inherited", "chosen"),
    [
        (None, figures.BACKEND),
        ("module://matplotlib_inline.backend_inline", figures.BACKEND),  # ipykernel's
        ("inline", figures.BACKEND),
        ("Agg", "Agg"),  # the user's own choice
        ("module://my_backend", "module://my_backend"),
    ],
)
def test_a_rank_uses_its_backend_unless_the_user_chose_one(
    monkeypatch: pytest.MonkeyPatch, inherited: str | None, chosen: str
) -> None:
    if inherited is None:
        monkeypatch.delenv("MPLBACKEND", raising=False)
    else:
        monkeypatch.setenv("MPLBACKEND", inherited)
    monkeypatch.setattr(figures, "_current", None)
    shown = figures.Figures(0, print, lambda: (None, 0), lambda: None, print)
    shown.install()
    assert os.environ["MPLBACKEND"] == chosen
    assert figures._current is shown

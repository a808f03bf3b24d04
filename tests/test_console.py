"""The ranks' ``input()`` (agent/console.py), in this process: what it sends, and when it may."""

from __future__ import annotations

import os

import pytest

from skyward_jupyter import protocol as p
from skyward_jupyter.agent.cell_head import CellHead
from skyward_jupyter.agent.console import Console


def test_input_in_a_process_forked_from_the_head_is_refused_not_sent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The child would write a prompt on the rank's wire, and the notebook's reply would reach
    the rank, not the child, which would wait for ever.
    """
    sent: list[object] = []

    def send(message: object) -> None:  # the notebook answers each prompt
        sent.append(message)
        console.answer(p.InputReply("ada"))

    console = Console(CellHead(0, send, lambda: (3, 0), lambda: None))
    monkeypatch.setattr(os, "getpid", lambda: -1)  # what the child sees: another pid
    with pytest.raises(EOFError, match="forked from rank 0"):
        console.input("name? ")
    assert sent == []
    monkeypatch.undo()
    assert console.input("name? ") == "ada"  # the rank itself asks
    assert sent == [p.InputRequest(3, "name? ", False)]

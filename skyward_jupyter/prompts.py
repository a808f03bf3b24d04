"""The head rank's ``input()``, ``getpass`` and debugger prompts, answered in the notebook.

A prompt arrives on the pool's IO thread; it is answered on the caller's thread, the one waiting
for the cell, because that is where the kernel can ask the user: ``input`` and ``getpass`` there
are ipykernel's, which send the frontend a stdin request (a password box for ``getpass``). Where
the kernel cannot ask (``allow_stdin`` off, as under nbconvert), the rank gets an ``EOFError``
that says so.
"""

from __future__ import annotations

import getpass
import queue
from collections.abc import Callable

from . import protocol as p
from .ranks import Rank


class Prompts:
    def __init__(self) -> None:
        self._asked: queue.SimpleQueue[tuple[Rank, p.InputRequest]] = queue.SimpleQueue()

    def ask(self, rank: Rank, request: p.InputRequest) -> None:
        """A rank's request (on the IO thread)."""
        self._asked.put((rank, request))

    def answer(self, reply: Callable[[Rank, p.InputReply], None]) -> None:
        """Ask the user for each pending prompt (on the caller's thread); ``reply`` sends."""
        while True:
            try:
                rank, request = self._asked.get_nowait()
            except queue.Empty:
                return
            try:
                ask = getpass.getpass if request.password else input
                answer = p.InputReply(ask(request.prompt))
            except (EOFError, NotImplementedError) as exc:  # ipykernel: StdinNotImplementedError
                answer = p.InputReply(
                    None,
                    f"the notebook cannot answer input here ({type(exc).__name__}: {exc}); "
                    "run the cell in a notebook or console that allows stdin",
                )
            reply(rank, answer)

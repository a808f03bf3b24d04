"""``input()``, ``getpass``, ``breakpoint()`` and pdb in a cell: the head rank asks the notebook.

A rank's stdin is not a terminal (nobody could type there), so on the head rank ``input`` sends
an :class:`~skyward_jupyter.protocol.InputRequest` up the wire and waits for the notebook's
:class:`~skyward_jupyter.protocol.InputReply`; the notebook asks the user through the kernel's
own stdin request. pdb reads its commands with ``input`` (its default when it owns no stdin), so
``breakpoint()`` works the same, its output streaming with the head's stdout. The head is the
cell's: the first rank that runs it (``--ranks 1``: rank 1). Other ranks have no prompt in the
notebook to show: their ``input`` is an error saying so, rather than a hang.
"""

from __future__ import annotations

import builtins
import getpass
import queue
from typing import Any

from .. import protocol as p
from .cell_head import CellHead


class Console:
    def __init__(self, head: CellHead) -> None:
        self.rank = head.rank
        self._head = head
        self._replies: queue.Queue[p.InputReply] = queue.Queue()

    def install(self) -> None:
        builtins.input = self.input
        getpass.getpass = self.getpass

    def input(self, prompt: Any = "") -> str:
        return self._ask(str(prompt), password=False)

    def getpass(self, prompt: str = "Password: ", stream: Any = None) -> str:
        return self._ask(prompt, password=True)

    def answer(self, reply: p.InputReply) -> None:
        """The notebook's reply (from the reader thread)."""
        self._replies.put(reply)

    def _ask(self, prompt: str, password: bool) -> str:
        if self._head.forked():
            raise EOFError(
                f"input in a process forked from rank {self.rank}: only the rank itself can ask "
                "the notebook (the reply would reach the rank, not this process); ask before "
                "forking and pass the answer on"
            )
        cell_id, head = self._head.cell()
        if self.rank != head:
            raise EOFError(
                f"input on rank {self.rank}: only the cell's head rank (rank {head}) can ask the "
                f"notebook; read input on rank {head} and share it with the others (e.g. "
                "dist.broadcast_object_list, where every rank runs the cell)"
            )
        self._head.flush()  # what the cell printed before the prompt shows first
        while not self._replies.empty():  # a reply to a prompt an interrupt abandoned
            self._replies.get_nowait()
        self._head.send(p.InputRequest(cell_id, prompt, password))
        reply = self._replies.get()
        if reply.error is not None:
            raise EOFError(reply.error)
        return reply.text or ""

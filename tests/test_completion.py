"""The ranks' names in the notebook: Tab completion (``complete_request`` through the Jupyter
messaging protocol, to a real kernel with a real 2-rank pool) and ``%sky who``.

The browser's side (JupyterLab's completer popup) is in tests/test_browser.py.
"""

from __future__ import annotations

import os
import shlex
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from .conftest import reply_of, wait_for
from .test_magics import Kernel

# Slow heartbeats allowed: the busy-head test holds the head's GIL while Tab is pressed.
POOL = """%%sky --nodes 2 --heartbeat-timeout 120
import torch
model = torch.nn.Sequential(torch.nn.Linear(4, 3))
model_steps = 3
class State: ...
class Trainer: ...
trainer = Trainer()
trainer.state = State()
trainer.state.global_step = 7
trainer.state.best_metric = 0.5
weights = torch.zeros(3, 4, dtype=torch.float16)
"""


@pytest.fixture(scope="module")
def nb() -> Iterator[Kernel]:
    """A kernel whose 2-rank pool binds ``model``, ``model_steps``, ``trainer`` (with a
    ``state``) and ``weights``, none of them in the notebook.
    """
    kernel = Kernel()
    try:
        # Jedi's first inference takes tens of seconds on a loaded machine; the ranks' names
        # come from the extension's own matcher, beside Jedi's or IPython's plain one alike.
        kernel.ok("%config IPCompleter.use_jedi = False\n%load_ext skyward_jupyter")
        kernel.ok(POOL)
        kernel.register_pool_pids()
        yield kernel
    finally:
        kernel.close()


def complete(kernel: Kernel, code: str, timeout: float = 30) -> list[str]:
    """What the kernel offers for Tab at the end of ``code`` (its ``complete_reply``)."""
    return list(kinds(kernel, code, timeout))


def kinds(kernel: Kernel, code: str, timeout: float = 30) -> dict[str, str]:
    """Each completion the kernel offers for Tab at the end of ``code``, with its type."""
    msg_id = kernel.kc.complete(code, len(code))
    reply = reply_of(kernel.kc, msg_id, time.monotonic() + timeout, f"complete {code!r}")
    assert reply["status"] == "ok", reply
    typed = reply["metadata"]["_jupyter_types_experimental"]
    return {c["text"]: c["type"] for c in typed} or dict.fromkeys(reply["matches"], "")


def test_names_bound_only_on_the_ranks_complete_with_their_attributes(nb: Kernel) -> None:
    assert {"model", "model_steps"} <= set(complete(nb, "mod"))
    assert "model" not in nb.ok("print(sorted(dir()))").stdout  # the notebook never held it
    attributes = kinds(nb, "model.")
    assert attributes["model.forward"] == attributes["model.parameters"] == "function"
    assert attributes["model.training"] == "instance"
    assert not [a for a in attributes if a.startswith("model._")]  # _names only when typed
    assert "model._modules" in complete(nb, "model._mo")
    assert {"trainer.state.global_step", "trainer.state.best_metric"} <= set(
        complete(nb, "x = trainer.state.")
    )
    assert complete(nb, "trainer.state.glo") == ["trainer.state.global_step"]
    assert complete(nb, "trainer.nothing.") == []  # an error on the rank offers nothing


def test_tab_while_a_sky_cell_runs_answers_and_never_waits_on_a_stuck_head(
    nb: Kernel, tmp_path: Path
) -> None:
    """A ``%%sky`` cell running on the pool (from a thread of the kernel, so the kernel can
    still take the Tab): while the head computes, its reader thread answers; while it holds
    its GIL in native code, the completion comes without the head's names, within the
    deadline, and the notebook's own completions still show.
    """
    go, held, fifo = tmp_path / "go", tmp_path / "held", tmp_path / "fifo"
    os.mkfifo(fifo)
    release = os.open(fifo, os.O_RDWR)  # open throughout: the head's read waits for a byte
    # libc's system() through PyDLL holds the head's GIL from before `held` exists until the
    # fifo gives a byte, which is written only after the reply.
    hold = f"touch {shlex.quote(str(held))} && head -c1 {shlex.quote(str(fifo))} >/dev/null"
    long_cell = (
        "import ctypes, os, time\n"
        f"while not os.path.exists({str(go)!r}):\n"
        "    time.sleep(0.05)\n"
        "if rank == 0:\n"
        f"    ctypes.PyDLL(None).system({hold.encode()!r})\n"
    )
    nb.ok(
        "import threading\nmod_local = 1\n"
        "long_cell = threading.Thread(target=get_ipython().run_cell_magic, "
        f"args=('sky', '', {long_cell!r}))\nlong_cell.start()"
    )
    try:
        # The head computes (its cell waits for `go`): its reader thread answers.
        wait_for(
            lambda: {"mod_local", "model", "model_steps"} <= set(complete(nb, "mod")),
            30,
            "the head's names while its cell runs",
        )
        assert "trainer.state.global_step" in complete(nb, "trainer.state.")
        go.touch()
        wait_for(held.exists, 30, "the head to hold its GIL")
        matches = complete(nb, "mod")  # a completer that waited for the head never replies
        assert "mod_local" in matches
        assert "model_steps" not in matches
    finally:
        go.touch()
        os.write(release, b"\0")
        try:
            assert nb.eval("long_cell.join(60); long_cell.is_alive()") is False
        finally:
            os.close(release)
    assert {"model", "model_steps"} <= set(complete(nb, "mod"))  # the head answers again


def test_a_slow_property_on_a_path_holds_neither_the_tab_nor_the_next_cell(
    nb: Kernel, tmp_path: Path
) -> None:
    """Tab after ``slow.later.`` runs the user's property on the head; it sleeps, and the
    completion comes without it, while the next cell runs and ends before it wakes.
    """
    woke = tmp_path / "woke"
    nb.ok(
        "%%sky\nimport pathlib, time\nclass Slow:\n    @property\n    def later(self):\n"
        f"        time.sleep(30)\n        pathlib.Path({str(woke)!r}).touch()\n"
        "        return self\nslow = Slow()"
    )
    assert complete(nb, "slow.later.") == []
    assert nb.ok("%%sky --all\nrank").per_rank == {0: "0", 1: "1"}
    assert not woke.exists(), "the cell waited for the property"


def test_who_lists_each_ranks_names_with_tensor_shape_dtype_and_device(nb: Kernel) -> None:
    head = nb.ok("%sky who").stdout
    rows = {line.split()[0]: line.split()[1:] for line in head.splitlines()[3:]}
    assert head.splitlines()[0] == "rank 0:"
    assert head.splitlines()[1].split() == ["Variable", "Type", "Shape", "Dtype", "Device"]
    assert rows["weights"] == ["Tensor", "3x4", "float16", "cpu"]
    assert rows["model"] == ["Sequential"]
    assert rows["model_steps"] == ["int"]
    assert rows["device"] == ["device"]  # the ready names are the rank's too
    assert "torch" not in rows and not [n for n in rows if n.startswith("_")]  # as %whos
    both = nb.ok("%sky who --ranks 0-1").stdout
    assert "rank 0:" in both and "rank 1:" in both and both.count("weights") == 2
    refused = nb.fails("%sky who --ranks 5")
    assert "--ranks 5: pool 'default' has ranks 0-1" in refused.stderr


def test_with_no_pool_the_notebooks_own_completions_stand_alone() -> None:
    """No pool ready: the matcher asks nothing and offers nothing; IPython's completions (the
    notebook's names, their attributes) are what Tab shows.
    """
    kernel = Kernel()
    try:
        kernel.ok("%config IPCompleter.use_jedi = False\n%load_ext skyward_jupyter")
        kernel.ok("modest = 'a notebook name'")
        assert complete(kernel, "mod") == ["modest"]
        assert [c for c in complete(kernel, "modest.up") if c.endswith("upper")]
        assert complete(kernel, "model.") == []  # bound nowhere: nothing to offer
    finally:
        kernel.close()

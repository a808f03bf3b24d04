"""The caller's wait for the IO thread: what each way of stopping it raises."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable

import pytest

from skyward_jupyter.io_thread import StoppedWaiting, wait
from skyward_jupyter.results import WaitInterrupted

WORDS = "stopped before it began, while it waited for the pool"


def _ctrl_c_times(n: int, then: Callable[[], None]) -> tuple[Callable[[], None], list[int]]:
    """An ``on_wait`` that is Ctrl-C the first ``n`` times it is called, then calls ``then``
    once; and the list that counts the interrupts ``wait`` asked for.
    """
    asked: list[int] = []
    pressed = [0]

    def on_wait() -> None:
        if pressed[0] < n:
            pressed[0] += 1
            raise KeyboardInterrupt
        if pressed[0] == n:
            pressed[0] += 1
            then()

    return on_wait, asked


@pytest.mark.parametrize("presses", [0, 1, 2])
def test_work_stopped_before_it_began_is_a_wait_interrupted_however_often_ctrl_c_came(
    presses: int,
) -> None:
    """Pool.interrupt elsewhere (no press here), one Ctrl-C, or a second while the first is
    handled: each time the caller gets the one-line WaitInterrupted, never the IO thread's own
    exception.
    """
    future: concurrent.futures.Future[None] = concurrent.futures.Future()
    on_wait, asked = _ctrl_c_times(presses, lambda: future.set_exception(StoppedWaiting(WORDS)))
    with pytest.raises(WaitInterrupted) as stopped:
        wait(future, lambda: asked.append(1), on_wait)
    assert str(stopped.value) == WORDS and len(asked) == presses
    assert stopped.value._render_traceback_() == [f"KeyboardInterrupt: {WORDS}"]


@pytest.mark.parametrize("presses", [0, 1, 2])
def test_a_cancelled_start_is_a_keyboard_interrupt_however_often_ctrl_c_came(
    presses: int,
) -> None:
    future: concurrent.futures.Future[None] = concurrent.futures.Future()
    on_wait, asked = _ctrl_c_times(presses, future.cancel)
    with pytest.raises(KeyboardInterrupt) as stopped:
        wait(future, lambda: asked.append(1), on_wait)
    assert type(stopped.value) is KeyboardInterrupt and len(asked) == presses

"""The rank's lowering of gloo's event-loop threads, on real threads of this process."""

from __future__ import annotations

import ctypes
import errno
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from skyward_jupyter.agent import gloo_loop
from skyward_jupyter.agent.gloo_loop import LoopPriority

pytestmark = pytest.mark.skipif(
    not os.path.isdir("/proc/self/task"), reason="threads are read from Linux's /proc"
)
_PR_SET_NAME = 15


@contextmanager
def named_thread(name: bytes | None, *, named: threading.Event | None = None) -> Iterator[int]:
    """A live thread of this process that names itself ``name`` (once ``named`` is set, when
    given); yields its thread id.
    """
    started, done = threading.Event(), threading.Event()
    tid: list[int] = []

    def run() -> None:
        tid.append(threading.get_native_id())
        started.set()
        if named is not None:
            named.wait()
        if name is not None:
            libc = ctypes.CDLL(None, use_errno=True)
            assert libc.prctl(_PR_SET_NAME, ctypes.c_char_p(name), 0, 0, 0) == 0
        done.wait()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    started.wait(10)
    try:
        yield tid[0]
    finally:
        if named is not None:
            named.set()
        done.set()
        thread.join(10)


def nice(tid: int) -> int:
    return os.getpriority(os.PRIO_PROCESS, tid)


def comm(tid: int) -> bytes:
    with open(f"/proc/self/task/{tid}/comm", "rb") as f:
        return f.read().strip()


def wait_named(tid: int, name: bytes) -> None:
    deadline = time.monotonic() + 10
    while comm(tid) != name:
        assert time.monotonic() < deadline, f"thread {tid} never named {name!r}"
        time.sleep(0.001)


def test_a_loop_thread_is_lowered_and_no_other() -> None:
    rank = nice(os.getpid())
    with named_thread(b"gloo_tcp_loop") as loop, named_thread(b"pt_gloo_runloop") as worker:
        wait_named(loop, b"gloo_tcp_loop")
        wait_named(worker, b"pt_gloo_runloop")
        LoopPriority().lower()
        assert nice(loop) == min(rank + 5, 19)
        assert nice(worker) == rank
        assert nice(os.getpid()) == rank


def test_a_thread_named_after_it_was_first_seen_is_still_lowered() -> None:
    priority = LoopPriority()
    naming = threading.Event()
    with named_thread(b"gloo_tcp_loop", named=naming) as loop:
        priority.lower()  # seen before its name: not decided yet
        naming.set()
        wait_named(loop, b"gloo_tcp_loop")
        priority.lower()
        assert nice(loop) == min(nice(os.getpid()) + 5, 19)


def test_a_thread_under_another_name_for_long_enough_is_not_read_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(gloo_loop, "NAMED_WITHIN", 0.0)
    priority = LoopPriority()
    with named_thread(b"other") as other:
        wait_named(other, b"other")
        priority.lower()
        opened: list[str] = []
        real_open = open
        monkeypatch.setattr(
            "builtins.open", lambda path, *a, **k: opened.append(path) or real_open(path, *a, **k)
        )
        priority.lower()
    assert not [p for p in opened if f"/{other}/" in p], "a decided thread was read again"


@pytest.mark.parametrize(
    ("error", "usable_after"),
    [(errno.EMFILE, True), (errno.EPERM, False), (errno.ENOSYS, False)],
)
def test_errors_never_escape_and_only_lasting_ones_stop_it(
    monkeypatch: pytest.MonkeyPatch, error: int, usable_after: bool
) -> None:
    """The watchdog thread calls lower(): an exception there would end the rank."""
    priority = LoopPriority()

    def failing(path: str) -> list[str]:
        raise OSError(error, os.strerror(error), path)

    monkeypatch.setattr(gloo_loop.os, "listdir", failing)
    priority.lower()
    monkeypatch.undo()
    with named_thread(b"gloo_tcp_loop") as loop:
        wait_named(loop, b"gloo_tcp_loop")
        priority.lower()
        assert (nice(loop) > nice(os.getpid())) is usable_after


def test_a_thread_name_that_is_not_utf8_is_no_error() -> None:
    with named_thread(b"\xff\xfe-odd") as odd, named_thread(b"gloo_tcp_loop") as loop:
        wait_named(odd, b"\xff\xfe-odd")
        wait_named(loop, b"gloo_tcp_loop")
        LoopPriority().lower()
        assert nice(loop) == min(nice(os.getpid()) + 5, 19)

"""Writes: the notebook's writes to watched memory are all seen, whoever makes them."""

from __future__ import annotations

import gc
import inspect
import mmap
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from skyward_jupyter import written
from skyward_jupyter.written import WRITES, Ranges, Writes, pages

AS_NOBODY = ("setpriv", "--reuid", "nobody", "--regid", "nogroup", "--clear-groups")


@pytest.fixture
def big() -> np.ndarray:
    return np.random.default_rng(0).random(1 << 18)  # 2 MiB


def _watch(value: object) -> object:
    found = pages([value])
    assert found is not None
    watch = WRITES.watch(found[0])
    assert watch is not None, "this kernel should support userfaultfd write-protection"
    return watch


def test_a_write_of_one_element_is_seen_and_reading_is_not_a_write(big: np.ndarray) -> None:
    watch = _watch(big)
    assert float(big.sum()) > 0 and not WRITES.written(watch)
    big[123_456] += 1.0
    assert WRITES.written(watch)


def test_a_write_by_the_kernel_on_the_notebooks_behalf_is_seen(
    big: np.ndarray, tmp_path: Path
) -> None:
    source = tmp_path / "bytes"
    source.write_bytes(os.urandom(64))
    watch = _watch(big)
    with source.open("rb", buffering=0) as f:
        assert f.readinto(memoryview(big).cast("B")[100_000:100_064]) == 64
    assert WRITES.written(watch)


def test_watching_a_view_does_not_forget_a_write_to_the_array_it_is_part_of(
    big: np.ndarray,
) -> None:
    whole = _watch(big)
    big[200_000] = -1.0  # inside the view below
    part = _watch(big[100_000:250_000])  # protects the written page again
    assert WRITES.written(whole) and not WRITES.written(part)


def test_shared_and_read_only_memory_is_not_watched(big: np.ndarray) -> None:
    shared = mmap.mmap(-1, 1 << 20)  # MAP_SHARED: another process could write it
    found = pages([shared])
    assert found is not None and WRITES.watch(found[0]) is None
    del found  # its views of the ends hold the mapping
    shared.close()
    frozen = big.copy()
    frozen.flags.writeable = False
    assert pages([frozen]) is None
    assert pages([big[::2]]) is None  # not contiguous


def test_only_whole_pages_are_watched_and_the_ends_are_read(big: np.ndarray) -> None:
    view = memoryview(big).cast("B")[100 : 100 + 3 * 4096]
    found = pages([view])
    assert found is not None
    (where,), (head, tail) = found
    assert where[1] - where[0] == 2 * 4096 and head.nbytes + tail.nbytes == 4096
    assert bytes(head) == bytes(view[: head.nbytes]) and bytes(tail) == bytes(view[-tail.nbytes :])


def test_a_user_without_privileges_gets_watches_too() -> None:
    """Unprivileged processes may handle only user-mode faults through a userfaultfd: enough,
    since asynchronous write-protection answers every fault in the kernel.
    """
    python = shutil.which("python3", path="/usr/bin:/bin")  # one that nobody may run
    if python is None:
        pytest.skip("no system python3 for the user nobody")
    script = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('written', {written.__file__!r})\n"
        "w = sys.modules['written'] = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(w)\n"
        "b = bytearray(4 << 20)\n"
        "watch = w.WRITES.watch(w.pages([b])[0])\n"
        "before = w.WRITES.written(watch)\n"
        "b[2 << 20] = 1\n"
        "print(watch is not None, before, w.WRITES.written(watch))\n"
    )
    done = subprocess.run(
        [*AS_NOBODY, python, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "False", "True"]


def descriptors() -> tuple[int, int]:
    """This process's userfaultfds and pagemaps open: what a ``Writes`` holds."""
    import os

    links = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            links.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # the directory's own descriptor, closed once listed
            continue
    return (
        sum(link == "anon_inode:[userfaultfd]" for link in links),
        sum(link.endswith("/pagemap") for link in links),
    )


def test_close_releases_the_descriptors_spoils_the_watches_and_a_watch_opens_anew(
    big: np.ndarray,
) -> None:
    where = _where(big)
    watch = WRITES.watch(where)
    assert watch is not None and not WRITES.written(watch)
    uffds, pagemaps = descriptors()
    assert uffds >= 1 and pagemaps >= 1
    WRITES.close()
    assert descriptors() == (uffds - 1, pagemaps - 1)
    assert WRITES.written(watch)  # nothing tells of its writes any more: hashed again
    again = WRITES.watch(where)
    assert again is not None and not WRITES.written(again)
    big[123_456] += 1.0
    assert WRITES.written(again)
    # Another Writes (on memory of its own: a range is one userfaultfd's) closes as it goes.
    own = mmap.mmap(-1, 4 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    writes = Writes()
    assert writes.watch(_where(own)) is not None
    assert descriptors() == (uffds + 1, pagemaps + 1)
    del writes
    gc.collect()
    assert descriptors() == (uffds, pagemaps)
    own.close()


def test_the_extensions_unload_closes_the_notebooks_descriptors() -> None:
    """The session's end (``%unload_ext``) closes what the notebook's one ``Writes`` opened;
    a later load watches again. In a real kernel.
    """
    from .test_magics import Kernel

    nb = Kernel()
    try:
        nb.ok("%load_ext skyward_jupyter")
        nb.ok(
            inspect.getsource(descriptors)
            + "import numpy\n"
            + "from skyward_jupyter.written import WRITES, pages\n"
            + "a = numpy.ones(1 << 18)\n"
            + "watch = WRITES.watch(pages([a])[0])\n"
        )
        assert nb.eval("(watch is not None, WRITES.written(watch), descriptors())") == (
            True,
            False,
            (1, 1),
        )
        nb.ok("%unload_ext skyward_jupyter")
        assert nb.eval("(WRITES.written(watch), descriptors())") == (True, (0, 0))
        nb.ok("%load_ext skyward_jupyter")
        assert nb.eval("(WRITES.watch(pages([a])[0]) is not None, descriptors())") == (
            True,
            (1, 1),
        )
    finally:
        nb.close()  # its template ends with it


def _where(value: object) -> Ranges:
    found = pages([value])
    assert found is not None
    return found[0]

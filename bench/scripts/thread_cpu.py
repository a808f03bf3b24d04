"""CPU time of this process's threads, by thread name: who in a rank used the CPU while it
trained (the training thread, torch's and gloo's threads, and on a pool the agent's own).

Read from ``/proc/self/task/*/schedstat`` (nanoseconds on a CPU); a Python thread is named by
``threading``, any other by the kernel's ``comm``. Standard library and the agent's list of its
threads only, Linux only: the scripts import it from their own directory under torchrun and
``%sky run`` alike (this checkout on their path).
"""

from __future__ import annotations

import os
import threading

from skyward_jupyter.agent.agent_threads import AGENT_THREADS

MAIN = "main"
"""The name :func:`per_thread` gives the process's first thread, which runs the script."""


def per_thread() -> dict[int, tuple[str, float]]:
    """Thread id -> (name, seconds on a CPU so far)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    # The process's first thread, where both launchers run the script, by its role: in a pool's
    # rank, forked from a template, Python 3.11's record of the main thread keeps the template
    # thread's native id, so the name would go to no thread of this process.
    names[os.getpid()] = MAIN
    seen: dict[int, tuple[str, float]] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                ns = int(f.read().split()[0])
            with open(f"/proc/self/task/{tid}/comm") as f:
                comm = f.read().strip()
        except OSError:
            continue  # the thread ended meanwhile
        seen[int(tid)] = (names.get(int(tid), comm), ns / 1e9)
    return seen


def spent(before: dict[int, tuple[str, float]]) -> dict[str, float]:
    """Seconds on a CPU since ``before``, summed by thread name (a thread started since then
    counts from zero; one that ended since is missing).
    """
    by_name: dict[str, float] = {}
    for tid, (name, seconds) in per_thread().items():
        start = before.get(tid, (name, 0.0))[1]
        by_name[name] = by_name.get(name, 0.0) + seconds - start
    return by_name


def pool_agent(by_name: dict[str, float]) -> float:
    """The seconds of the pool agent's threads in ``by_name`` (none under torchrun)."""
    return sum(by_name.get(name, 0.0) for name in AGENT_THREADS)

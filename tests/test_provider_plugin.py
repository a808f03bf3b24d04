"""A provider defined in this one file runs a cell, is listed by the lab server and is reaped.

Nothing outside this file knows the provider: it joins through
:func:`skyward_jupyter.providers.register`, the magics take ``--provider renamed`` from the
registry of names, the kernel's registry record names this module, and the server imports it to
reap the pool after its kernel died. The provider is the local one under another name, so the
test needs no machines of its own.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from skyward_jupyter.providers import register
from skyward_jupyter.providers.local import LocalProvider

if TYPE_CHECKING:
    from .lab import Lab

REPO = Path(__file__).resolve().parents[1]


@register
class RenamedLocal(LocalProvider):
    """Ranks on this machine, as ``--provider renamed``."""

    name = "renamed"


# The kernel imports this module to get the provider: the test's helpers are imported inside
# the functions, so that the kernel does not run the test session's conftest.


@pytest.fixture
def lab(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Lab]:
    from .conftest import agent_pids, wait_for
    from .lab import jupyter_lab

    # The server and its kernels import this module by name, as they would a plugin package.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    with jupyter_lab(tmp_path) as server:
        yield server
    wait_for(lambda: not agent_pids(), 30, "the lab kernels' ranks to end with the server")


def pools(lab: Lab) -> list[dict[str, Any]]:
    from .lab import api

    status, body = api(lab, "GET", "/skyward/pools")
    assert status == 200, body
    return list(body["pools"])


def test_a_provider_from_one_file_runs_is_listed_and_is_reaped(lab: Lab) -> None:
    from .conftest import agent_pids, wait_for
    from .lab import Kernel, api, rank_pids

    kernel = Kernel(lab)
    try:
        kernel.run(f"import {__name__}\n%load_ext skyward_jupyter")
        out = kernel.run(
            "%%sky --provider renamed --nodes 2\n"
            "import torch, torch.distributed as dist\n"
            "t = torch.ones(1) * (dist.get_rank() + 1)\n"
            "dist.all_reduce(t)\n"
            "print('sum', t.item())"
        )
        assert "sum 3.0" in out, out
        assert "renamed" in kernel.run("%sky status"), out

        wait_for(lambda: len(pools(lab)) == 1, 10, f"the pool in the server's listing: {out}")
        (pool,) = pools(lab)
        assert pool["provider"] == "renamed" and pool["world_size"] == 2, pool
        assert "renamed" in pool["description"]
        ranks = rank_pids(pool)
        assert len(ranks) == 2 and ranks <= agent_pids()

        os.kill(kernel.pid(), signal.SIGKILL)
        wait_for(lambda: pools(lab)[0]["orphan"], 30, "the pool to be an orphan")
        status, body = api(lab, "DELETE", f"/skyward/pools/{pool['id']}")
        assert status == 200 and body["how"] == "reaped", body
        assert not any("cannot reap" in note for note in body["notes"]), body
        assert ranks <= set(body["killed"]) | set(body["gone"]), body
        wait_for(lambda: not ranks & agent_pids(), 10, "the orphan's ranks to end")
        assert pools(lab) == []
    finally:
        kernel.close()

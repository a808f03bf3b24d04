"""A provider from a package of its own (``tests/plugins/fake_hosts``), installed as a user
would install it, runs cells in a real kernel, has its options in the help and its errors in one
line, is listed by the lab server and is reaped.

Nothing in skyward_jupyter names it: it is found through its entry point in the group
``skyward_jupyter.providers``; the magics take ``--fake-hosts`` from its options dataclass, and
the server finds it by the same entry point to reap the pool after its kernel died.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import tomllib

from skyward_jupyter.providers import BUILT_IN, GROUP

from .conftest import agent_pids, wait_for
from .lab import Kernel, Lab, api, jupyter_lab, rank_pids

REPO = Path(__file__).resolve().parents[1]
PLUGIN = Path(__file__).resolve().parent / "plugins" / "fake_hosts"


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The plugin installed by pip into a directory of its own (its code and its dist-info,
    which is where its entry point is read), as ``pip install`` puts a package on a path.
    """
    target = tmp_path_factory.mktemp("site")
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation"]
    subprocess.run([*pip, "--no-index", "--target", str(target), str(PLUGIN)], check=True)
    return target


@pytest.fixture
def lab(installed: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Lab]:
    # The server and its kernels see the plugin where it was installed, and this checkout.
    path = [str(installed), str(REPO), os.environ.get("PYTHONPATH", "")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(path))
    with jupyter_lab(tmp_path) as server:
        yield server
    wait_for(lambda: not agent_pids(), 30, "the lab kernels' ranks to end with the server")


def pools(lab: Lab) -> list[dict[str, Any]]:
    status, body = api(lab, "GET", "/skyward/pools")
    assert status == 200, body
    return list(body["pools"])


def fails(kernel: Kernel, code: str) -> str:
    """What ``code`` says as it fails (it must fail)."""
    reply, text = kernel.collect(kernel.client.execute(code), 60)
    assert reply["status"] == "error", text
    return text


def test_a_provider_from_its_own_package_runs_is_listed_and_is_reaped(lab: Lab) -> None:
    kernel = Kernel(lab)
    try:
        kernel.run("%load_ext skyward_jupyter")
        # %%sky? lists the plugin's options under its name, and its name among the providers.
        page = kernel.run("%%sky --help\npass")
        own = page.split("\nfake provider options:\n")[1].split("options:")[0]
        assert "--fake-hosts N" in own and "fake hosts, one node each" in own, page
        assert "local, aws, fake, ray, slurm, ssh" in " ".join(page.split()), page
        assert "%%sky --provider fake --fake-hosts 2" in page, page
        # A bad value is one line naming the option; nothing starts.
        for given, why in [
            ("0", "--fake-hosts: must be from 1 to 8 hosts, got 0"),
            ("two", "--fake-hosts: expected a whole number of hosts, got 'two'"),
        ]:
            said = fails(kernel, f"%%sky --provider fake --fake-hosts {given}\nprint('RAN')")
            assert said == f"UsageError: {why}\n", said
        assert not agent_pids()

        out = kernel.run(
            "%%sky --provider fake --fake-hosts 2\n"
            "import torch, torch.distributed as dist\n"
            "t = torch.ones(1) * (dist.get_rank() + 1)\n"
            "dist.all_reduce(t)\n"
            "print('sum', t.item())"
        )
        assert "sum 3.0" in out, out
        assert "2 fake hosts" in kernel.run("%sky status"), out
        # Its own option alone chooses it (no other provider has --fake-hosts).
        assert "2 fake hosts" in kernel.run("%sky config --fake-hosts 2")

        wait_for(lambda: len(pools(lab)) == 1, 10, f"the pool in the server's listing: {out}")
        (pool,) = pools(lab)
        assert pool["provider"] == "fake" and pool["world_size"] == 2, pool
        assert "2 fake hosts" in pool["description"], pool
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


def test_nothing_in_the_package_names_the_plugin() -> None:
    sources = (REPO / "skyward_jupyter").rglob("*.py")
    assert not [p for p in sources if "fake_hosts" in p.read_text() or "fake" in p.stem]


def test_the_built_in_providers_are_this_packages_entry_points() -> None:
    """The names read while an install predates the entry points are the ones declared."""
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["entry-points"]
    assert declared[GROUP] == BUILT_IN


def _installed(site: Path, name: str, entry_points: str) -> None:
    """A distribution ``skyward-NAME`` in ``site`` whose entry points are ``entry_points``
    (lines of the providers' group), as an installer leaves one.
    """
    info = site / f"skyward_{name}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: skyward-{name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[{GROUP}]\n{entry_points}")


def _output_of(site: Path, code: str) -> str:
    """What ``code`` prints in a fresh Python that sees ``site`` and this checkout."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(REPO)])}
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout


def test_a_provider_that_cannot_load_leaves_the_others_and_says_why(tmp_path: Path) -> None:
    """An installed entry point whose module is gone (a package half uninstalled): the
    magics still load with every other provider, a warning names it, and asking for it is
    one line saying why.
    """
    _installed(tmp_path, "gone", "gone = skyward_gone:GoneProvider\n")
    code = (
        "import warnings\n"
        "warnings.simplefilter('always')\n"
        "with warnings.catch_warnings(record=True) as said:\n"
        "    from skyward_jupyter.magics import _help\n"
        "print('WARNED', *[str(w.message) for w in said])\n"
        "print('HELP', 'ssh provider options' in _help())\n"
        "from skyward_jupyter.session import USER_ERRORS, Session\n"
        "try:\n"
        "    Session().spec_from({'provider': 'gone'})\n"
        "except USER_ERRORS as exc:\n"
        "    print('REFUSED', exc)\n"
    )
    out = _output_of(tmp_path, code)
    why = (
        "the gone provider cannot be loaded from skyward_gone:GoneProvider (No module named "
        "'skyward_gone'); reinstall its package, or uninstall it"
    )
    assert f"WARNED {why}\n" in out, out
    assert "HELP True\n" in out, out
    assert f"REFUSED {why}\n" in out, out


CLASH = """
from dataclasses import dataclass
from skyward_jupyter.providers.base import ProviderOptions, option
from skyward_jupyter.providers.local import LocalProvider

@dataclass(frozen=True)
class ClashOptions(ProviderOptions):
    nodes: int = option("its own node count", default=1)

class ClashProvider(LocalProvider):
    name = "clash"
    Options = ClashOptions

@dataclass(frozen=True)
class SwitchOptions(ProviderOptions):
    python: bool = option("a switch where the others take a path", action="store_true")

class SwitchProvider(LocalProvider):
    name = "abc"  # before this package's own by name: they still come first
    Options = SwitchOptions
"""


def test_a_provider_whose_options_clash_with_the_pools_is_left_out_and_the_rest_runs(
    tmp_path: Path,
) -> None:
    """An installed provider that declares ``--nodes`` (every pool's), and one that takes
    ``--python`` as a switch (the others' path): the magics load, a warning names each, the help
    and the other providers' pools work, and asking for one is a line saying why.
    """
    _installed(
        tmp_path,
        "clash",
        "clash = skyward_clash:ClashProvider\nabc = skyward_clash:SwitchProvider\n",
    )
    (tmp_path / "skyward_clash.py").write_text(CLASH)
    code = (
        "import warnings\n"
        "warnings.simplefilter('always')\n"
        "with warnings.catch_warnings(record=True) as said:\n"
        "    from skyward_jupyter.magics import _help\n"
        "    page = _help()\n"
        "    print('HELP', 'ssh provider options' in page, 'its own node count' in page)\n"
        "    from skyward_jupyter.session import USER_ERRORS, Session\n"
        "    print('LOCAL', Session().spec_from({'nodes': 2}).nodes)\n"
        "    try:\n"
        "        Session().spec_from({'provider': 'clash'})\n"
        "    except USER_ERRORS as exc:\n"
        "        print('REFUSED', exc)\n"
        "print('WARNED', *[str(w.message) for w in said], sep='\\n')\n"
    )
    out = _output_of(tmp_path, code)
    why = (
        "the clash provider declares --nodes, which every pool has: a provider's options need "
        "names of their own; it is left out (update or uninstall its package)"
    )
    other = (
        "the abc provider declares --python differently from the aws provider: a flag "
        "providers share takes its values alike; it is left out (update or uninstall its package)"
    )
    assert out.endswith(f"WARNED\n{other}\n{why}\n"), out  # each said once
    assert "HELP True False\n" in out, out
    assert "LOCAL 2\n" in out, out
    assert f"REFUSED {why}" in out, out

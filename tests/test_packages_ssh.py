"""``--pip`` / ``--requirements`` on honest SSH hosts: their Python has torch, cloudpickle and pip,
and nothing else of the notebook's (tests/hosts.py's private hosts, each with its own home and
cache, in network namespaces with no route out).

The hosts reach no package index: the tests that install give pip this machine's file index
(``file:///opt/pypi/simple``, which the hosts see) as a requirements line, standing in for an
index the nodes can reach; one test leaves it out and reads pip's reason.
"""

from __future__ import annotations

import asyncio
import importlib.metadata as metadata
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from skyward_jupyter.environments import Packages, PackagesError, notebook_uv
from skyward_jupyter.pool import Pool

from .conftest import agents_among, ssh_hosts_fixture, wait_for
from .honest_python import WITHOUT_TORCH
from .honest_python import honest_python as made_honest_python
from .hosts import Hosts, ssh_provider
from .test_packages import IMPORT_BOTH

hosts = ssh_hosts_fixture(2, "hosts")
INDEX = "--index-url=file:///opt/pypi/simple"
ON_HOSTS = Packages((INDEX, "tabulate", "ujson"))
"""The pure-Python and the compiled package, from an index the hosts can read."""


@pytest.fixture(scope="module")
def honest_python() -> Iterator[str]:
    with made_honest_python() as python:
        yield python


def _on_host(hosts: Hosts, i: int, python: str, code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        hosts.inside_argv(i, python, "-c", code), capture_output=True, text=True, timeout=60
    )


def _exists(hosts: Hosts, i: int, python: str, path: str) -> bool:
    there = _on_host(hosts, i, python, f"import os; print(os.path.isdir({path!r}))")
    assert there.returncode == 0, there
    return there.stdout.strip() == "True"


def test_the_honest_hosts_have_torch_but_not_the_notebooks_other_packages(
    hosts: Hosts, honest_python: str
) -> None:
    found = _on_host(hosts, 0, honest_python, "import torch, cloudpickle; print(torch.__version__)")
    assert found.returncode == 0 and found.stdout.strip() == metadata.version("torch"), found
    for name in ("tabulate", "ujson", "asyncssh", "ipywidgets"):
        assert _on_host(hosts, 0, honest_python, f"import {name}").returncode != 0, name


def test_pip_packages_import_on_every_ssh_rank_and_a_second_pool_finds_them_cached(
    hosts: Hosts, honest_python: str, tmp_path: Path
) -> None:
    provider = ssh_provider(hosts, 2, tmp_path, python=honest_python)
    with Pool(nodes=2, provider=provider, packages=ON_HOSTS) as pool:
        result = pool.run(IMPORT_BOTH)
        assert result.ok, result.errors
        files = [v[0] for v in result.values]
        home = f"/home/{hosts.user}/.cache/skyward_jupyter/envs/"
        assert all(f.startswith(home) for f in files), files
        assert [v[1] for v in result.values] == ['{"rank":0}', '{"rank":1}']
        built = pool.environments
        assert [built[n].cached for n in (0, 1)] == [False, False]
        assert [built[n].packages for n in (0, 1)] == [2, 2]
        assert all(built[n].installer.startswith("uv ") for n in (0, 1)), built  # sent once
    again = ssh_provider(hosts, 2, tmp_path, python=honest_python)
    with Pool(nodes=2, provider=again, packages=ON_HOSTS) as pool:
        assert [pool.environments[n].cached for n in (0, 1)] == [True, True]
        assert pool.run(IMPORT_BOTH).ok
    wait_for(lambda: not _remote_agents(hosts), 10, "remote ranks to end after close")


def test_a_bad_spec_names_the_host_the_package_and_the_installers_reason(
    hosts: Hosts, honest_python: str, tmp_path: Path
) -> None:
    provider = ssh_provider(hosts, 1, tmp_path, python=honest_python)
    bad = Packages((INDEX, "skyward-no-such-package-xq"))
    with pytest.raises(PackagesError) as failed:
        Pool(nodes=1, provider=provider, packages=bad).start()
    text = str(failed.value)
    assert "\n" not in text, text
    assert text.startswith(f"{hosts.user}@{hosts[0].address}:{hosts[0].port}: "), text
    assert "skyward-no-such-package-xq was not found in the package registry" in text, text
    wait_for(lambda: not _remote_agents(hosts), 10, "no rank left on the hosts")


def test_a_host_without_an_index_fails_naming_it_and_pips_reason(
    hosts: Hosts, honest_python: str, tmp_path: Path
) -> None:
    """The hosts have no route out: pip (with this machine's global configuration) finds no
    index and says so; the pool does not start.
    """
    provider = ssh_provider(hosts, 1, tmp_path, python=honest_python)
    with pytest.raises(PackagesError) as failed:
        Pool(nodes=1, provider=provider, packages=Packages(("tabulate",))).start()
    text = str(failed.value)
    assert "\n" not in text and "tabulate" in text, text
    assert "no package index answered from this node (" in text, text
    assert text.startswith(f"{hosts.user}@{hosts[0].address}:{hosts[0].port}: "), text
    wait_for(lambda: not _remote_agents(hosts), 10, "no rank left on the hosts")


def _remote_agents(hosts: Hosts) -> list[int]:
    return agents_among(pid for i in range(len(hosts)) for pid in hosts.pids(i))


def test_hosts_without_an_index_install_wheels_sent_from_the_notebook(
    hosts: Hosts,
    honest_python: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``--ship-wheels``: the notebook downloads the wheels once (this machine reaches the
    index), each host gets them and installs with no index at all; a second pool sends none.
    """
    monkeypatch.setenv("SKYWARD_WHEELS", str(tmp_path / "wheels"))
    shipped = Packages(("tabulate", "ujson"), wheels=True)
    said: list[str] = []
    provider = ssh_provider(hosts, 2, tmp_path, python=honest_python)
    pool = Pool(nodes=2, provider=provider, packages=shipped)
    pool.subscribe(lambda event: said.append(str(getattr(event, "detail", ""))))
    with pool:
        result = pool.run(IMPORT_BOTH)
        assert result.ok, result.errors
        assert [v[1] for v in result.values] == ['{"rank":0}', '{"rank":1}']
    downloaded = sorted(p.name.split("-")[0] for p in (tmp_path / "wheels").glob("*/*.whl"))
    assert downloaded == ["tabulate", "ujson"]
    # the notebook sends them once; the other host fetches them from the first one's relay
    assert sum("sending wheels" in line for line in said) == 1, said
    assert sum("fetching wheels" in line and "from node 0" in line for line in said) == 1, said
    said.clear()
    again = Pool(nodes=2, provider=ssh_provider(hosts, 2, tmp_path, python=honest_python),
                 packages=shipped)  # fmt: skip
    again.subscribe(lambda event: said.append(str(getattr(event, "detail", ""))))
    with again:
        assert [again.environments[n].cached for n in (0, 1)] == [True, True]
    assert not any("sending wheels" in line for line in said), said
    wait_for(lambda: not _remote_agents(hosts), 10, "remote ranks to end after close")


def test_mirror_gives_index_less_hosts_the_notebooks_versions_through_the_session(
    hosts: Hosts, honest_python: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--mirror --ship-wheels``: what the notebook's namespace uses (xxhash, compiled, and
    pathspec), at the notebook's versions, on hosts whose Python has neither and no index.
    """
    import pathspec
    import xxhash

    from skyward_jupyter.session import Session

    monkeypatch.setenv("SKYWARD_WHEELS", str(tmp_path / "wheels"))
    said: list[str] = []
    namespace = {"xxhash": xxhash, "GitIgnoreSpec": pathspec.GitIgnoreSpec}
    session = Session(announce=said.append, namespace=namespace)
    spec = session.spec_from(
        {
            "hosts": ",".join(f"{hosts.user}@{hosts[i].address}:{hosts[i].port}" for i in (0, 1)),
            "identity": str(hosts.client_key),
            "known_hosts": str(hosts.known_hosts),
            "python": honest_python,
            "no_sync": True,
            "mirror": True,
            "ship_wheels": True,
        }
    )
    try:
        result = session.run_cell(
            "import xxhash, pathspec\n(xxhash.VERSION, pathspec.__version__)", {}, spec=spec
        )
        assert result.ok, (result.errors, said)
        assert result.values == [(xxhash.VERSION, pathspec.__version__)] * 2
    finally:
        session.down_all()
    mirrored = [line for line in said if "--mirror" in line]
    assert mirrored == [
        f"pool 'default': --mirror: the nodes get pathspec=={pathspec.__version__}, "
        f"xxhash=={xxhash.VERSION}"
    ], said
    # torch's build per node, said once: these CPU hosts' torch is the notebook's CPU build
    torch = metadata.version("torch")
    chosen = [line for line in said if "torch per node" in line]
    kept = f"torch {torch} kept (the cpu build suits it)"
    assert len(chosen) == 1 and chosen[0].count(kept) == 2, said
    wait_for(lambda: not _remote_agents(hosts), 10, "remote ranks to end after close")


def test_clean_removes_the_hosts_environments_that_no_rank_uses(
    hosts: Hosts, honest_python: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """...and what was sent for them (the wheels of ``--ship-wheels``, uv), while no build
    runs.
    """
    monkeypatch.setenv("SKYWARD_WHEELS", str(tmp_path / "wheels"))
    provider = ssh_provider(hosts, 2, tmp_path, python=honest_python)
    with Pool(nodes=2, provider=provider, packages=Packages(("ujson",), wheels=True)) as pool:
        site = pool.environments[0].site
        busy = asyncio.run(ssh_provider(hosts, 2, tmp_path, python=honest_python).clean())
        # The environment in use stays; the wheels it was built from go (no build runs).
        assert all("kept" in line and "1 folder of wheels" in line for line in busy), busy
        assert pool.run("import ujson\nujson.__name__").values == ["ujson"] * 2
        for i in (0, 1):
            assert _exists(hosts, i, honest_python, site)
    lines = asyncio.run(ssh_provider(hosts, 2, tmp_path, python=honest_python).clean())
    assert all(re.search(r": removed \d+ package environments? ", line) for line in lines), lines
    for i in (0, 1):
        assert not _exists(hosts, i, honest_python, site)
        listing = _on_host(
            hosts,
            i,
            honest_python,
            "import os; print([[n for n in os.listdir(f) if n != '.lock'] for f in "
            f"({str(tmp_path / 'cache' / 'wheels')!r}, {str(tmp_path / 'cache' / 'uv')!r}) "
            "if os.path.isdir(f)])",
        )
        assert listing.stdout.strip() == ("[[], []]" if notebook_uv() else "[[]]"), listing
    wait_for(lambda: not _remote_agents(hosts), 10, "remote ranks to end after close")


def test_a_host_without_torch_gets_the_notebooks_cpu_build_and_runs_torch_distributed(
    hosts: Hosts, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A host whose Python has cloudpickle but no torch, and no index: with ``--ship-wheels``
    the notebook sends torch's CPU wheel (this machine's cache) with the packages; two ranks
    there form a process group with it.
    """
    monkeypatch.setenv("SKYWARD_WHEELS", str(tmp_path / "wheels"))
    with made_honest_python(WITHOUT_TORCH) as python:
        assert _on_host(hosts, 0, python, "import torch").returncode != 0
        said: list[str] = []
        provider = ssh_provider(hosts, 1, tmp_path, python=python)
        pool = Pool(
            nodes=1, procs_per_node=2, provider=provider,
            packages=Packages(("tabulate",), wheels=True),
        )  # fmt: skip
        pool.subscribe(lambda event: said.append(str(getattr(event, "detail", ""))))
        with pool:
            result = pool.run(
                "import torch, torch.distributed as dist, tabulate\n"
                "t = torch.ones(1)\ndist.all_reduce(t)\n"
                "(t.item(), torch.__version__, torch.__file__)"
            )
            assert result.ok, result.errors
            torch = metadata.version("torch")
            assert [v[:2] for v in result.values] == [(2.0, torch)] * 2
            assert all(v[2].startswith(pool.environments[0].site) for v in result.values)
            assert pool.environments[0].torch == f"torch {torch} installed (no NVIDIA driver)"
            assert pool.environments[0].own_torch
        assert any("sending wheels" in line for line in said), said
    wait_for(lambda: not _remote_agents(hosts), 10, "remote ranks to end after close")

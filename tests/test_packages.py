"""``--pip`` / ``--requirements``: every node's environment, built once per content and reused,
layered over the node's Python, with real installs (pip against this machine's indexes) and
real ranks.

The local provider's tests here; the SSH hosts' (whose Python has torch and cloudpickle only)
are in tests/test_packages_ssh.py.
"""

from __future__ import annotations

import asyncio
import importlib.metadata as metadata
import io
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from skyward_jupyter.agent import environments as node_environments
from skyward_jupyter.agent.environments import torch_build
from skyward_jupyter.display.text import TextReport
from skyward_jupyter.environments import BUILDER, Packages, PackagesError, notebook_uv
from skyward_jupyter.pool import Pool
from skyward_jupyter.providers.local import LocalProvider
from skyward_jupyter.spec import PoolSpec

from .conftest import agent_pids

ROOT = Path(__file__).resolve().parents[1]
PURE_AND_COMPILED = Packages(("tabulate", "ujson"))
"""A pure-Python package and one with a compiled wheel, neither in the notebook's venv."""
IMPORT_BOTH = (
    "import os, tabulate, ujson\n"
    "(tabulate.__file__, ujson.dumps({'rank': int(os.environ['RANK'])}))"
)


@pytest.fixture
def envs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A cache of environments of the test's own (the builder and the ranks read it)."""
    root = tmp_path / "envs"
    monkeypatch.setenv("SKYWARD_ENVS", str(root))
    monkeypatch.setenv("SKYWARD_WHEELS", str(tmp_path / "wheels"))
    yield root


def test_the_notebook_lacks_the_test_packages() -> None:
    """Otherwise the tests below would prove nothing."""
    for name in ("tabulate", "ujson"):
        with pytest.raises(ImportError):
            __import__(name)


def test_pip_packages_import_on_every_local_rank_and_a_second_pool_finds_them_cached(
    envs: Path,
) -> None:
    out = io.StringIO()
    text = TextReport(out)  # the text view; the panel folds the same node events
    pool = Pool(nodes=2, procs_per_node=1, packages=PURE_AND_COMPILED)
    pool.subscribe(text.on_event)
    with pool:
        result = pool.run(IMPORT_BOTH)
        assert result.ok, result.errors
        files = [v[0] for v in result.values]
        assert all(f.startswith(str(envs)) for f in files), files
        assert [v[1] for v in result.values] == ['{"rank":0}', '{"rank":1}']
        first = pool.environments
        assert set(first) == {0, 1} and not first[0].cached and first[0].packages == 2
        assert first[0].installer.startswith("uv "), first[0]  # this machine's uv, fetched once
    text.flush()
    shown = out.getvalue().splitlines()
    for node in (0, 1):
        steps = [line for line in shown if line.startswith(f"node {node}: booting, packages")]
        assert any(": installing " in line for line in steps), shown
        assert steps[-1] == (
            f"node {node}: booting, packages ready: env {first[0].digest[:12]} (2 packages, "
            f"{first[0].installer})"
        ), shown
    with Pool(nodes=1, packages=PURE_AND_COMPILED) as again:
        assert again.environments[0].cached
        assert again.environments[0].site == first[0].site
        assert again.run(IMPORT_BOTH).ok


def test_a_bad_spec_fails_the_start_in_one_line_naming_the_package_and_starts_no_rank(
    envs: Path,
) -> None:
    before = agent_pids()
    with pytest.raises(PackagesError) as failed:
        Pool(nodes=1, packages=Packages(("skyward-no-such-package-xq",))).start()
    text = str(failed.value)
    assert "\n" not in text, text
    assert text.startswith("this machine: could not install the packages:"), text
    assert "skyward-no-such-package-xq" in text, text
    assert agent_pids() - before == set()
    assert not any(envs.glob("*/")), "a failed build leaves nothing that looks built"


def _build(envs: Path, requirements: list[str], uv: bool = False) -> subprocess.Popen[str]:
    request = {
        "hash": Packages(tuple(requirements)).digest,
        "requirements": requirements,
        "uv": str(notebook_uv()) if uv else None,
    }
    process = subprocess.Popen(
        [sys.executable, *BUILDER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), "SKYWARD_ENVS": str(envs)},
    )
    assert process.stdin is not None
    process.stdin.write(json.dumps(request) + "\n")
    process.stdin.close()
    return process


def _report(process: subprocess.Popen[str]) -> dict[str, object]:
    assert process.stdout is not None
    out = process.stdout.read()
    process.wait(120)
    last: dict[str, object] = json.loads(out.strip().splitlines()[-1])
    return last


def test_two_builders_of_the_same_packages_build_once(envs: Path) -> None:
    """Two kernels asking for the same packages at once: one installs, the other waits for it
    and finds it built (the lock), and both get the same whole environment.
    """
    first, second = _build(envs, ["tabulate"]), _build(envs, ["tabulate"])
    reports = [_report(first), _report(second)]
    assert sorted(bool(r["cached"]) for r in reports) == [False, True], reports
    assert reports[0]["ready"] == reports[1]["ready"]
    assert [p.name for p in envs.iterdir() if p.is_dir()] == [
        Path(str(reports[0]["ready"])).parts[len(envs.parts)]
    ]


USE_AND_WAIT = """
from skyward_jupyter.agent.environments import use
use({site!r})
import tabulate
print(tabulate.__file__, flush=True)
input()
"""


def test_clean_keeps_an_environment_a_rank_uses_and_removes_it_after(envs: Path) -> None:
    report = _report(_build(envs, ["tabulate"]))
    assert report["cached"] is False
    site = str(report["ready"])
    user = subprocess.Popen(
        [sys.executable, "-c", USE_AND_WAIT.format(site=site)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert user.stdout is not None and user.stdin is not None
    try:
        assert user.stdout.readline().startswith(site)
        removed, kept = node_environments.clean()
        assert removed == [] and len(kept) == 1, (removed, kept)
    finally:
        user.stdin.close()
        user.wait(10)
    removed, kept = node_environments.clean()
    assert kept == [] and [str(path) for path, _ in removed] == [str(Path(site).parents[2])]
    assert node_environments.cached(Packages(("tabulate",)).digest) is None


def test_local_clean_says_what_went(envs: Path) -> None:
    _report(_build(envs, ["tabulate"]))
    wheels = Packages(("tabulate",), wheels=True).download()  # what --ship-wheels keeps here
    assert [w.name.split("-")[0] for w in wheels.glob("*.whl")] == ["tabulate"]
    lines = asyncio.run(LocalProvider().clean())
    assert len(lines) == 1, lines
    assert lines[0].startswith(
        "this machine: removed 1 package environment and 1 folder of wheels ("
    ), lines
    assert not wheels.exists()


def test_pip_and_requirements_options_make_the_pools_packages(tmp_path: Path) -> None:
    """``%%sky --pip ... --requirements FILE`` (and ``%sky config`` defaults): the file is read
    when given, so a pool is described by what it asks for; another list is another pool.
    """
    from skyward_jupyter.magics import _cell_parser
    from skyward_jupyter.options import pool_options
    from skyward_jupyter.session import Session

    wanted = tmp_path / "requirements.txt"
    wanted.write_text("# pinned\nujson==6.1.0  # compiled\n\n--index-url=file:///opt/pypi/simple\n")
    parser = _cell_parser()
    args = parser.parse(
        ["--pip", "tabulate", "rich>=13", "--requirements", str(wanted), "--nodes", "2"]
    )
    session = Session()
    spec = session.spec_from(pool_options(args))
    packages = spec.pool_arguments(str(tmp_path), {})["packages"]
    assert packages.requirements == (
        "tabulate",
        "rich>=13",
        "ujson==6.1.0",
        "--index-url=file:///opt/pypi/simple",
    )
    assert spec.nodes == 2
    session.defaults = spec  # as %sky config sets them
    same = session.spec_from({})
    assert same == spec
    other = session.spec_from(pool_options(parser.parse(["--pip", "tabulate"])))
    assert other != spec and "--pip" in spec.differences(other)
    assert "packages" not in PoolSpec().pool_arguments(str(tmp_path), {})
    with pytest.raises(Exception, match="cannot read"):
        parser.parse(["--requirements", str(tmp_path / "missing.txt")])


@pytest.mark.parametrize("uv", [False, True], ids=["pip", "uv"])
def test_no_requirement_chooses_torch_the_node_has_it_pinned(envs: Path, uv: bool) -> None:
    """torch is pinned to the node's version for every install: a requirement asking another
    fails with the installer's reason, and nothing is downloaded or built. What the node has
    counts as installed for uv too (cloudpickle: nothing added for it).
    """
    report = _report(_build(envs, ["torch==2.12.0"], uv))
    assert "error" in report, report
    assert "torch" in str(report["error"]) and "\n" not in str(report["error"]), report
    assert not [p for p in envs.iterdir() if p.is_dir()]
    report = _report(_build(envs, ["tabulate", "cloudpickle"], uv))
    assert report["packages"] == 1, report
    assert str(report["installer"]).startswith("uv " if uv else "pip"), report
    site = Path(str(report["ready"]))
    assert [d.name.split("-")[0] for d in site.glob("*.dist-info")] == ["tabulate"]


def test_torchs_build_for_a_nodes_driver() -> None:
    """``--mirror`` and nodes without torch: no driver, the CPU build; a driver, the newest
    CUDA build it supports; a node whose torch is that build of the notebook's version keeps it.
    """
    assert [torch_build(v) for v in (None, (12, 4), (12, 5), (13, 1), (11, 8))] == [
        "cpu", "cu124", "cu124", "cu130", "cu118",
    ]  # fmt: skip
    with pytest.raises(node_environments.BuildError, match=r"CUDA 11\.4, older than"):
        torch_build((11, 4))
    plan = node_environments._torch_plan
    if node_environments.driver_cuda() is None:  # this machine: no NVIDIA driver
        kept = plan(("2.13.0+cpu", None), "2.13.0+cpu", True, False)
        assert kept == ([], ["torch==2.13.0+cpu"], "torch 2.13.0+cpu kept (the cpu build suits it)")
        other = plan(("2.12.0+cu126", "12.6"), "2.13.0+cpu", True, False)
        assert other == (
            [f"--extra-index-url {node_environments.CPU_INDEX}", "torch==2.13.0+cpu"],
            ["torch==2.13.0+cpu"],
            "torch 2.13.0+cpu installed (no NVIDIA driver, over 2.12.0+cu126)",
        )
        cuda = plan(
            ("2.13.0+cu126", "12.6"), "2.13.0+cpu", True, True
        )  # the version, not the build
        assert cuda[2] == "torch 2.13.0+cpu installed (no NVIDIA driver, over 2.13.0+cu126)"
        none = plan(None, "2.13.0+cpu", False, True)  # shipped wheels: no index named
        assert none[0] == ["torch==2.13.0+cpu"], none
    # without --mirror, a node's own torch stays whatever it is
    assert plan(("2.12.0+cu126", "12.6"), "2.13.0+cpu", False, False)[0] == []


def test_a_node_without_an_index_is_sent_the_torch_its_build_will_install(
    tmp_path: Path,
) -> None:
    """``--ship-wheels`` to a node without torch (or, ``--mirror``, with another): the node
    says which torch its build will install (the build's own decision, made there with its
    driver), and the notebook downloads that one: from its own sources where it is the
    notebook's, else from PyTorch's index of that build. A driver too old for any build is
    refused in one line. (This machine's Python stands for the node: torch 2.13.0+cpu.)
    """
    from skyward_jupyter.environments import TORCH_WANTED, torch_sources

    fake = tmp_path / "bin"
    fake.mkdir()

    def wanted(notebook: str, variant: bool, cuda: str | None = None) -> dict[str, str | None]:
        smi = fake / "nvidia-smi"
        smi.unlink(missing_ok=True)
        if cuda is not None:
            line = f"| NVIDIA-SMI 570.1  Driver Version: 570.1  CUDA Version: {cuda} |"
            smi.write_text(f"#!/bin/sh\necho '{line}'\n")
            smi.chmod(0o755)
        said = subprocess.run(
            [sys.executable, *TORCH_WANTED],
            input=json.dumps({"torch": notebook, "variant": variant}) + "\n",
            capture_output=True,
            text=True,
            env={**os.environ, "PATH": f"{fake}:/usr/bin:/bin"},
            timeout=60,
        )
        return json.loads(said.stdout)  # type: ignore[no-any-return]

    assert wanted("2.13.0+cpu", False, "12.6") == {"wanted": None}  # its own torch stays
    assert wanted("2.13.0+cpu", True) == {"wanted": None}  # the notebook's, in the cpu build
    assert wanted("2.13.0+cpu", True, "12.6") == {"wanted": "2.13.0+cu126"}
    assert wanted("2.12.0+cpu", True) == {"wanted": "2.12.0+cpu"}
    assert wanted("2.13.0", True, "12.8") == {"wanted": "2.13.0+cu128"}
    too_old = wanted("2.13.0+cpu", True, "11.4")["error"] or ""
    assert "CUDA 11.4, older than torch's oldest CUDA build (11.8)" in too_old
    # the notebook's own version comes from its own sources; another build from its index
    assert torch_sources(metadata.version("torch")) == []
    assert torch_sources("2.13.0+cu126") == [
        "--extra-index-url https://download.pytorch.org/whl/cu126"
    ]


def test_a_provider_that_installs_nothing_refuses_pip_before_any_machine() -> None:
    from skyward_jupyter.spec import SpecError

    with pytest.raises(
        SpecError,
        match=r"^--pip/--requirements/--mirror: the ray provider cannot install packages on its "
        r"nodes; give the Ray cluster a runtime_env .* \(aws, local, slurm, ssh\)$",
    ):
        PoolSpec(provider="ray", pip=("tabulate",))
    assert PoolSpec(provider="slurm", pip=("tabulate",)).pip == ("tabulate",)


def test_pip_defaults_status_and_clean_through_the_magics_of_a_real_kernel(
    envs: Path, tmp_path: Path
) -> None:
    from .test_magics import Kernel

    (tmp_path / "nb").mkdir()
    kernel = Kernel(cwd=tmp_path / "nb")
    try:
        kernel.ok("%load_ext skyward_jupyter")
        kernel.ok("%sky config --pip tabulate ujson")
        cell = kernel.ok(
            "%%sky --nodes 2 --all\n" + IMPORT_BOTH.replace("(tabulate.__file__, ", "(")
        )
        assert cell.per_rank == {0: """'{"rank":0}'""", 1: """'{"rank":1}'"""}, str(cell)
        status = kernel.status()
        for node in (0, 1):
            assert re.search(
                rf"node {node} packages: env [0-9a-f]{{12}} \(2 packages, uv [\d.]+\), ", status
            ), status
        cleaned = kernel.ok("%sky clean").stdout
        assert cleaned.strip() == "this machine: nothing; kept 1 in use by a running pool", cleaned
        kernel.ok("%sky down")
    finally:
        kernel.close()


def test_mirror_pins_the_notebooks_versions_of_what_its_namespace_uses() -> None:
    import importlib.metadata as metadata

    import cloudpickle
    import pathspec
    import torch
    import xxhash

    from skyward_jupyter.mirror import modules_in, notebook_requirements

    namespace = {
        "xx": xxhash,  # a module bound under another name
        "GitIgnoreSpec": pathspec.GitIgnoreSpec,  # a class imported from a package
        "os": os,  # the standard library: never
        "torch": torch,  # the node's own torch stays
        "_": cloudpickle,  # IPython's names
        "answer": 42,
    }
    assert modules_in(namespace) == {"xxhash", "pathspec", "os", "torch"}
    pinned, local = notebook_requirements(modules_in(namespace))
    assert pinned == (
        f"pathspec=={metadata.version('pathspec')}",
        f"xxhash=={metadata.version('xxhash')}",
    )
    assert local == ()


def test_uv_installs_from_where_the_nodes_pip_is_configured_to(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """uv reads no pip configuration: the builder hands it pip's (files, then ``PIP_``)."""
    conf = tmp_path / "pip.conf"
    conf.write_text(
        "[global]\nindex-url = file:///srv/a\nextra-index-url = file:///srv/b\n  file:///srv/c\n"
        "[install]\nfind-links = /srv/wheels\n"
    )
    monkeypatch.setenv("PIP_CONFIG_FILE", str(conf))
    monkeypatch.setenv("PIP_FIND_LINKS", "/srv/more")
    monkeypatch.setenv("PIP_INDEX_URL", "file:///srv/z")
    settings = node_environments.uv_settings()
    assert settings["UV_INDEX_URL"] == "file:///srv/z"
    assert settings["UV_EXTRA_INDEX_URL"].split()[-2:] == ["file:///srv/b", "file:///srv/c"]
    assert settings["UV_FIND_LINKS"].split(",")[-2:] == ["/srv/wheels", "/srv/more"]


def test_torchs_build_per_node_is_said_in_one_line_naming_the_nodes_that_had_one_chosen() -> None:
    from skyward_jupyter.environments import NodeEnvironment, torch_choices

    chosen = NodeEnvironment("d", "/s", 1, False, torch="torch 2.13.0+cpu kept")
    plain = NodeEnvironment("d", "/s", 1, False)
    assert torch_choices({"node 0": chosen, "node 1": plain, "node 2": chosen}) == (
        "torch per node: node 0: torch 2.13.0+cpu kept; node 2: torch 2.13.0+cpu kept"
    )
    assert torch_choices({"node 0": plain}) is None

"""A Hugging Face token reaches every rank, over the ranks' channel only (issue 16).

The token is a fresh random value; each test looks for it everywhere it could leak: every
process's command line (the notebook's machine and the SSH hosts share one process table),
the files the hosts and the registry wrote, the pool's events and messages, the package's log
records, the status text and the errors of a failing cell and of a failed start. The ranks
compare a digest of what they got, so the token never travels back.
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import subprocess
from pathlib import Path

import pytest

from skyward_jupyter import Pool
from skyward_jupyter.events import PoolEvent
from skyward_jupyter.frameworks import Frameworks
from skyward_jupyter.providers.base import ProviderError
from skyward_jupyter.registry.writer import Registry
from skyward_jupyter.session import Session
from skyward_jupyter.spec import PoolSpec, SpecError

from .conftest import ssh_hosts_fixture
from .hosts import Hosts, ssh_provider

DIGEST = "import hashlib, os\nhashlib.sha256(os.environ.get('HF_TOKEN', '').encode()).hexdigest()"
FAIL = "raise RuntimeError('the cell failed: ' + ' '.join(sorted(os.environ)))"


@pytest.fixture
def token(monkeypatch: pytest.MonkeyPatch) -> str:
    value = "hf_" + secrets.token_hex(16)
    monkeypatch.setenv("TEAM_HF_TOKEN", value)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    return value


def digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def command_lines() -> str:
    """Every process's command line on this machine (the hosts' namespaces included)."""
    lines = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            lines.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode())
        except OSError:
            continue  # ended while we looked
    return "\n".join(lines)


def files_holding(token: str, *roots: Path) -> list[str]:
    found = []
    for root in roots:
        for path in root.rglob("*"):
            if path.is_file() and token.encode() in path.read_bytes():
                found.append(str(path))
    return found


def test_the_token_reaches_local_ranks_and_nothing_else(
    token: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    said: list[str] = []
    events: list[PoolEvent] = []
    registry = Registry(tmp_path / "registry")
    session = Session(announce=said.append, listeners=[registry])
    registry.attach(session.down_pool)
    caplog.set_level(logging.DEBUG)
    try:
        spec = session.spec_from({"nodes": 2, "hf_token_env": "TEAM_HF_TOKEN"})
        assert token not in repr(spec) and token not in spec.describe()
        result = session.run_cell(DIGEST, {}, spec=spec).raise_for_errors()
        assert result.values == [digest(token)] * 2
        session.pools["default"].pool.subscribe(events.append)
        failed = session.run_cell(FAIL, {})
        cause = next(e for e in failed.errors if not e.secondary)  # a peer may be stopped first
        assert "HF_TOKEN" in cause.message  # the variable is there, its value is not
        texts = [command_lines(), session.status(), *said, repr(failed.errors), repr(events)]
        texts += [record.getMessage() for record in caplog.records]
        assert not [t for t in texts if token in t]
        assert files_holding(token, tmp_path) == []
    finally:
        session.down_all()
        registry.close()


def test_the_notebooks_hf_token_is_the_default_and_a_missing_variable_is_named(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    setup = Frameworks.from_options((), None, None, {}, {"HF_TOKEN": "hf_x"})
    assert setup.rank_env(False, {"HF_TOKEN": "hf_x"}) == {"HF_TOKEN": "hf_x"}
    assert Frameworks().rank_env(False, {}) == {}
    with pytest.raises(SpecError) as raised:
        PoolSpec(hf_token_env="NOT_SET_HERE").framework_setup({})
    assert "--hf-token-env NOT_SET_HERE: the notebook's environment has no NOT_SET_HERE" in str(
        raised.value
    )


# ------------------------------------------------------------------------------ SSH hosts


hosts = ssh_hosts_fixture(2, "hosts")


def _host_files_holding(hosts: Hosts, token: str) -> list[str]:
    """Files on a host's own view (its /tmp and home) that hold the token."""
    found = []
    for i in range(len(hosts)):
        grep = ["grep", "-rlsF", token, "/tmp", f"/home/{hosts.user}"]
        done = subprocess.run(hosts.inside_argv(i, *grep), capture_output=True, text=True)
        found += [f"host {i}: {line}" for line in done.stdout.splitlines()]
    return found


def test_the_token_reaches_ssh_ranks_over_their_channel_only(
    hosts: Hosts, token: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    events: list[PoolEvent] = []
    frameworks = Frameworks(hf_token_env="TEAM_HF_TOKEN")
    pool = Pool(nodes=2, provider=ssh_provider(hosts, 2, tmp_path), frameworks=frameworks)
    pool.subscribe(events.append)
    with pool:
        assert pool.run(DIGEST).raise_for_errors().values == [digest(token)] * 2
        failed = pool.run(FAIL)
        cause = next(e for e in failed.errors if not e.secondary)  # a peer may be stopped first
        assert "HF_TOKEN" in cause.message
        seen = [command_lines(), repr(failed.errors)]
        assert not [t for t in seen if token in t]
        assert _host_files_holding(hosts, token) == []
    with pytest.raises(ProviderError) as raised:  # a failed start says why, not what it sent
        bad = ssh_provider(hosts, 2, tmp_path, python="/nonexistent/python3")
        Pool(nodes=2, provider=bad, frameworks=frameworks).start()
    texts = [str(raised.value), repr(events), *(r.getMessage() for r in caplog.records)]
    assert not [t for t in texts if token in t]
    assert _host_files_holding(hosts, token) == []

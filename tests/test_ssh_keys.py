"""``--accept-new-host-keys`` is OpenSSH's ``StrictHostKeyChecking=accept-new``, against a real
sshd (tests/hosts.py): an unknown host's key is recorded and then checked strictly, a changed key
is refused naming both fingerprints, and without the option an unknown host is refused.
"""

from __future__ import annotations

import asyncio
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from skyward_jupyter.providers.base import ProviderError
from skyward_jupyter.providers.ssh import Host, SSHOptions, SSHProvider

from .conftest import ssh_hosts_fixture
from .hosts import Hosts, available

pytestmark = pytest.mark.skipif(available() is not None, reason=str(available()))


hosts = ssh_hosts_fixture(1, "hosts")


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One package cache for the module: the package ships to the host once."""
    return tmp_path_factory.mktemp("cache")


def _provider(hosts: Hosts, cache: Path, known_hosts: Path | None, accept: bool) -> SSHProvider:
    return SSHProvider(
        [Host(hosts[0].address, hosts.user, hosts[0].port)],
        SSHOptions(
            identity=str(hosts.client_key),
            known_hosts=str(known_hosts) if known_hosts else None,
            accept_new_host_keys=accept,
            python=sys.executable,
            connect_timeout=5,
            cache_dir=str(cache),
        ),
    )


def _provision(provider: SSHProvider) -> None:
    """Connect and make the host ready (the path a pool takes), then let go."""

    async def go() -> None:
        try:
            await provider.provision(1)
        finally:
            await provider.release()

    asyncio.run(go())


def _host_line(hosts: Hosts) -> str:
    """The host's real key as OpenSSH writes it: ``[address]:port ssh-ed25519 AAAA...``."""
    return hosts.known_hosts.read_text().splitlines()[0]


def _fingerprint(pub: Path) -> str:
    """The key's fingerprint as OpenSSH prints it (``SHA256:...``)."""
    done = subprocess.run(["ssh-keygen", "-l", "-f", str(pub)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()[1]


def test_an_unknown_host_is_recorded_then_checked_strictly(
    hosts: Hosts, cache: Path, tmp_path: Path
) -> None:
    known = tmp_path / "dot-ssh" / "known_hosts"  # neither the file nor its directory exists

    _provision(_provider(hosts, cache, known, accept=True))

    assert known.read_text() == _host_line(hosts) + "\n"
    assert known.stat().st_mode & 0o777 == 0o600
    assert known.parent.stat().st_mode & 0o777 == 0o700
    # Recorded once: a second connection with the option finds the entry and adds nothing.
    _provision(_provider(hosts, cache, known, accept=True))
    assert known.read_text() == _host_line(hosts) + "\n"
    # Strict checking against the file now passes, for this package and for OpenSSH's client.
    _provision(_provider(hosts, cache, known, accept=False))
    strict = dataclasses.replace(hosts, known_hosts=known).ssh_argv(0, "true")
    done = subprocess.run(strict, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr


def test_the_default_file_is_home_ssh_known_hosts(
    hosts: Hosts, cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))

    _provision(_provider(hosts, cache, None, accept=True))

    known = tmp_path / ".ssh" / "known_hosts"
    assert known.read_text() == _host_line(hosts) + "\n"
    _provision(_provider(hosts, cache, None, accept=False))  # asyncssh's default file


@pytest.mark.parametrize("hashed", [False, True], ids=["plain", "hashed"])
def test_a_changed_key_is_refused_naming_both_fingerprints(
    hosts: Hosts, cache: Path, tmp_path: Path, hashed: bool
) -> None:
    impostor = tmp_path / "impostor"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(impostor)], check=True)
    recorded_pub = tmp_path / "impostor.pub"
    known = tmp_path / "known_hosts"
    pattern = f"[{hosts[0].address}]:{hosts[0].port}"
    known.write_text(f"{pattern} {' '.join(recorded_pub.read_text().split()[:2])}\n")
    if hashed:  # as Debian's ssh_config writes them: |1|salt|hash
        subprocess.run(
            ["ssh-keygen", "-q", "-H", "-f", str(known)], check=True, capture_output=True
        )
        assert known.read_text().startswith("|1|")
    before = known.read_bytes()
    offered_pub = tmp_path / "offered.pub"
    offered_pub.write_text(" ".join(_host_line(hosts).split()[1:]) + "\n")
    provider = _provider(hosts, cache, known, accept=True)

    with pytest.raises(ProviderError, match="host key has changed") as raised:
        _provision(provider)

    message = str(raised.value)
    assert str(provider.hosts[0]) in message
    assert str(known) in message
    assert _fingerprint(recorded_pub) in message
    assert _fingerprint(offered_pub) in message
    assert f"ssh-keygen -R '{pattern}' -f {known}" in message
    assert known.read_bytes() == before


def test_without_the_option_an_unknown_host_is_refused(
    hosts: Hosts, cache: Path, tmp_path: Path
) -> None:
    known = tmp_path / "known_hosts"
    known.write_text("")

    with pytest.raises(ProviderError, match="host key is not trusted") as raised:
        _provision(_provider(hosts, cache, known, accept=False))

    assert hosts[0].address in str(raised.value)
    assert known.read_text() == ""


def _connect_as_pool(hosts: Hosts, cache: Path, identity: str | None) -> None:
    provider = _provider(hosts, cache, hosts.known_hosts, accept=False)
    provider.options = dataclasses.replace(provider.options, identity=identity)
    _provision(provider)


def test_an_unloadable_default_key_is_named_with_what_to_do(
    hosts: Hosts, cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    broken = home / ".ssh" / "id_ed25519"
    broken.write_text("-----BEGIN OPENSSH PRIVATE KEY-----\nnot a key\n")
    monkeypatch.setenv("HOME", str(home))
    with pytest.raises(ProviderError) as raised:
        _connect_as_pool(hosts, cache, identity=None)
    message = str(raised.value)
    assert message.startswith(f"{hosts.user}@{hosts[0].address}:{hosts[0].port}: ")
    assert f"cannot load the SSH key {broken} (" in message
    assert message.endswith("fix or remove that file, or pass --identity KEY to use another key")


def test_an_unloadable_identity_is_named(hosts: Hosts, cache: Path, tmp_path: Path) -> None:
    broken = tmp_path / "key"
    broken.write_text("not a key\n")
    with pytest.raises(
        ProviderError, match=f"cannot load the SSH key {broken} given by --identity"
    ):
        _connect_as_pool(hosts, cache, identity=str(broken))

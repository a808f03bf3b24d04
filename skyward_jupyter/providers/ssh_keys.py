"""Which SSH host keys to trust with ``--accept-new-host-keys``: OpenSSH's
``StrictHostKeyChecking=accept-new``.

A host with no entry in the known-hosts file in use is trusted on first use: the key it offers
is recorded there, and the connection then checks strictly against the file, as every later one
does, so no key is trusted that the file does not hold. A host whose recorded key differs is
refused, naming both fingerprints: a changed key is what a man in the middle looks like, and
only the user can tell it from a reinstalled host. Without the option nothing here runs.
"""

from __future__ import annotations

import asyncio
import os
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import asyncssh

from .base import ProviderError

if TYPE_CHECKING:
    from .ssh import Host

DEFAULT_KNOWN_HOSTS = "~/.ssh/known_hosts"


def known_hosts_file(configured: str | None) -> Path:
    """The file that decides: the one given, else the default OpenSSH and asyncssh read."""
    return Path(configured or DEFAULT_KNOWN_HOSTS).expanduser()


def host_pattern(host: Host) -> str:
    """The host as OpenSSH writes it in known_hosts: ``host`` on port 22, ``[host]:port``
    otherwise.
    """
    return host.host if host.port == 22 else f"[{host.host}]:{host.port}"


def _entries(path: Path, host: Host) -> tuple[list[asyncssh.SSHKey], list[asyncssh.SSHKey], bool]:
    """The host keys and revoked keys ``path`` holds for the host, and whether it has any entry
    that could verify it. Matched by asyncssh's own matcher (plain and hashed ``|1|`` names,
    patterns), so this and the strict check that follows agree on whether a host is known.
    """
    try:
        text = path.read_text() if path.exists() else ""
        known = asyncssh.import_known_hosts(text)
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ProviderError(f"{host}: cannot read the known_hosts file {path}: {exc}") from None
    keys, cas, revoked, certs, _, subjects, _ = known.match(
        host.host, "", host.port if host.port != 22 else None
    )
    return list(keys), list(revoked), bool(keys or cas or certs or subjects)


async def _offered(host: Host, algs: Sequence[str], timeout: float) -> asyncssh.SSHKey:
    """The key the host offers in a handshake (of one of ``algs``, when given); nothing is
    authenticated or trusted on this connection.
    """
    key = await asyncio.wait_for(
        asyncssh.get_server_host_key(host.host, host.port, server_host_key_algs=algs or ()),
        timeout,
    )
    if key is None:
        raise ProviderError(f"{host}: the host offered no host key to record")
    return key


def _record(path: Path, host: Host, key: asyncssh.SSHKey) -> None:
    """Append ``key`` for the host to ``path`` in OpenSSH's format, unless an entry appeared
    meanwhile (the same host twice in one pool), so a host is recorded once. No await between
    the check and the write, so connections in this event loop cannot interleave.
    """
    _, revoked, known = _entries(path, host)
    if known:
        return  # recorded meanwhile; the strict check decides
    if key in revoked:
        raise ProviderError(f"{host}: its host key {key.get_fingerprint()} is revoked in {path}")
    algorithm, data = key.export_public_key("openssh").decode().split()[:2]
    line = f"{host_pattern(host)} {algorithm} {data}\n"
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        ended = not path.exists() or path.read_bytes()[-1:] in (b"", b"\n")
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        with os.fdopen(fd, "a") as out:
            out.write(line if ended else "\n" + line)  # an unended last entry is ended first
    except OSError as exc:
        raise ProviderError(f"{host}: cannot record its host key in {path}: {exc}") from None


async def record_if_new(path: Path, host: Host, timeout: float) -> None:
    """Record the key an unknown host offers in ``path``; a host with an entry is left alone.
    The caller connects strictly against ``path`` afterwards, so the recorded key is the only
    one that connection (or any later one) accepts.
    """
    if _entries(path, host)[2]:
        return
    _record(path, host, await _offered(host, (), timeout))


async def changed_key(path: Path, host: Host, timeout: float) -> ProviderError | None:
    """After the strict check refused the host: an error naming the recorded and the offered
    fingerprints when the host offers a key other than the one recorded; None when it cannot be
    told (nothing recorded, the host unreachable now), so the caller's own error stands.
    """
    recorded = _entries(path, host)[0]
    if not recorded:
        return None
    # Ask for the recorded keys' types, so like is compared with like.
    algs = [alg.decode() for key in recorded for alg in key.sig_algorithms]
    try:
        offered = await _offered(host, algs, timeout)
    except (asyncssh.Error, OSError, asyncio.TimeoutError, ProviderError):
        return None
    if offered in recorded:
        return None
    pattern = host_pattern(host)
    old = ", ".join(key.get_fingerprint() for key in recorded)
    return ProviderError(
        f"{host}: its host key has changed: {path} records {old} for {pattern}, but the host "
        f"offers {offered.get_fingerprint()} ({offered.get_algorithm()}). Someone may be "
        "intercepting the connection, or the host was reinstalled; no credentials were sent to "
        "it and the file is unchanged. If you know it was reinstalled, remove the old key with "
        f"`ssh-keygen -R {shlex.quote(pattern)} -f {shlex.quote(str(path))}` and connect "
        "again with --accept-new-host-keys."
    )

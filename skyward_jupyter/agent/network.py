"""Which of this host's addresses its peers can reach: the one on the route to the head.

gloo (and NCCL's bootstrap) otherwise advertise the address the machine's hostname resolves to,
which Debian and Ubuntu map to 127.0.1.1 in /etc/hosts: peers on other hosts then dial their own
loopback and the group never forms. The interface that routes to the head is, by construction,
one the head can be reached through and reach back on, so each rank names it in
``GLOO_SOCKET_IFNAME`` and ``NCCL_SOCKET_IFNAME`` unless the user chose them.

Also here: a bounded check that the head's rendezvous store answers, so that a rank that cannot
reach it says so (address, port, what to set) in seconds instead of after the group's timeout;
and which sockets are this process's (a loopback connection from another process, another
user's, is told from gloo's own).
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import os
import socket
import struct
from dataclasses import dataclass
from typing import Any

_SIOCGIFADDR = 0x8915
IFNAME_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


@dataclass(frozen=True, slots=True)
class Route:
    """This host's way to the head: the local address and the interface holding it."""

    head: str
    address: str
    interface: str | None


def route_to(head: str) -> Route:
    """The local address (and its interface) the kernel would use to reach ``head``.

    Connecting a UDP socket sends nothing: it only asks the routing table. For the head itself
    the answer is its own address, whose interface is then the one it is on (not ``lo``).
    """
    ip = str(socket.getaddrinfo(head, None, socket.AF_INET, socket.SOCK_DGRAM)[0][4][0])
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((ip, 9))
        local = str(probe.getsockname()[0])
    return Route(ip, local, interface_of(local))


def interface_of(address: str) -> str | None:
    """The name of the interface whose (primary IPv4) address is ``address``."""
    if address.startswith("127."):
        return "lo"
    for _, name in socket.if_nameindex():
        if interface_address(name) == address:
            return name
    return None


def interface_address(name: str) -> str | None:
    """The primary IPv4 address of interface ``name`` (None if it has none or does not exist)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        request = struct.pack("256s", name.encode()[:15])
        try:
            reply = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, request)
        except OSError:
            return None
    return socket.inet_ntoa(reply[20:24])


def choose_interfaces(head: str, environ: dict[str, str] | None = None) -> Route | None:
    """Set the socket interface variables the user left unset to the route to the head.

    Returns the route (None when the head cannot be resolved here: the group's own error will
    then say so).
    """
    env = os.environ if environ is None else environ
    try:
        route = route_to(head)
    except OSError:
        return None
    if route.interface is not None:
        for name in IFNAME_VARIABLES:
            env.setdefault(name, route.interface)
    return route


def reach(address: str, port: int, timeout: float) -> str | None:
    """None when a TCP connection to ``address:port`` opens within ``timeout``; else why not."""
    try:
        with socket.create_connection((address, port), timeout=timeout):
            return None
    except TimeoutError:
        return f"no answer within {timeout:.0f} s"
    except OSError as exc:
        return exc.strerror or str(exc)


def advertised(backend: str) -> tuple[str, str]:
    """The address this rank's group will give its peers, and where it comes from.

    As gloo chooses it: the interface named in the variable, else what the hostname resolves to
    (NCCL's own choice without the variable is not predicted: then the hostname's is checked).
    """
    variable = "NCCL_SOCKET_IFNAME" if backend == "nccl" else "GLOO_SOCKET_IFNAME"
    names = os.environ.get(variable, "")
    first = names.split(",")[0].lstrip("=")
    if first and (address := interface_address(first)) is not None:
        return address, f"{variable}={names}"
    host = socket.gethostname()
    return socket.gethostbyname(host), f"the hostname {host} resolves to it"


def check_peers(
    store: Any,
    rank: int,
    world_size: int,
    backend: str,
    timeout: float,
    tunnel: tuple[str, int] | None = None,
) -> None:
    """Before the group connects: can every rank open a connection to every other's address?

    Each rank listens where its group will (or names its ``tunnel``, where a secure pool's
    peers connect instead), publishes that in the store, and dials the others' within
    ``CONNECT_TIMEOUT``; a failure anywhere is published too, so every rank stops at once with
    the same message naming who could not reach whom, instead of each waiting out the group's
    timeout. Raises :class:`ConnectionError` with that message.
    """
    wait = datetime.timedelta(seconds=timeout)
    listener: socket.socket | None = None
    if tunnel is not None:
        (address, port), source = tunnel, "its --secure tunnel serves there"
    else:
        address, source = advertised(backend)
        try:
            listener = socket.create_server((address, 0), backlog=max(16, world_size))
        except OSError as exc:
            problem = f"rank {rank} cannot listen on {address} ({source}): {exc.strerror or exc}"
            store.set(f"{_KEY}/problem/{rank}", problem)
        port = listener.getsockname()[1] if listener is not None else 0
    with listener or contextlib.nullcontext():
        store.set(f"{_KEY}/addr/{rank}", f"{address} {port} {source}")
        everyone = [f"{_KEY}/done/{r}" for r in range(world_size)]
        addresses = [f"{_KEY}/addr/{r}" for r in range(world_size) if r != rank]
        problems = [f"{_KEY}/problem/{r}" for r in range(world_size)]
        if port:
            store.wait(addresses, wait)
            for key in addresses:
                peer = int(key.rsplit("/", 1)[1])
                peer_address, peer_port, peer_source = store.get(key).decode().split(" ", 2)
                if peer_port == "0":
                    continue  # it could not listen, and said so under problems
                why = reach(peer_address, int(peer_port), CONNECT_TIMEOUT)
                if why is not None:
                    store.set(
                        f"{_KEY}/problem/{rank}",
                        f"rank {rank} cannot reach rank {peer} at {peer_address}:{peer_port} "
                        f"({why}); rank {peer}'s group listens there because {peer_source}",
                    )
                    break
        store.set(f"{_KEY}/done/{rank}", "1")
        store.wait(everyone, wait)
    found = [store.get(k).decode() for k in problems if store.check([k])]
    if found:
        raise ConnectionError(found[0])


CONNECT_TIMEOUT = 10.0
"""Seconds to wait for a connection to the head's store or a peer before saying it failed."""
_KEY = "skyward/reach"


def socket_inodes() -> dict[str, int]:
    """This process's sockets: ``socket:[inode]`` -> descriptor."""
    found = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue  # closed while we looked (the listing's own descriptor among them)
        if target.startswith("socket:"):
            found[target] = int(name)
    return found


def _table_address(host: str, port: int) -> str:
    """``host:port`` (IPv4) as ``/proc/net/tcp`` writes it: the address's 32 bits in this
    machine's byte order, then the port, in hexadecimal.
    """
    (number,) = struct.unpack("=I", socket.inet_aton(host))
    return f"{number:08X}:{port:04X}"


def from_this_process(conn: socket.socket) -> bool | None:
    """Whether the other end of ``conn``, a TCP connection over loopback, is a socket of this
    process: loopback is open to every user of the machine, and a port only this process's
    own code (gloo) is meant to use must refuse anyone else. None where it cannot be told
    (no ``/proc``).
    """
    try:
        (peer_host, peer_port), (host, port) = conn.getpeername()[:2], conn.getsockname()[:2]
    except OSError:
        return False  # gone already
    ends = (_table_address(peer_host, peer_port), _table_address(host, port))
    try:
        with open("/proc/self/net/tcp", encoding="ascii") as table:
            # The connecting socket's line: its own address first, then ours. An old one of
            # the same addresses (closed, waiting) has inode 0.
            theirs = {
                f"socket:[{f[9]}]"
                for line in table
                if ends[0] in line and (f := line.split())[1:3] == list(ends) and f[9] != "0"
            }
        return bool(theirs) and not theirs.isdisjoint(socket_inodes())
    except OSError:
        return None

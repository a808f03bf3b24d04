"""The pool's secrets for the nodes' relays (:mod:`.agent.relay`), made in the notebook.

A token every relay request proves it holds (an HMAC over the relay's fresh nonce), and, for pools
whose ranks are on other machines, a self-signed certificate and its key: the relays speak TLS
with them and the ranks trust that certificate alone (a ``--secure`` pool's gloo tunnels too, on
every rank: :mod:`.agent.gloo_tunnel`). They reach the ranks in the environment that travels over
the wire (never a command line); the key goes to each node's first rank only, which serves the
node's relay.
"""

from __future__ import annotations

import datetime
import secrets
from dataclasses import dataclass, field

ENCRYPTED = True
"""Whether relays of multi-host pools use TLS (a measurement of its cost sets it False)."""


@dataclass(frozen=True, slots=True)
class RelaySecrets:
    token: str = field(repr=False)
    cert: str | None = None
    key: str | None = field(default=None, repr=False)

    @classmethod
    def make(cls, encrypted: bool) -> RelaySecrets:
        if not encrypted:
            return cls(secrets.token_hex(32))
        cert, key = _self_signed()
        return cls(secrets.token_hex(32), cert, key)

    def agent_settings(self, serves: bool, secure: bool = False) -> dict[str, str | None]:
        """What a rank's agent reads; only each node's first rank (which serves the node's
        relay) gets the key, unless the pool is ``--secure``: every rank's gloo tunnel then
        serves with it too.
        """
        return {
            "relay_token": self.token,
            "relay_cert": self.cert,
            "relay_key": self.key if serves or secure else None,
        }


def _self_signed() -> tuple[str, str]:
    """A P-256 key and a certificate for it (PEM), valid from a day ago (nodes' clocks differ)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "skyward pool relay")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=3650))
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    return cert.public_bytes(serialization.Encoding.PEM).decode(), key_pem.decode()

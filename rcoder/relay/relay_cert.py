"""A relay's TLS certificate for its TCP listener (docs/relay.md#security): self-signed, made at
the relay's start with the host other hosts reach it at in its subject alternative name. Nothing
signs it but its own key: a host that takes a relayed turn over trusts it because the store holds
it (the relayed turn's row), not because of any authority.

Its own module, imported only where a relay listens on TCP: ``cryptography`` costs a daemon's start
tens of milliseconds (``tests/test_daemon_imports.py``).
"""

from __future__ import annotations

import ipaddress
from datetime import UTC, datetime, timedelta

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

# as long as a relay may live: the certificate is pinned per relay, made anew at each start, so
# its term bounds nothing but a relay's life
VALID_FOR = timedelta(days=3650)


def self_signed(host: str) -> tuple[bytes, bytes]:
    """A certificate (PEM) for ``host`` (an IP address or a DNS name) and its private key (PEM,
    unencrypted: it stays in the relay's state folder, mode 0600)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host or "localhost")])
    try:
        alt: x509.GeneralName = x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        alt = x509.DNSName(host)
    now = datetime.now(UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(minutes=5))  # a peer's clock a little behind
        .not_valid_after(now + VALID_FOR)
        .add_extension(x509.SubjectAlternativeName([alt]), critical=False)
        # its own root of trust: a host pins it as the only authority of this relay
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())  # fmt: skip
    return cert.public_bytes(serialization.Encoding.PEM), key_pem

"""What an address of the form ``host:port`` says of its host: a leaf (stdlib only), read by the
daemon's settings (``open_reflection = "loopback"``, docs/access.md) and by the client (whether a
target is this machine's daemon), so that both answer the same question the same way."""

from __future__ import annotations

import ipaddress


def is_loopback(address: str) -> bool:
    """Whether ``address``'s host (``host:port``, IPv6 in brackets) is a loopback address,
    ``localhost`` included."""
    host = address.rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False

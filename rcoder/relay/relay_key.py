"""The secret of a relay served over TCP, derived (docs/relay.md#security): every host of a store
holds the same key (``[relays] key_file``), each relay gets a random id at its start, and its
secret is ``urlsafe-b64(HMAC-SHA256(key, relay_id))``. The store holds the id, never the secret:
a host that takes a relayed turn over derives the secret of its relay from its own key, and a
host with another key derives another secret, which the relay refuses.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets


def new_relay_id() -> str:
    """A relay's id: random, not secret (the store holds it)."""
    return secrets.token_hex(16)


def relay_secret(key: bytes, relay_id: str) -> str:
    """The secret of relay ``relay_id`` under ``key`` (43 characters, unpadded)."""
    digest = hmac.new(key, relay_id.encode(), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()

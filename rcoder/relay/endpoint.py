"""Where a relay is reached, as both sides know it: the files in its state folder and the largest
message either side takes (docs/relay.md#running-a-relay).

Its own module so that the daemon's side (``relay.host``, ``relay.containers``,
``relay.container_host``) reads these names without importing the relay's server (``relay.serve``
and everything it serves with), which the daemon never runs: every daemon's start paid for those
imports.
"""

from __future__ import annotations

SOCKET_FILE = "relay.sock"
SECRET_FILE = "secret"  # noqa: S105 - the file's name, not a secret
MAX_MESSAGE_BYTES = 8 << 20  # a stdin frame or a stdout frame (at most 1 MiB) with room to spare

"""Where a relay is reached, as both sides know it: the files in its state folder and the largest
message either side takes (docs/relay.md#running-a-relay).

Its own module so that the daemon's side (``relay.host``, ``relay.containers``,
``relay.container_host``) reads these names without importing the relay's server (``relay.serve``
and everything it serves with), which the daemon never runs: every daemon's start paid for those
imports.
"""

from __future__ import annotations

import os
from pathlib import Path

SOCKET_FILE = "relay.sock"
SECRET_FILE = "secret"  # noqa: S105 - the file's name, not a secret
# a relay served over TCP too (docs/relay.md#re-attach): the address it bound (written by the relay
# once it serves), the id its secret is derived from, and its TLS certificate and key (made by its
# starter); each in its state folder, which no agent can read
ADDRESS_FILE = "address"
RELAY_ID_FILE = "relay_id"
TLS_CERT_FILE = "tls.crt"
TLS_KEY_FILE = "tls.key"
MAX_MESSAGE_BYTES = 8 << 20  # a stdin frame or a stdout frame (at most 1 MiB) with room to spare
# the ErrorInfo reason of a call refused by a relay stopping itself, idle (``relay.idle``): its
# starter starts a new one and asks again
EXITING = "RELAY_EXITING"

# a unix socket's path must fit in sun_path (108 bytes, its terminating NUL included)
_SUN_PATH = 107
_FOLDERS: dict[str, int] = {}  # folder -> a descriptor of it, for the sockets whose path is longer


def socket_target(socket: Path) -> str:
    """The gRPC target of the unix socket ``socket``, to bind or to connect to. A path longer than
    a socket's address holds (a deep ``data_dir``: the kernel refuses it, and a client's connect
    fails until its deadline) is reached through a descriptor of its folder,
    ``/proc/self/fd/N/relay.sock``: one per such folder, held for the process's life, opened again
    if the folder was made anew."""
    path = str(socket)
    if len(os.fsencode(path)) <= _SUN_PATH:
        return f"unix:{path}"
    folder = str(socket.parent)
    fd = _FOLDERS.get(folder)
    if fd is not None and not _same(fd, folder):
        os.close(fd)
        fd = None
    if fd is None:
        fd = _FOLDERS[folder] = os.open(folder, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    return f"unix:/proc/self/fd/{fd}/{socket.name}"


def _same(fd: int, folder: str) -> bool:
    try:
        held, now = os.fstat(fd), os.stat(folder)
    except OSError:
        return False
    return (held.st_dev, held.st_ino) == (now.st_dev, now.st_ino)

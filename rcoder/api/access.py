"""Who may call the daemon: the token every RPC but health needs (docs/design/trust.md#no-calls-back).

An agent runs as the daemon's user and can reach its port, so a port open to every local process
is open to every agent: the token is what tells a client from an agent. It is ``auth_token``
when the operator sets one; else one generated at first start and kept in
``<data_dir>/auth_token`` (0600), which ``rcoder chat`` and the Python client read. No agent can
read it: ``data_dir``, the config file and the daemon's environment are out of its reach
(Landlock: docs/design/trust.md#confinement). Only ``open_to_agents = true`` serves without a token, by name.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path

from rcoder.config import Settings
from rcoder.errors import ConfigError

TOKEN_FILE = "auth_token"  # noqa: S105 (a file name) - in data_dir; rcoder.client reads the same name
TOKEN_BYTES = 32


@dataclass(frozen=True, slots=True)
class Access:
    """The token the daemon asks ("" only under ``open_to_agents``) and where it comes from:
    ``auth_token`` (the config or ``RCODER_AUTH_TOKEN``), ``file`` (kept in data_dir) or ``open``."""

    token: str
    source: str
    file: Path | None = None


def access_of(settings: Settings) -> Access:
    """The daemon's token: the configured one, else the one kept in ``data_dir`` (made on first start)."""
    if settings.auth_token:
        return Access(settings.auth_token, "auth_token")
    if settings.open_to_agents:
        return Access("", "open")
    path = (settings.data_dir / TOKEN_FILE).absolute()
    return Access(kept_token(path), "file", path)


def kept_token(path: Path) -> str:
    """The token in ``path``, made there first when missing: written whole to a private file,
    then linked into place (never replacing one: a second daemon starting at once reads the
    first's), opened without following links either way."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        return _read(path)
    scratch = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(scratch, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "w") as file:
            file.write(secrets.token_urlsafe(TOKEN_BYTES) + "\n")
            file.flush()
            os.fsync(file.fileno())
        with contextlib.suppress(FileExistsError):
            os.link(scratch, path)
    finally:
        os.unlink(scratch)
    return _read(path)


def _read(path: Path) -> str:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if isinstance(exc, FileNotFoundError):
            raise
        raise ConfigError(
            "auth_token", f"cannot read {path} ({exc.strerror}): remove it to have a new one made"
        ) from None
    with os.fdopen(fd) as file:
        info = os.fstat(file.fileno())
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
            raise ConfigError(
                "auth_token", f"{path} must be a regular file of this user readable by it alone (chmod 600)"
            )
        token = file.read().strip()
    if not token:
        raise ConfigError("auth_token", f"{path} is empty: remove it to have a new one made")
    return token

"""The relay's secret: made at its start, required on every call (docs/relay.md#security).

It is written to ``<state_dir>/secret`` (mode 0600, in a folder of mode 0700 owned by the relay's
user), or read once from a descriptor its starter hands over (``--secret-fd``), which is closed
at once, or from a file its starter wrote (``--secret-file``: a relay's container serving TCP,
whose secret is derived from the hosts' key, docs/relay.md#re-attach, "Over TCP, in a container";
no descriptor crosses into a container). Never in the relay's environment: ``/proc/<pid>/environ``
keeps a process's first environment whatever it removes later. No agent can read it: the relay's
folder is outside every agent's Landlock grants (granted around, where a grant holds it), and an
agent running as another uid cannot open the file.
"""

from __future__ import annotations

import hmac
import os
import secrets
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc

from rcoder import errors
from rcoder.relay.endpoint import SECRET_FILE
from rcoder.relay.handlers import rewrapped
from rcoder.relay.service import abort

_MIN_SECRET = 16


def state_dir(path: Path) -> Path:
    """``path`` made (mode 0700) or checked: a folder of this user's that no one else may enter.
    ``ConfigError`` otherwise."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = path.stat()
    if info.st_uid != os.geteuid():
        raise errors.ConfigError("state-dir", f"{path} belongs to uid {info.st_uid}, not to the relay's {os.geteuid()}")
    if info.st_mode & 0o077:
        os.chmod(path, 0o700)  # made earlier with a wider mode: narrowed before the secret goes in
    return path.resolve()


def made_secret(folder: Path) -> str:
    """A new secret, written to ``folder``/secret with mode 0600 (any older one replaced)."""
    secret = secrets.token_urlsafe(32)
    path = folder / SECRET_FILE
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as file:
        file.write(secret + "\n")
    return secret


def secret_from_fd(fd: int) -> str:
    """The secret the starter wrote to descriptor ``fd`` (closed once read)."""
    with os.fdopen(fd, "r") as file:
        secret = file.read().strip()
    if len(secret) < _MIN_SECRET:
        raise errors.ConfigError("secret-fd", f"the secret read from descriptor {fd} is shorter than {_MIN_SECRET}")
    return secret


def secret_from_file(path: Path) -> str:
    """The secret its starter wrote to ``path`` (kept: the starter's later daemons read it there).
    ``ConfigError`` when it cannot be read, is a link, is readable by others or is too short."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise errors.ConfigError("secret-file", f"{path}: {exc.strerror or exc}") from exc
    with os.fdopen(fd, "r") as file:
        if os.fstat(fd).st_mode & 0o077:
            raise errors.ConfigError("secret-file", f"{path} may be read by others than its owner: give it mode 0600")
        secret = file.read().strip()
    if len(secret) < _MIN_SECRET:
        raise errors.ConfigError("secret-file", f"the secret read from {path} is shorter than {_MIN_SECRET}")
    return secret


Continuation = Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]]


class SecretCheck(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Every call carries ``authorization: Bearer <secret>``, or is refused UNAUTHENTICATED."""

    def __init__(self, secret: str) -> None:
        self._expected = f"Bearer {secret}".encode()

    async def intercept_service(
        self, continuation: Continuation, details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        given = next((v for k, v in details.invocation_metadata or () if k == "authorization"), "")
        given_bytes = given.encode() if isinstance(given, str) else bytes(given)
        if handler is None or hmac.compare_digest(given_bytes, self._expected):
            return handler
        how = "with a secret that is not the relay's" if given else "without the relay's secret"
        return _refusing(handler, how)


def _refusing(handler: grpc.RpcMethodHandler, how: str) -> grpc.RpcMethodHandler:
    refused = errors.Unauthenticated(
        f"call {how}: send `authorization: Bearer <secret>`, the secret in the relay's state folder "
        "(or the one its starter handed it)"
    )

    # one coroutine for the four kinds: grpc.aio takes a coroutine for a streaming handler too
    async def refuse(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        await abort(context, refused)

    return rewrapped(handler, lambda _: refuse)

"""The client's exceptions: a failed call becomes one of these, never a bare ``grpc.aio.AioRpcError``.

Each gRPC status code the daemon uses has its class (see the Errors table of docs/api.md); every error
carries the status ``code``, its ``message`` and, when the daemon sent one, the ``google.rpc.ErrorInfo``
detail as ``reason``, ``domain`` and ``metadata``. ``retryable`` says whether the same call may succeed
later unchanged (the daemon was busy, full or unreachable) rather than needing a different request.
"""

from __future__ import annotations

from typing import Any

import grpc
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2
from grpc_status import rpc_status


class RcoderClientError(Exception):
    """Base of every error the client raises.

    ``code`` is the ``grpc.StatusCode`` of the failed call (None for an error the client found itself);
    ``reason``, ``domain`` and ``metadata`` are the ``ErrorInfo`` detail's (empty without one)."""

    retryable = False

    def __init__(
        self,
        message: str,
        *,
        code: Any = None,
        reason: str = "",
        domain: str = "",
        metadata: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.reason = reason
        self.domain = domain
        self.metadata: dict[str, str] = dict(metadata or {})

    def __str__(self) -> str:
        """``NOT_FOUND (SESSION_NOT_FOUND): session 'x' not found``; the message alone without a status."""
        parts = [self.code.name] if self.code is not None else []
        parts += [f"({self.reason})"] if self.reason else []
        return f"{' '.join(parts)}: {self.message}" if parts else self.message


# ---------------------------------------------------------------- fix the request


class InvalidArgument(RcoderClientError):
    """A field of the request is wrong (``metadata["field"]`` names it), or the agent cannot take it."""


class NotFound(RcoderClientError):
    """No such session or run (``SESSION_NOT_FOUND``, ``RUN_NOT_FOUND``), or a permission already answered."""


class PermissionDenied(RcoderClientError):
    """The session belongs to another project, or the profile does not let clients set that."""


class Unauthenticated(RcoderClientError):
    """The daemon wants ``authorization: Bearer <token>``: the token is missing or wrong."""


class FailedPrecondition(RcoderClientError):
    """The agent cannot run as configured (``AGENT_AUTH_REQUIRED``: its model credentials)."""


class OutOfRange(RcoderClientError):
    """Those events left the replay buffer: subscribe from a later ``after_seq``."""


class Unimplemented(RcoderClientError):
    """This daemon does not have that call."""


class Internal(RcoderClientError):
    """A bug in the daemon; the message names it."""


class Cancelled(RcoderClientError):
    """The call was cancelled before it finished."""


# ---------------------------------------------------------------- try again later


class Busy(RcoderClientError):
    """A turn is running on that session (``ABORTED``, ``SESSION_BUSY``): wait for it, subscribe or cancel."""

    retryable = True


class Conflict(RcoderClientError):
    """A compare-and-swap write found another file than the one it was based on (``ABORTED``,
    ``SHA256_MISMATCH``; ``metadata["current_sha256"]`` names what is there now): read the file
    again and redo the change. The same request will not succeed."""


class ResourceExhausted(RcoderClientError):
    """Every live agent is busy (``AGENT_LIMIT_REACHED``), or a message was too large."""

    retryable = True


class Unavailable(RcoderClientError):
    """The agent or the store failed, the daemon is stopping, or it cannot be reached (then ``reason`` is empty)."""

    retryable = True


class DeadlineExceeded(RcoderClientError):
    """The call's ``timeout`` passed before the daemon answered."""

    retryable = True


# ---------------------------------------------------------------- found by the client


class IncompleteTurn(RcoderClientError):
    """The stream ended before the turn's ``completed`` event (the daemon stopped, or the turn was left).

    The turn may still be running: ``run_id`` is what to ``subscribe`` to."""

    def __init__(self, run_id: str) -> None:
        where = f"run {run_id}" if run_id else "no run had started"
        super().__init__(f"the stream ended before the turn did ({where}); subscribe to follow it")
        self.run_id = run_id


class ClientClosed(RcoderClientError):
    """The client was closed: calls need a new one."""


_BY_CODE: dict[Any, type[RcoderClientError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.OUT_OF_RANGE: OutOfRange,
    grpc.StatusCode.UNIMPLEMENTED: Unimplemented,
    grpc.StatusCode.INTERNAL: Internal,
    grpc.StatusCode.CANCELLED: Cancelled,
    grpc.StatusCode.ABORTED: Busy,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
}
# where one code holds errors the caller handles apart: by the ErrorInfo reason
_BY_REASON: dict[str, type[RcoderClientError]] = {"SHA256_MISMATCH": Conflict}


def from_rpc_error(exc: grpc.aio.AioRpcError) -> RcoderClientError:
    """The client's exception for a failed call: the class of its status code, with its ``ErrorInfo``."""
    code = exc.code()
    info = error_info(exc)
    kind = _BY_REASON.get(info.reason if info is not None else "") or _BY_CODE.get(code, RcoderClientError)
    return kind(
        exc.details() or "",
        code=code,
        reason=info.reason if info is not None else "",
        domain=info.domain if info is not None else "",
        metadata=dict(info.metadata) if info is not None else None,
    )


def error_info(exc: grpc.aio.AioRpcError) -> Any:
    """The ``google.rpc.ErrorInfo`` detail of a failed call's status, or None.

    A status detail that does not decode, or that disagrees with the call's own code and message
    (something between us and the daemon rewrote one of them), is not trusted: None."""
    try:
        status = rpc_status.from_call(exc)
    except (ValueError, DecodeError):
        return None
    if status is None:
        return None
    for detail in status.details:
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info):
            return info
    return None

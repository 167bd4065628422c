"""The AgentRunner handlers: validate, call the core, convert. Thin on purpose.

``STATUS_CODES`` is the one table from rcoder's errors to gRPC codes; every
error leaves with a ``google.rpc.ErrorInfo`` carrying its reason.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import AsyncIterator
from typing import Any, NoReturn

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from rcoder import errors
from rcoder.api import convert, validate
from rcoder.logs import get_logger
from rcoder.session.acp_worker import AcpWorker
from rcoder.session.queries import Queries, SessionStatus
from rcoder.session.workspace import check_project_id
from rcoder.v1 import agent_runner_pb2 as pb
from rcoder.v1 import agent_runner_pb2_grpc as pb_grpc

log = get_logger("rcoder.api")
ERROR_DOMAIN = "rcoder.dev"

# Most specific first: the first class an error is an instance of wins.
STATUS_CODES: tuple[tuple[type[errors.RcoderError], grpc.StatusCode], ...] = (
    (errors.InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.NotFound, grpc.StatusCode.NOT_FOUND),
    (errors.PermissionDenied, grpc.StatusCode.PERMISSION_DENIED),
    (errors.OutOfRange, grpc.StatusCode.OUT_OF_RANGE),
    (errors.Unimplemented, grpc.StatusCode.UNIMPLEMENTED),
    (errors.Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    (errors.SessionBusy, grpc.StatusCode.ABORTED),
    (errors.AgentLimitReached, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.ShuttingDown, grpc.StatusCode.UNAVAILABLE),
    (errors.StoreError, grpc.StatusCode.UNAVAILABLE),
    (errors.RunCancelled, grpc.StatusCode.CANCELLED),
    (errors.AgentAuthRequired, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.AgentError, grpc.StatusCode.UNAVAILABLE),
    (errors.RcoderError, grpc.StatusCode.INTERNAL),
)

_SESSION_STATUS = {
    SessionStatus.IDLE: pb.SESSION_STATUS_IDLE,
    SessionStatus.LIVE: pb.SESSION_STATUS_LIVE,
    SessionStatus.BUSY: pb.SESSION_STATUS_BUSY,
}
MAX_PAGE_SIZE = 1000
MAX_STATUS_MESSAGE_BYTES = 2048


def status_for(exc: errors.RcoderError) -> grpc.Status:
    code = next(c for kind, c in STATUS_CODES if isinstance(exc, kind))
    info = error_details_pb2.ErrorInfo(reason=exc.reason, domain=ERROR_DOMAIN, metadata=exc.metadata)
    detail = any_pb2.Any()
    detail.Pack(info)
    # the message travels twice in trailing metadata (grpc-message and the Status detail), and
    # clients refuse trailers past 8-16 KiB: a long stderr tail must not turn a deliberate status
    # into RESOURCE_EXHAUSTED "received metadata size exceeds", so it is cut to its last part
    message = exc.message
    if len(message.encode()) > MAX_STATUS_MESSAGE_BYTES:
        head = exc.message.encode()[: MAX_STATUS_MESSAGE_BYTES // 2].decode(errors="ignore")
        tail = exc.message.encode()[-MAX_STATUS_MESSAGE_BYTES // 2 :].decode(errors="ignore")
        message = f"{head}\n…\n{tail}"
    return rpc_status.to_status(status_pb2.Status(code=code.value[0], message=message, details=[detail]))


async def abort(context: grpc.aio.ServicerContext[Any, Any], exc: errors.RcoderError) -> NoReturn:
    status = status_for(exc)
    log.info("request_refused", code=status.code.name, reason=exc.reason, message=exc.message[:300])
    await context.abort_with_status(status)
    raise AssertionError("abort_with_status returned")  # pragma: no cover


class AgentRunnerService(pb_grpc.AgentRunnerServicer):
    def __init__(self, worker: AcpWorker, queries: Queries) -> None:
        self._worker = worker
        self._queries = queries

    async def Chat(
        self, request: pb.ChatRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[pb.ChatStream]:
        try:
            turn = validate.chat_turn(request)
            run = await self._worker.chat(turn)
            async for event in run.follow(0):
                yield convert.chat_stream(event)
        except errors.RcoderError as exc:
            await abort(context, exc)

    async def Subscribe(
        self, request: pb.SubscribeRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[pb.ChatStream]:
        try:
            validate.identifier(request.run_id, "run_id", required=True)
            run = self._worker.run(request.run_id)
            async for event in run.follow(request.after_seq):
                yield convert.chat_stream(event)
        except errors.RcoderError as exc:
            await abort(context, exc)

    async def Cancel(self, request: pb.CancelRequest, context: grpc.aio.ServicerContext[Any, Any]) -> pb.CancelResponse:
        try:
            if bool(request.run_id) == bool(request.session_id):
                raise errors.InvalidArgument("run_id", "set exactly one of run_id or session_id")
            validate.identifier(request.run_id, "run_id")
            validate.identifier(request.session_id, "session_id")
            run_id, cancelled = await self._worker.cancel(request.run_id, request.session_id)
        except errors.RcoderError as exc:
            await abort(context, exc)
        return pb.CancelResponse(run_id=run_id, cancelled=cancelled)

    async def ResolvePermission(
        self, request: pb.ResolvePermissionRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ResolvePermissionResponse:
        try:
            validate.identifier(request.run_id, "run_id", required=True)
            validate.identifier(request.permission_id, "permission_id", required=True)
            validate.identifier(request.option_id, "option_id")
            self._worker.permissions.resolve(request.run_id, request.permission_id, request.option_id)
        except errors.RcoderError as exc:
            await abort(context, exc)
        return pb.ResolvePermissionResponse()

    async def CloseSession(
        self, request: pb.CloseSessionRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.CloseSessionResponse:
        try:
            validate.identifier(request.session_id, "session_id", required=True)
            stopped = await self._worker.close_session(request.session_id)
        except errors.RcoderError as exc:
            await abort(context, exc)
        return pb.CloseSessionResponse(agent_stopped=stopped)

    async def ForkSession(
        self, request: pb.ForkSessionRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ForkSessionResponse:
        try:
            validate.identifier(request.session_id, "session_id", required=True)
            check_project_id(request.project_id)
            forked = await self._worker.fork(request.session_id, request.project_id)
            status = self._queries.status(forked.record.session_id)
        except errors.RcoderError as exc:
            await abort(context, exc)
        return pb.ForkSessionResponse(
            session=convert.session(forked.record, _SESSION_STATUS[status]),
            method=convert.FORK_METHODS[forked.method],
            fallback_reason=forked.reason,
        )

    async def GetSession(
        self, request: pb.GetSessionRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.Session:
        try:
            validate.identifier(request.session_id, "session_id", required=True)
            record, status = await self._queries.session(request.session_id)
        except errors.RcoderError as exc:
            await abort(context, exc)
        return convert.session(record, _SESSION_STATUS[status])

    async def ListSessions(
        self, request: pb.ListSessionsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ListSessionsResponse:
        try:
            if request.project_id:
                check_project_id(request.project_id)
            if request.page_size > MAX_PAGE_SIZE:
                raise errors.InvalidArgument("page_size", f"at most {MAX_PAGE_SIZE}")
            after = _decode_page_token(request.page_token)
            rows, next_after = await self._queries.sessions(request.project_id, request.page_size or 100, after)
        except errors.RcoderError as exc:
            await abort(context, exc)
        return pb.ListSessionsResponse(
            sessions=[convert.session(r, _SESSION_STATUS[s]) for r, s in rows],
            next_page_token=_encode_page_token(next_after),
        )

    async def ListAgents(
        self, request: pb.ListAgentsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ListAgentsResponse:
        agents = []
        for view in self._queries.agents():
            info = pb.AgentInfo(
                name=view.profile.name,
                command=view.profile.command,
                args=list(view.profile.args),
                resume=view.profile.resume.value,
                default=view.is_default,
                warm_pool=view.profile.warm_pool,
                live_agents=view.live_agents,
                warm_agents=view.warm_agents,
                kind=view.profile.kind,
                sandbox=view.sandbox,
                landlock_abi=view.landlock_abi,
            )
            if view.capabilities is not None:
                info.capabilities.CopyFrom(convert.capabilities(view.capabilities, view.seen_at))
            agents.append(info)
        return pb.ListAgentsResponse(agents=agents)


def _encode_page_token(after: str) -> str:
    return base64.urlsafe_b64encode(after.encode()).decode() if after else ""


def _decode_page_token(token: str) -> str:
    if not token:
        return ""
    try:
        after = base64.b64decode(token.encode(), altchars=b"-_", validate=True).decode()
        validate.identifier(after, "page_token", required=True)
    except (binascii.Error, UnicodeError, ValueError, errors.InvalidArgument):
        raise errors.InvalidArgument("page_token", "not a token from a previous ListSessions answer") from None
    return after

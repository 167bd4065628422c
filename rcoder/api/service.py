"""The AgentRunner handlers: validate, call the core, convert. Thin on purpose.

``STATUS_CODES`` is the one table from rcoder's errors to gRPC codes; every
error leaves with a ``google.rpc.ErrorInfo`` carrying its reason.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import asdict, replace
from functools import partial
from typing import Any, NoReturn

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from rcoder import errors
from rcoder.api import convert, page_tokens, validate
from rcoder.api.files import FileRpcs
from rcoder.api.forwarding import NotHeld, forwarded
from rcoder.api.routed import Routes, retry_hint
from rcoder.api.scope import DELETED_MISSING, RUN_MISSING, STORED_RUN_MISSING, Call, Scope
from rcoder.logs import get_logger
from rcoder.session.files.project_files import ProjectFiles
from rcoder.session.hosts.routing import HostRecord, Owner
from rcoder.session.sessions.queries import Queries, SessionStatus
from rcoder.session.sessions.workspace import check_project_id
from rcoder.session.turns.intake import TurnIntake
from rcoder.v1 import agent_runner_pb2 as pb

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
    (errors.SessionDeleting, grpc.StatusCode.ABORTED),
    (errors.Sha256Mismatch, grpc.StatusCode.ABORTED),
    (errors.LeaseLost, grpc.StatusCode.ABORTED),
    (errors.OwnedElsewhere, grpc.StatusCode.UNAVAILABLE),
    (errors.AgentLimitReached, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.ShuttingDown, grpc.StatusCode.UNAVAILABLE),
    (errors.TurnContinuesElsewhere, grpc.StatusCode.UNAVAILABLE),
    (errors.StoreError, grpc.StatusCode.UNAVAILABLE),
    (errors.RunCancelled, grpc.StatusCode.CANCELLED),
    (errors.AgentAuthRequired, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.UnsafePath, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.NoCheckpoint, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.CheckpointError, grpc.StatusCode.UNAVAILABLE),
    (errors.RelayUnavailable, grpc.StatusCode.UNAVAILABLE),
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
    details = [detail]
    if isinstance(exc, errors.OwnedElsewhere):  # google.rpc.RetryInfo: when to try again
        seconds = max(exc.retry_after, 0.0)
        delay = duration_pb2.Duration(seconds=int(seconds), nanos=int((seconds % 1) * 1e9))
        retry = any_pb2.Any()
        retry.Pack(error_details_pb2.RetryInfo(retry_delay=delay))
        details.append(retry)
    # the message travels twice in trailing metadata (grpc-message and the Status detail), and
    # clients refuse trailers past 8-16 KiB: a long stderr tail must not turn a deliberate status
    # into RESOURCE_EXHAUSTED "received metadata size exceeds", so it is cut to its last part
    message = exc.message
    if len(message.encode()) > MAX_STATUS_MESSAGE_BYTES:
        head = exc.message.encode()[: MAX_STATUS_MESSAGE_BYTES // 2].decode(errors="ignore")
        tail = exc.message.encode()[-MAX_STATUS_MESSAGE_BYTES // 2 :].decode(errors="ignore")
        message = f"{head}\n…\n{tail}"
    return rpc_status.to_status(status_pb2.Status(code=code.value[0], message=message, details=details))


async def abort(
    context: grpc.aio.ServicerContext[Any, Any], exc: errors.RcoderError, trailing: tuple[tuple[str, str], ...] = ()
) -> NoReturn:
    status = status_for(exc)
    if not isinstance(exc, errors.Unauthenticated):  # those: rcoder.api.gate's line a minute per peer
        log.info("request_refused", code=status.code.name, reason=exc.reason, message=exc.message[:300])
    await context.abort(status.code, status.details, (*status.trailing_metadata, *trailing))
    raise AssertionError("abort_with_status returned")  # pragma: no cover


class AgentRunnerService(FileRpcs):
    """Each RPC about a session or a run is served here or at the host that owns it (``routed``),
    within what its caller may touch (``scope``: ``call`` is who the call is from, and what it
    concerned). The methods are the AgentRunner's, with the call added (``rcoder.api.server``
    registers them by name); the file RPCs are ``FileRpcs``'."""

    def __init__(self, intake: TurnIntake, queries: Queries, routes: Routes, files: ProjectFiles) -> None:
        self._files = files
        self._intake = intake
        self._queries = queries
        self._scope = Scope(queries)
        self._routes = routes
        self._router = routes.router
        self._profiles: dict[str, bool] | None = None  # name -> unconfined (sandbox "none"); fixed at start
        self._default_agent = ""

    def _agent_allowed(self, call: Call, agent: str, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        """The profile a call names (or the default one) is one its caller may run. A forward was
        checked by the host that received it (the caller it carries names no profiles)."""
        if call.caller.everywhere or forwarded(context):
            return
        if self._profiles is None:
            views = self._queries.agents()
            self._profiles = {v.profile.name: v.sandbox == "none" for v in views}
            self._default_agent = next((v.profile.name for v in views if v.is_default), "")
        name = agent or self._default_agent
        if name in self._profiles:  # an unknown one is refused as such where the turn starts
            self._scope.agent(call, name, self._profiles[name])

    async def _abort(self, context: grpc.aio.ServicerContext[Any, Any], exc: errors.RcoderError) -> NoReturn:
        await abort(context, exc, self._routes.owner_metadata)

    async def Chat(
        self, request: pb.ChatRequest, context: grpc.aio.ServicerContext[Any, Any], call: Call
    ) -> AsyncIterator[pb.ChatStream]:
        try:
            turn = validate.chat_turn(request)
            self._scope.project(call, turn.project_id)
            if turn.agent or not turn.session_id:  # a session resumed as it is runs its own agent
                self._agent_allowed(call, turn.agent, context)
            await self._scope.own_session(call, turn.session_id)
            turn = replace(turn, client=call.caller.name)

            async def here() -> AsyncIterator[pb.ChatStream]:
                ticket = await self._intake.submit(turn)
                # the run's ids as response headers once its session is listed, before its agent
                # starts: the caller can Cancel it, or find it, from its first moment
                await ticket.named
                call.run_id, call.session_id = ticket.run.run_id, ticket.run.session_id
                await context.send_initial_metadata(convert.run_headers(ticket.run.run_id, ticket.run.session_id))
                if ticket.position:
                    yield convert.queued(ticket.run.run_id, ticket.run.session_id, ticket.position)
                run = await ticket.started()
                async for event in run.follow(0):
                    yield convert.chat_stream(event)

            if not self._router.shared:  # one host: the stream as it always was, no extra hop per event
                context.set_trailing_metadata(self._routes.owner_metadata)
                async for message in here():
                    yield message
                return
            find = partial(self._router.session_owner, turn.session_id)
            what = ("session", turn.session_id)
            async for message in self._routes.stream(
                "Chat", request, context, find, here, what, self._run_end, announced=True, caller=call.caller
            ):
                call.run_id = call.run_id or message.run_id
                yield message
        except errors.RcoderError as exc:
            await self._abort(context, exc)

    async def Subscribe(
        self, request: pb.SubscribeRequest, context: grpc.aio.ServicerContext[Any, Any], call: Call
    ) -> AsyncIterator[pb.ChatStream]:
        try:
            validate.identifier(request.run_id, "run_id", required=True)
            # A run outside the caller's scope gets the answer of a run that neither this host nor the
            # store has (the one history.stored gives), so the caller learns nothing of it.
            await self._scope.run(call, request.run_id, errors.NotFound("run", request.run_id, STORED_RUN_MISSING))

            async def here() -> AsyncIterator[pb.ChatStream]:
                # From memory while this host keeps the run, and from the store once it no longer does.
                seen = False
                try:
                    async for event in self._intake.history.replay(request.run_id, request.after_seq):
                        seen = True
                        yield convert.chat_stream(event)
                except errors.NotFound as missing:
                    if seen:
                        raise
                    # A turn queued at another host is not in any store yet, so the other hosts are asked.
                    try:
                        async for message in self._routes.stream_from_others(
                            "Subscribe", request, context, self._run_end, caller=call.caller
                        ):
                            yield message
                    except NotHeld:
                        raise missing from None

            find = partial(self._router.run_owner, request.run_id)
            what = ("run", request.run_id)
            async for message in self._routes.stream(
                "Subscribe", request, context, find, here, what, self._run_end, caller=call.caller
            ):
                yield message
        except errors.RcoderError as exc:
            await self._abort(context, exc)

    async def _run_end(self, last: pb.ChatStream) -> AsyncIterator[pb.ChatStream]:
        """The owner broke the stream after ``last`` and its lease expired: the run's end as the
        store has it (ended "owner host lost" on the way)."""
        owner = await self._router.run_owner(last.run_id)
        if owner is not None:
            raise errors.OwnedElsewhere("run", last.run_id, owner.host_id, owner.advertise_address, retry_hint(owner))
        async for stored in self._intake.history.stored(last.run_id, last.seq, seen=True):
            yield convert.chat_stream(stored)

    async def Cancel(
        self, request: pb.CancelRequest, context: grpc.aio.ServicerContext[Any, Any], call: Call
    ) -> pb.CancelResponse:
        try:
            if bool(request.run_id) == bool(request.session_id):
                raise errors.InvalidArgument("run_id", "set exactly one of run_id or session_id")
            validate.identifier(request.run_id, "run_id")
            validate.identifier(request.session_id, "session_id")
            await self._scope.run(call, request.run_id)
            await self._scope.session(call, request.session_id, "")

            async def here() -> pb.CancelResponse:
                try:
                    run_id, cancelled = await self._intake.cancel(request.run_id, request.session_id)
                except errors.NotFound:
                    # A run of a lost host is ended "owner host lost" (docs/design/hosts.md#a-lost-hosts-runs).
                    ended = await self._router.end_lost(request.run_id)
                    if ended is not None:
                        return pb.CancelResponse(run_id=request.run_id, cancelled=ended)
                    # A turn queued at another host is not in any store yet, so the other hosts are asked.
                    asked = (
                        await self._routes.ask_others("Cancel", request, context, call.caller)
                        if request.run_id
                        else None
                    )
                    if asked is None:
                        raise
                    answer: pb.CancelResponse = asked
                    return answer
                if not cancelled and request.session_id and run_id:
                    cancelled = bool(await self._router.end_lost(run_id))  # its last run, on a lost host
                return pb.CancelResponse(run_id=run_id, cancelled=cancelled)

            async def queued(owner: Owner) -> pb.CancelResponse:  # the owner did not answer: through the store
                sent = await self._router.signal_cancel(owner, request.run_id, request.session_id)
                return pb.CancelResponse(run_id=sent.run_id, cancelled=sent.running, queued=sent.queued)

            if request.run_id:
                find = partial(self._router.run_owner, request.run_id, end_orphan=False)
                what = ("run", request.run_id)
            else:
                find, what = partial(self._router.session_owner, request.session_id), ("session", request.session_id)
            response: pb.CancelResponse = await self._routes.unary(
                "Cancel", request, context, find, here, what, queued, caller=call.caller
            )
        except errors.RcoderError as exc:
            await self._abort(context, exc)
        return response

    async def ResolvePermission(
        self, request: pb.ResolvePermissionRequest, context: grpc.aio.ServicerContext[Any, Any], call: Call
    ) -> pb.ResolvePermissionResponse:
        try:
            validate.identifier(request.run_id, "run_id", required=True)
            validate.identifier(request.permission_id, "permission_id", required=True)
            validate.identifier(request.option_id, "option_id")
            missing = errors.NotFound(
                "permission request", request.permission_id, f"no pending request with this id in run {request.run_id}"
            )
            await self._scope.run(call, request.run_id, missing)

            async def here() -> pb.ResolvePermissionResponse:
                self._intake.permissions.resolve(request.run_id, request.permission_id, request.option_id)
                return pb.ResolvePermissionResponse()

            async def queued(owner: Owner) -> pb.ResolvePermissionResponse:  # the owner did not answer
                await self._router.signal_permission(owner, request.run_id, request.permission_id, request.option_id)
                return pb.ResolvePermissionResponse(queued=True)

            find, what = partial(self._router.run_owner, request.run_id), ("run", request.run_id)
            response: pb.ResolvePermissionResponse = await self._routes.unary(
                "ResolvePermission", request, context, find, here, what, queued, caller=call.caller
            )
        except errors.RcoderError as exc:
            await self._abort(context, exc)
        return response

    async def CloseSession(
        self, request: pb.CloseSessionRequest, context: grpc.aio.ServicerContext[Any, Any], call: Call
    ) -> pb.CloseSessionResponse:
        try:
            validate.identifier(request.session_id, "session_id", required=True)
            await self._scope.session(call, request.session_id, "")

            async def here() -> pb.CloseSessionResponse:
                return pb.CloseSessionResponse(agent_stopped=await self._intake.close_session(request.session_id))

            find, what = partial(self._router.session_owner, request.session_id), ("session", request.session_id)
            response: pb.CloseSessionResponse = await self._routes.unary(
                "CloseSession", request, context, find, here, what, caller=call.caller
            )
        except errors.RcoderError as exc:
            await self._abort(context, exc)
        return response

    async def DeleteSession(
        self, request: pb.DeleteSessionRequest, context: grpc.aio.ServicerContext[Any, Any], call: Call
    ) -> pb.DeleteSessionResponse:
        try:
            validate.identifier(request.session_id, "session_id", required=True)
            await self._scope.session(call, request.session_id, DELETED_MISSING)

            async def here() -> pb.DeleteSessionResponse:
                return convert.session_erased(await self._intake.delete_session(request.session_id))

            # The session's owner serves it, as it does CloseSession, because the agent to end runs there.
            find, what = partial(self._router.session_owner, request.session_id), ("session", request.session_id)
            response: pb.DeleteSessionResponse = await self._routes.unary(
                "DeleteSession", request, context, find, here, what, caller=call.caller
            )
        except errors.RcoderError as exc:
            await self._abort(context, exc)
        return response

    async def GetRunChanges(
        self, request: pb.GetRunChangesRequest, context: grpc.aio.ServicerContext[Any, Any], call: Call
    ) -> pb.GetRunChangesResponse:
        try:
            validate.identifier(request.run_id, "run_id", required=True)
            validate.diff_path(request.path, "path")
            await self._scope.run(call, request.run_id)
            # Any host can answer, since every host reads the same checkpoint stores (docs/checkpoints.md).
            try:
                found = await self._intake.run_changes(request.run_id, request.path)
            except errors.NoCheckpoint as missing:  # its snapshots may be in another host's checkpoint_root
                raise await self._router.no_checkpoint(missing, request.run_id) from None
        except errors.RcoderError as exc:
            await self._abort(context, exc)
        return pb.GetRunChangesResponse(
            diff=found.diff,
            truncated=found.truncated,
            changes=convert.file_changes(found.changes),
            changes_unlisted=found.unlisted,
        )

    async def RewindSession(
        self, request: pb.RewindSessionRequest, context: grpc.aio.ServicerContext[Any, Any], call: Call
    ) -> pb.RewindSessionResponse:
        try:
            validate.identifier(request.session_id, "session_id", required=True)
            validate.identifier(request.run_id, "run_id", required=True)
            await self._scope.session(call, request.session_id)
            # another tenant's run answers as a missing one (rcoder.session.sessions.rewinding's), not as a
            # run of another session
            await self._scope.run(call, request.run_id, errors.NotFound("run", request.run_id, RUN_MISSING))

            async def here() -> pb.RewindSessionResponse:
                try:
                    done = await self._intake.rewind_session(
                        request.session_id, request.run_id, request.include_other_sessions
                    )
                except errors.NoCheckpoint as missing:  # its snapshots may be in another host's checkpoint_root
                    raise await self._router.no_checkpoint(missing, request.run_id) from None
                return pb.RewindSessionResponse(
                    run_id=done.run_id,
                    changes=convert.file_changes(done.changes),
                    agent_stopped=done.agent_stopped,
                    changes_unlisted=done.changes_unlisted,
                    not_restored=convert.file_changes(done.not_restored),
                )

            # The session's owner serves it, as it does CloseSession, because the agent to end runs there.
            find, what = partial(self._router.session_owner, request.session_id), ("session", request.session_id)
            response: pb.RewindSessionResponse = await self._routes.unary(
                "RewindSession", request, context, find, here, what, caller=call.caller
            )
        except errors.RcoderError as exc:
            await self._abort(context, exc)
        return response

    async def ListRuns(
        self, request: pb.ListRunsRequest, context: grpc.aio.ServicerContext[Any, Any], call: Call
    ) -> pb.ListRunsResponse:
        try:
            validate.identifier(request.session_id, "session_id", required=True)
            await self._scope.session(call, request.session_id)
            if request.page_size > MAX_PAGE_SIZE:
                raise errors.InvalidArgument("page_size", f"at most {MAX_PAGE_SIZE}")
            after = page_tokens.decode_runs(request.page_token, request.session_id)
            runs, next_after = await self._queries.runs(request.session_id, request.page_size or 100, after)
        except errors.RcoderError as exc:
            await self._abort(context, exc)
        return pb.ListRunsResponse(
            runs=[convert.run_info(r) for r in runs],
            next_page_token=page_tokens.encode_runs(request.session_id, next_after),
        )

    async def ForkSession(
        self, request: pb.ForkSessionRequest, context: grpc.aio.ServicerContext[Any, Any], call: Call
    ) -> pb.ForkSessionResponse:
        try:
            validate.identifier(request.session_id, "session_id", required=True)
            check_project_id(request.project_id)
            validate.identifier(request.agent, "agent")
            # the branch's project first: its answer does not depend on the source, so a source
            # of another tenant's and one that does not exist meet the same refusal
            self._scope.project(call, request.project_id)
            if request.agent:  # else the source's own; checked before the source, as the project is
                self._agent_allowed(call, request.agent, context)
            await self._scope.session(call, request.session_id, "")  # the source: by the project stored with it

            async def here() -> pb.ForkSessionResponse:
                forked = await self._intake.fork(request.session_id, request.project_id, request.agent)
                status = self._queries.status(forked.record.session_id)
                return pb.ForkSessionResponse(
                    session=convert.session(forked.record, _SESSION_STATUS[status]),
                    method=convert.FORK_METHODS[forked.method],
                    fallback_reason=forked.reason,
                )

            find, what = partial(self._router.session_owner, request.session_id), ("session", request.session_id)
            response: pb.ForkSessionResponse = await self._routes.unary(
                "ForkSession", request, context, find, here, what, caller=call.caller
            )
        except errors.RcoderError as exc:
            await self._abort(context, exc)
        return response

    async def GetSession(
        self, request: pb.GetSessionRequest, context: grpc.aio.ServicerContext[Any, Any], call: Call
    ) -> pb.Session:
        try:
            validate.identifier(request.session_id, "session_id", required=True)
            await self._scope.session(call, request.session_id)

            async def here() -> pb.Session:
                view = await self._queries.session(request.session_id)
                return convert.session(
                    view.record, _SESSION_STATUS[view.status], view.usage, view.resources, view.place
                )

            find, what = partial(self._router.session_owner, request.session_id), ("session", request.session_id)
            response: pb.Session = await self._routes.unary(
                "GetSession", request, context, find, here, what, caller=call.caller
            )
        except errors.RcoderError as exc:
            await self._abort(context, exc)
        return response

    async def ListHosts(
        self, request: pb.ListHostsRequest, context: grpc.aio.ServicerContext[Any, Any], call: Call
    ) -> pb.ListHostsResponse:
        try:
            hosts = await self._router.hosts()
            sharing = await self._router.share_checkpoint_root([h.host_id for h in hosts])
        except errors.RcoderError as exc:
            await self._abort(context, exc)
        context.set_trailing_metadata(self._routes.owner_metadata)
        this = self._router.host_id
        return pb.ListHostsResponse(hosts=[_host(h, h.host_id == this, h.host_id in sharing) for h in hosts])

    async def ListSessions(
        self, request: pb.ListSessionsRequest, context: grpc.aio.ServicerContext[Any, Any], call: Call
    ) -> pb.ListSessionsResponse:
        try:
            if request.project_id:
                check_project_id(request.project_id)
                self._scope.project(call, request.project_id)
            if request.page_size > MAX_PAGE_SIZE:
                raise errors.InvalidArgument("page_size", f"at most {MAX_PAGE_SIZE}")
            order, currency = validate.session_order(request)
            after = page_tokens.decode(request.page_token, order, currency)
            limit = request.page_size or 100
            views, next_after = await self._queries.sessions(
                request.project_id, limit, order, currency, after, projects=call.caller.scope
            )
        except errors.RcoderError as exc:
            await self._abort(context, exc)
        return pb.ListSessionsResponse(
            sessions=[convert.session(v.record, _SESSION_STATUS[v.status], v.usage) for v in views],
            next_page_token=page_tokens.encode(order, currency, next_after),
        )

    async def ListAgents(
        self, request: pb.ListAgentsRequest, context: grpc.aio.ServicerContext[Any, Any], call: Call
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
                network=pb.NetworkReach(**asdict(view.network)),
                promises=pb.SandboxPromises(
                    files=view.promises.files,
                    truncate=view.promises.truncate,
                    signals=view.promises.signals,
                    abstract_unix_sockets=view.promises.abstract_unix_sockets,
                    network=view.promises.network,
                    socket_files=view.promises.socket_files,
                    not_kept=view.promises.not_kept(),
                ),
                **convert.agent_limits(view.limits, view.profile),
                **convert.agent_readiness(view.readiness),
                places=[convert.agent_place(place) for place in view.places],
            )
            if view.capabilities is not None:
                info.capabilities.CopyFrom(convert.capabilities(view.capabilities, view.seen_at))
            agents.append(info)
        user = self._queries.agent_user()
        runs_as = pb.AgentUser(uid=user.uid, gid=user.gid, name=user.name, separate=user.separate, reason=user.reason,
                               fix=user.fix)  # fmt: skip
        return pb.ListAgentsResponse(agents=agents, runs_as=runs_as)


def _host(record: HostRecord, this: bool, shares_checkpoint_root: bool) -> pb.Host:
    return pb.Host(
        host_id=record.host_id,
        advertise_address=record.advertise_address,
        heartbeat=convert.timestamp(record.heartbeat),
        version=record.version,
        started_at=convert.timestamp(record.started_at),
        live=record.live,
        self=this,
        shares_checkpoint_root=shares_checkpoint_root,
    )

"""``RcoderClient``: one daemon, one channel; its token and TLS; every call of the AgentRunner API."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from types import TracebackType
from typing import Any, Self

import grpc

from rcoder.client.changes import Rewind, RunChanges, rewind_from_proto, run_changes_from_proto
from rcoder.client.errors import ClientClosed, NotFound, from_rpc_error
from rcoder.client.files import FileData, FileEntry, FileKind, FilePage, FileRead, Files, WrittenFile
from rcoder.client.requests import Attachment, BusyPolicy, McpServer, ModelProvider, PermissionMode, chat_request
from rcoder.client.resources import (
    SESSION_ORDERS,
    AgentInfo,
    AgentUser,
    CancelResult,
    Deletion,
    Fork,
    RunInfo,
    RunPage,
    Session,
    SessionOrder,
    SessionPage,
    agent_from_proto,
    agent_user_from_proto,
    deletion_from_proto,
    fork_from_proto,
    run_from_proto,
    session_from_proto,
)
from rcoder.client.token import find_token
from rcoder.client.turn import Turn
from rcoder.v1 import agent_runner_pb2 as pb
from rcoder.v1 import agent_runner_pb2_grpc as pb_grpc

DEFAULT_TIMEOUT = 30.0  # seconds, for every call but the two streams
MAX_MESSAGE_BYTES = 64 << 20  # as the daemon sends: an agent's single message may be large
DEFAULT_OPTIONS: dict[str, Any] = {"grpc.max_receive_message_length": MAX_MESSAGE_BYTES}


class RcoderClient:
    """A client of one rcoder daemon: ``async with RcoderClient("host:port", token=...) as client``.

    ``token`` is sent as ``authorization: Bearer <token>`` with every call ("": not sent; None: the one
    ``find_token`` finds, as a daemon on this host with no ``auth_token`` keeps it in its data_dir).
    ``tls``: None or False for a plaintext channel; True for TLS with the system's root certificates;
    PEM ``bytes`` of the root certificates to trust; or ``grpc.ssl_channel_credentials(...)`` as made.
    ``options`` are gRPC channel arguments, over ``DEFAULT_OPTIONS``. ``timeout`` bounds every unary call
    (None: no bound); ``chat`` and ``subscribe`` streams are unbounded unless given their own ``timeout``.

    Make it inside a running event loop (its grpc.aio channel belongs to that loop). ``close()`` is
    idempotent; a call after it raises ``ClientClosed``. Failed calls raise ``RcoderClientError`` subclasses."""

    def __init__(
        self,
        target: str,
        *,
        token: str | None = None,
        tls: bool | bytes | grpc.ChannelCredentials | None = None,
        options: Sequence[tuple[str, Any]] = (),
        timeout: float | None = DEFAULT_TIMEOUT,
    ) -> None:
        self.target = target
        token = find_token() if token is None else token
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._timeout = timeout
        self._channel = _make_channel(target, tls, {**DEFAULT_OPTIONS, **dict(options)})
        self._stub = pb_grpc.AgentRunnerStub(self._channel)
        self._closed = False
        self.sessions = Sessions(self._stub, self._unary)
        self._files = Files(self._stub, self._unary, self._metadata, self._check_open)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def close(self, grace: float | None = None) -> None:
        """Close the channel: calls still running end at once (after ``grace`` seconds, if given)."""
        if self._closed:
            return
        self._closed = True
        await self._channel.close(grace)

    # ------------------------------------------------------------ turns

    def chat(
        self,
        project_id: str,
        prompt: str = "",
        *,
        session_id: str | None = None,
        agent: str | None = None,
        permission_mode: PermissionMode | None = None,
        system_prompt: str = "",
        request_id: str = "",
        model_provider: ModelProvider | None = None,
        mcp_servers: Sequence[McpServer] = (),
        extra_meta: Mapping[str, Any] | None = None,
        attachments: Sequence[Attachment] = (),
        busy: BusyPolicy | None = None,
        config_options: Mapping[str, str] | None = None,
        max_cost_usd: float = 0.0,
        timeout: float | None = None,
        on_named: Callable[[Turn], None] | None = None,
    ) -> Turn:
        """One turn with an agent in the project's folder; its events stream from the returned ``Turn``.

        ``session_id`` continues a conversation (a ``Started.session_id`` of an earlier turn); ``agent``
        names a profile (None: the daemon's ``default_agent``); ``permission_mode`` None is the daemon's
        default (``ALLOW``). ``busy`` says what happens while the session runs another turn: None or
        ``BusyPolicy.REJECT`` raise ``rcoder.client.Busy``; ``BusyPolicy.QUEUE`` waits behind it, and
        ``BusyPolicy.INTERRUPT`` cancels it (and the turns queued) first: the turn's first event is then
        ``Queued`` (its ``run_id`` at once, to ``cancel`` it while it waits), and ``Started`` comes
        when it starts.
        ``config_options`` sets the agent's session options before the prompt
        (ACP config id -> value id, e.g. ``{"model": "opus", "mode": "plan"}``: ``Started.config_options``
        lists what the agent offers); the session keeps them. ``max_cost_usd`` caps this turn's own cost in
        USD (0: no cap of its own): past it the turn ends ``StopReason.BUDGET_EXCEEDED``; it can lower the
        daemon's budgets, never raise them. ``on_named`` is called with the turn once its ``run_id`` and
        ``session_id`` are known from the response headers, before its agent has started. The call
        starts when the turn is first read::

            turn = client.chat("demo", "hello")
            async for event in turn: ...          # or: text = await turn.text()
        """
        request = chat_request(
            project_id,
            prompt,
            session_id=session_id,
            agent=agent,
            permission_mode=permission_mode,
            system_prompt=system_prompt,
            request_id=request_id,
            model_provider=model_provider,
            mcp_servers=mcp_servers,
            extra_meta=extra_meta,
            attachments=attachments,
            busy=busy,
            config_options=config_options,
            max_cost_usd=max_cost_usd,
        )
        return Turn(self._streaming(self._stub.Chat, request, timeout), on_named)

    def subscribe(
        self,
        run_id: str | None = None,
        *,
        session_id: str | None = None,
        after_seq: int = 0,
        timeout: float | None = None,
    ) -> Turn:
        """Re-attach to a run: its events with ``seq > after_seq``, then live ones to its end.

        Give ``run_id``, or ``session_id`` for that session's latest run (the running one, if any)."""
        if bool(run_id) == bool(session_id):
            raise ValueError("subscribe takes a run_id or a session_id (one of them)")

        async def open_call() -> Any:
            target = run_id or await self._last_run(session_id or "")
            request = pb.SubscribeRequest(run_id=target, after_seq=after_seq)
            return await self._streaming(self._stub.Subscribe, request, timeout)()

        return Turn(open_call)

    async def _last_run(self, session_id: str) -> str:
        session = await self.sessions.get(session_id)
        if not session.last_run_id:
            raise NotFound(f"session {session_id!r} has had no run yet", reason="RUN_NOT_FOUND")
        return session.last_run_id

    async def cancel(self, run_id: str | None = None, *, session_id: str | None = None) -> CancelResult:
        """Stop a running turn, by ``run_id`` or ``session_id`` (exactly one); its stream then ends
        with ``Completed(stop_reason=CANCELLED)``. ``cancelled`` is False when it had already ended.
        A queued turn (``Queued``) never starts: its stream raises ``Cancelled``. By ``session_id``,
        the running turn and every turn queued behind it are cancelled."""
        request = pb.CancelRequest(run_id=run_id or "", session_id=session_id or "")
        answer = await self._unary(self._stub.Cancel, request)
        return CancelResult(run_id=answer.run_id, cancelled=answer.cancelled, queued=answer.queued)

    async def resolve_permission(self, run_id: str, permission_id: str, option_id: str | None = None) -> bool:
        """Answer a ``PermissionRequest`` of a turn run with ``PermissionMode.ASK`` with one of its options'
        ``option_id`` (None: cancelled). Each request takes one answer: a second is ``NotFound``.
        True when the answer was queued: the owning host did not answer, and it was left for it in
        the store (a second answer is then not refused here; the first one counts)."""
        request = pb.ResolvePermissionRequest(run_id=run_id, permission_id=permission_id, option_id=option_id or "")
        answer = await self._unary(self._stub.ResolvePermission, request)
        return bool(answer.queued)

    # ------------------------------------------------------------ files (docs/files.md)

    def list_files(
        self, project_id: str, path: str = "", *, recursive: bool = False, page_size: int = 0
    ) -> AsyncIterator[FileEntry]:
        """Every entry of a folder of the project ("": the project itself), or of all below it with
        ``recursive``, page after page: ``async for entry in client.list_files("demo", "src")``.
        Links are listed as links (``link_target``), never entered."""
        return self._files.list(project_id, path, recursive=recursive, page_size=page_size)

    async def files_page(
        self, project_id: str, path: str = "", *, recursive: bool = False, page_size: int = 0, page_token: str = ""
    ) -> FilePage:
        """One page of ``list_files`` (``page_size`` 0: the daemon's default, 1000; at most 10000)."""
        return await self._files.page(project_id, path, recursive=recursive, page_size=page_size, page_token=page_token)

    def read_file(
        self, project_id: str, path: str, *, offset: int = 0, limit: int = 0, timeout: float | None = None
    ) -> FileRead:
        """A file of the project, from ``offset``, at most ``limit`` bytes (0: to the end)::

        data = await client.read_file("demo", "src/main.py").bytes()
        read = client.read_file("demo", "big.bin")
        async for chunk in read: ...        # read.head: size, mode, sha256 of the whole file
        """
        return self._files.read(project_id, path, offset=offset, limit=limit, timeout=timeout)

    async def write_file(
        self,
        project_id: str,
        path: str,
        data: FileData,
        *,
        mode: int = 0,
        if_sha256: str = "",
        while_busy: bool = False,
        timeout: float | None = None,
    ) -> WrittenFile:
        """Write a file of the project whole (folders made) from ``data``: bytes, or an iterable or
        async iterable of bytes. ``mode`` 0 keeps the replaced file's (0o644 for a new one).
        ``if_sha256``: write only over the file with this SHA-256 (``"absent"``: only where there is
        none), else ``Conflict``. While a turn runs in the project it is ``FailedPrecondition``
        (``PROJECT_BUSY``) unless ``while_busy``."""
        head = pb.WriteFileChunk(
            project_id=project_id, path=path, mode=mode, if_sha256=if_sha256, while_busy=while_busy
        )
        return await self._files.write(head, data, timeout)

    async def delete_file(
        self, project_id: str, path: str, *, recursive: bool = False, while_busy: bool = False
    ) -> FileKind:
        """Delete a file, a link (never what it points to) or a folder (with ``recursive``, all it
        holds; else only an empty one); what it was."""
        request = pb.DeleteFileRequest(project_id=project_id, path=path, recursive=recursive, while_busy=while_busy)
        return await self._files.delete(request)

    # ------------------------------------------------------------ agents

    async def agents(self) -> list[AgentInfo]:
        """The daemon's agent profiles, with what each advertised and how many of its agents run."""
        answer = await self._unary(self._stub.ListAgents, pb.ListAgentsRequest())
        return [agent_from_proto(agent) for agent in answer.agents]

    async def agent_user(self) -> AgentUser:
        """Who the daemon's agents run as: their own uid (``separate``), or the daemon's and why."""
        answer = await self._unary(self._stub.ListAgents, pb.ListAgentsRequest())
        return agent_user_from_proto(answer.runs_as)

    # ------------------------------------------------------------ plumbing

    def _check_open(self) -> None:
        if self._closed:
            raise ClientClosed(f"the client of {self.target} is closed")

    def _streaming(self, method: Any, request: Any, timeout: float | None) -> Callable[[], Awaitable[Any]]:
        """What opens a streaming call of ``method`` (the turn opens it at its first read)."""

        async def open_call() -> Any:
            self._check_open()
            return method(request, metadata=self._metadata, timeout=timeout)

        return open_call

    async def _unary(self, method: Any, request: Any) -> Any:
        self._check_open()
        try:
            return await method(request, metadata=self._metadata, timeout=self._timeout)
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc) from exc


class Sessions:
    """``client.sessions``: the session records (``get``, ``page``, ``list``), ``close``, ``fork``,
    their runs (``runs_page``, ``list_runs``, ``run_changes``), ``rewind`` and ``delete``."""

    def __init__(self, stub: pb_grpc.AgentRunnerStub, unary: Callable[[Any, Any], Awaitable[Any]]) -> None:
        self._stub = stub
        self._unary = unary  # the client's: its token, its timeout, its errors

    async def get(self, session_id: str) -> Session:
        request = pb.GetSessionRequest(session_id=session_id)
        return session_from_proto(await self._unary(self._stub.GetSession, request))

    async def fork(self, session_id: str, project_id: str, *, agent: str | None = None) -> Fork:
        """A new session sharing ``session_id``'s history so far; later turns on either branch never
        reach the other (``ForkSession``). A busy session is forked as it stands. ``agent``: continue
        in that profile (None: the source's); its first turn is re-seeded from the transcript."""
        request = pb.ForkSessionRequest(session_id=session_id, project_id=project_id, agent=agent or "")
        return fork_from_proto(await self._unary(self._stub.ForkSession, request))

    async def close(self, session_id: str) -> bool:
        """End the session's agent (the record stays; the next chat resumes it). True if one was live;
        ``Busy`` while a turn runs."""
        answer = await self._unary(self._stub.CloseSession, pb.CloseSessionRequest(session_id=session_id))
        return bool(answer.agent_stopped)

    async def delete(self, session_id: str) -> Deletion:
        """Erase the conversation everywhere rcoder keeps it (``DeleteSession``): its agent ended (a
        running turn cancelled first), its runs, transcript and record, and the agent's own copy where
        rcoder knows where the agent keeps it. Its ids are unknown afterwards."""
        request = pb.DeleteSessionRequest(session_id=session_id)
        return deletion_from_proto(await self._unary(self._stub.DeleteSession, request))

    async def rewind(self, session_id: str, run_id: str, include_other_sessions: bool = False) -> Rewind:
        """Restore the project's files to how they were before ``run_id`` of the session and go on
        from there: its agent ended, the next turn re-seeded from the transcript up to that run
        (``RewindSession``, docs/checkpoints.md). ``FAILED_PRECONDITION`` while a turn runs in the project,
        or when later runs of other sessions wrote files it changes back and ``include_other_sessions``
        is not set."""
        request = pb.RewindSessionRequest(
            session_id=session_id, run_id=run_id, include_other_sessions=include_other_sessions
        )
        return rewind_from_proto(await self._unary(self._stub.RewindSession, request))

    async def run_changes(self, run_id: str, path: str = "") -> RunChanges:
        """What the run changed in its project's files, and the unified diff (of ``path`` alone
        when given; ``GetRunChanges``)."""
        request = pb.GetRunChangesRequest(run_id=run_id, path=path)
        return run_changes_from_proto(await self._unary(self._stub.GetRunChanges, request))

    async def runs_page(self, session_id: str, *, page_size: int = 0, page_token: str = "") -> RunPage:
        """One page of the session's runs, oldest first (``page_size`` 0: the daemon's default, 100;
        at most 1000)."""
        request = pb.ListRunsRequest(session_id=session_id, page_size=page_size, page_token=page_token)
        answer = await self._unary(self._stub.ListRuns, request)
        return RunPage(runs=tuple(run_from_proto(r) for r in answer.runs), next_page_token=answer.next_page_token)

    async def list_runs(self, session_id: str, *, page_size: int = 0) -> AsyncIterator[RunInfo]:
        """Every run of the session, oldest first, page after page: ``async for r in client.sessions.list_runs(s)``."""
        token = ""
        while True:
            page = await self.runs_page(session_id, page_size=page_size, page_token=token)
            for run in page.runs:
                yield run
            token = page.next_page_token
            if not token:
                return

    async def page(
        self,
        project_id: str | None = None,
        *,
        page_size: int = 0,
        page_token: str = "",
        order_by: SessionOrder = SessionOrder.UNSPECIFIED,
        cost_currency: str = "",
    ) -> SessionPage:
        """One page of sessions (``page_size`` 0: the daemon's default, 100; at most 1000), by session_id
        or, with ``order_by=SessionOrder.COST_DESC``, the most costly in ``cost_currency`` (default USD)
        first. A ``page_token`` goes on only with the order and currency it was made in."""
        request = pb.ListSessionsRequest(
            project_id=project_id or "", page_size=page_size, page_token=page_token,
            order_by=SESSION_ORDERS[order_by], cost_currency=cost_currency,
        )  # fmt: skip
        answer = await self._unary(self._stub.ListSessions, request)
        return SessionPage(
            sessions=tuple(session_from_proto(s) for s in answer.sessions), next_page_token=answer.next_page_token
        )

    async def list(
        self,
        project_id: str | None = None,
        *,
        page_size: int = 0,
        order_by: SessionOrder = SessionOrder.UNSPECIFIED,
        cost_currency: str = "",
    ) -> AsyncIterator[Session]:
        """Every session (of ``project_id``, if given), page after page: ``async for s in client.sessions.list()``."""
        token = ""
        while True:
            page = await self.page(
                project_id, page_size=page_size, page_token=token, order_by=order_by, cost_currency=cost_currency
            )
            for session in page.sessions:
                yield session
            token = page.next_page_token
            if not token:
                return


def _make_channel(target: str, tls: Any, options: dict[str, Any]) -> Any:
    pairs = list(options.items())
    if tls is None or tls is False:
        return grpc.aio.insecure_channel(target, options=pairs)
    if tls is True:
        credentials = grpc.ssl_channel_credentials()
    elif isinstance(tls, bytes):
        credentials = grpc.ssl_channel_credentials(root_certificates=tls)
    else:
        credentials = tls
    return grpc.aio.secure_channel(target, credentials, options=pairs)

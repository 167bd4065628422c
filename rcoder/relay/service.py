"""The relay's gRPC handlers (``rcoder.relay.v1.RelayService``): each request checked, each error one
of rcoder's own, mapped to a gRPC code in ``STATUS_CODES`` and sent with its ErrorInfo.

The relay is a gRPC edge of its own, beside the daemon's ``rcoder.api``: a separate process with a
separate contract, whose one client is a daemon (docs/relay.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, NoReturn

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from rcoder import errors
from rcoder.agent.confinement.limits import Values
from rcoder.logs import get_logger
from rcoder.relay.agent_home import AgentHome
from rcoder.relay.agents import SIGNALS, Agents, AgentSpec, Attachment, AttachTakenOver, Grants, RelayAgent
from rcoder.relay.v1 import relay_pb2 as pb
from rcoder.relay.v1 import relay_pb2_grpc as pb_grpc
from rcoder.relay.v1 import workspace_pb2 as workspace_pb

log = get_logger("rcoder.relay.service")
ERROR_DOMAIN = "rcoder.dev"
# frames sent at most in one go before the stream looks at its acknowledgements again
_BATCH = 256
_HALF_CLOSE_WAIT = 5.0  # seconds an ended agent's stream waits for its client to close its half

# takes a snapshot as RelayWorkspaceService.Snapshot does: its commit, or one of rcoder's errors
Snapshotter = Callable[[workspace_pb.SnapshotRequest], Awaitable[str]]

# Most specific first: the first class an error is an instance of wins.
STATUS_CODES: tuple[tuple[type[errors.RcoderError], grpc.StatusCode], ...] = (
    (errors.InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.NotFound, grpc.StatusCode.NOT_FOUND),
    (errors.PermissionDenied, grpc.StatusCode.PERMISSION_DENIED),
    (errors.OutOfRange, grpc.StatusCode.OUT_OF_RANGE),
    (errors.Unimplemented, grpc.StatusCode.UNIMPLEMENTED),
    (errors.Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    (AttachTakenOver, grpc.StatusCode.ABORTED),
    (errors.Sha256Mismatch, grpc.StatusCode.ABORTED),
    (errors.ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.UnsafePath, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.NoCheckpoint, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.CheckpointError, grpc.StatusCode.UNAVAILABLE),
    (errors.ShuttingDown, grpc.StatusCode.UNAVAILABLE),
    (errors.AgentError, grpc.StatusCode.UNAVAILABLE),
    (errors.RcoderError, grpc.StatusCode.INTERNAL),
)


def status_for(exc: errors.RcoderError) -> grpc.Status:
    code = next(c for kind, c in STATUS_CODES if isinstance(exc, kind))
    detail = any_pb2.Any()
    detail.Pack(error_details_pb2.ErrorInfo(reason=exc.reason, domain=ERROR_DOMAIN, metadata=exc.metadata))
    return rpc_status.to_status(status_pb2.Status(code=code.value[0], message=exc.message[:2048], details=[detail]))


async def abort(context: grpc.aio.ServicerContext[Any, Any], exc: errors.RcoderError) -> NoReturn:
    status = status_for(exc)
    if not isinstance(exc, errors.Unauthenticated):
        log.info("relay_request_refused", code=status.code.name, reason=exc.reason, message=exc.message[:300])
    await context.abort(status.code, status.details, status.trailing_metadata)
    raise AssertionError("abort returned")  # pragma: no cover


def agent_message(agent: RelayAgent, generations: int, snapshots: bool = False) -> pb.Agent:
    frames = agent.frames
    return pb.Agent(
        agent_id=agent.agent_id,
        session_id=agent.session_id,
        name=agent.name,
        pid=agent.process.pid,
        last_seq=frames.last_seq,
        acked_seq=frames.acked,
        first_buffered_seq=frames.first_seq,
        dropped_frames=frames.dropped,
        stdin_seq=agent.stdin_seq,
        exited=agent.exit_code is not None,
        exit_code=agent.exit_code or 0,
        generation=generations,
        attached=agent.attachment is not None,
        snapshots_on_stream=snapshots,
        snapshots_in_frames=snapshots,
    )


def failure_of(exc: errors.RcoderError) -> pb.SnapshotFailure:
    """``exc`` as a snapshot asked on a stream is answered with it: what ``abort`` would send."""
    code = next(c for kind, c in STATUS_CODES if isinstance(exc, kind))
    return pb.SnapshotFailure(code=code.value[0], reason=exc.reason, message=exc.message[:2048],
                              metadata=exc.metadata)  # fmt: skip


class RelayService(pb_grpc.RelayServiceServicer):
    """``snapshot``: the workspace service's snapshot (``RelayWorkspaceService.take_snapshot``), for
    those asked on an Attach stream (None: a relay without stores, which says it takes none)."""

    def __init__(self, agents: Agents, snapshot: Snapshotter | None = None) -> None:
        self._agents = agents
        self._snapshot = snapshot

    def _message(self, agent: RelayAgent) -> pb.Agent:
        generation = self._agents.generations.highest(agent.session_id)
        return agent_message(agent, generation, self._snapshot is not None)

    async def Spawn(self, request: pb.SpawnRequest, context: grpc.aio.ServicerContext[Any, Any]) -> pb.SpawnResponse:
        try:
            _session(request.session_id, request.generation)
            spec = await asyncio.to_thread(spec_of, request.spec)
            agent = await self._agents.spawn(request.session_id, request.generation, spec)
        except errors.RcoderError as exc:
            await abort(context, exc)
        return pb.SpawnResponse(agent=self._message(agent))

    async def Signal(self, request: pb.SignalRequest, context: grpc.aio.ServicerContext[Any, Any]) -> pb.SignalResponse:
        try:
            if request.signal not in SIGNALS:
                raise errors.InvalidArgument("signal", f"{request.signal} is not a signal of this host")
            _generation(request.generation)
            agent = self._agents.signal(request.agent_id, request.generation, request.signal)
        except errors.RcoderError as exc:
            await abort(context, exc)
        return pb.SignalResponse(agent=self._message(agent))

    async def Status(self, request: pb.StatusRequest, context: grpc.aio.ServicerContext[Any, Any]) -> pb.StatusResponse:
        try:
            agent = self._agents.get(request.agent_id)
        except errors.RcoderError as exc:
            await abort(context, exc)
        return pb.StatusResponse(agent=self._message(agent))

    async def ListAgents(
        self, request: pb.ListAgentsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ListAgentsResponse:
        return pb.ListAgentsResponse(agents=[self._message(a) for a in self._agents.all(request.session_id)])

    async def Attach(
        self, requests: AsyncIterator[pb.AttachRequest], context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[pb.AttachResponse]:
        # Headers first, before a byte is read: a client writes its first message only once they
        # came, so no write of its races a refusal (grpc's client would report its own INTERNAL in
        # place of the refusal); the secret was checked before this (SecretCheck)
        await context.send_initial_metadata(())
        try:
            first = await anext(requests, None)
            if first is None or first.WhichOneof("message") != "open":
                raise errors.InvalidArgument("open", "an Attach stream's first message is its AttachOpen")
            opening = first.open
            _generation(opening.generation)
            agent, attachment = self._agents.attach(opening.agent_id, opening.generation, opening.from_seq)
        except errors.RcoderError as exc:
            await abort(context, exc)
        log.info("relay_attached", agent_id=agent.agent_id, generation=opening.generation, from_seq=opening.from_seq)
        answers: deque[pb.SnapshotTaken] = deque()  # the snapshots asked on this stream, answered in order
        reader = asyncio.get_running_loop().create_task(self._read_requests(requests, agent, attachment, answers))
        reader.add_done_callback(lambda _: attachment.wake.set())
        try:
            yield pb.AttachResponse(ready=self._message(agent))
            async for response in self._send(agent, attachment, max(opening.from_seq, 1), reader, answers):
                yield response
        except errors.RcoderError as exc:
            await abort(context, exc)
        finally:
            agent.detach(attachment)
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):  # said by _send already
                await reader

    async def _send(
        self,
        agent: RelayAgent,
        attachment: Attachment,
        next_seq: int,
        reader: asyncio.Task[None],
        answers: deque[pb.SnapshotTaken],
    ) -> AsyncIterator[pb.AttachResponse]:
        """Every frame from ``next_seq`` on as it comes, a lag where frames went, then the exit;
        each snapshot's answer as soon as it is known (before the frames the agent wrote after it)."""
        while True:
            attachment.wake.clear()
            if attachment.ended is not None:
                raise attachment.ended
            while answers:
                yield pb.AttachResponse(snapshot=answers.popleft())
            if reader.done() and not reader.cancelled() and (failed := reader.exception()) is not None:
                if isinstance(failed, errors.RcoderError):
                    raise failed
                # the client's half broke under it (the call ended): nobody reads what would be sent
                log.info("relay_attach_reader_ended", agent_id=agent.agent_id, error=repr(failed))
                return
            read = agent.frames.read(next_seq, _BATCH)
            if read.lagged:
                yield pb.AttachResponse(lagged=pb.AttachLagged(dropped_frames=read.lagged, next_seq=read.next_seq))
            next_seq = read.next_seq
            for seq, data in read.frames:
                yield pb.AttachResponse(frame=pb.Frame(seq=seq, data=data))
                next_seq = seq + 1
            if read.frames or read.lagged:
                continue
            if agent.finished:
                tail = (agent.process.stderr_tail() + agent.end_note)[-2000:]
                code = agent.exit_code if agent.exit_code is not None else 0
                yield pb.AttachResponse(exit=pb.AgentExit(exit_code=code, last_seq=agent.frames.last_seq,
                                                          stderr_tail=tail))  # fmt: skip
                # the stream ends once the client has closed its half (its last acknowledgement
                # written), bounded: ended first, a write of the client's in flight would fail, and
                # grpc's client reports that as INTERNAL in place of this call's end
                with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError, Exception):
                    await asyncio.wait_for(asyncio.shield(reader), _HALF_CLOSE_WAIT)
                return
            await attachment.wake.wait()

    async def _read_requests(
        self,
        requests: AsyncIterator[pb.AttachRequest],
        agent: RelayAgent,
        attachment: Attachment,
        answers: deque[pb.SnapshotTaken],
    ) -> None:
        """The client's stdin, acknowledgements, snapshots and end of stdin, in order; its end of
        the stream ends nothing. While a snapshot is taken, the next message is read (and handled
        after it): the prompt's frame, sent right behind the ask, is then read by the time the
        snapshot is taken, not asked of grpc only then, one hop of grpc's thread and the loop less
        on the prompt's way (docs/relay.md#the-before-snapshot-on-the-stream). One message ahead at
        most: what follows it waits in grpc's flow control, as it does behind a stdin write."""
        ahead: asyncio.Task[pb.AttachRequest | None] | None = None
        try:
            while True:
                if ahead is not None:
                    reading, ahead = ahead, None
                    request = await reading  # read already, unless the snapshot was the quicker
                else:
                    request = await anext(requests, None)
                if request is None:
                    return
                if request.WhichOneof("message") == "snapshot":
                    ahead = asyncio.get_running_loop().create_task(_next_of(requests))
                    await asyncio.sleep(0)  # its read asked of grpc now: a small project's walk never yields
                await self._took_request(request, agent, attachment, answers)
        finally:
            if ahead is not None:  # the stream ended under the snapshot (taken by another, cut): unread
                ahead.cancel()
                ahead.add_done_callback(_retrieved)

    async def _took_request(
        self, request: pb.AttachRequest, agent: RelayAgent, attachment: Attachment, answers: deque[pb.SnapshotTaken]
    ) -> None:
        kind = request.WhichOneof("message")
        if kind == "snapshot":
            answers.append(await self._before_stdin(agent, attachment, request.snapshot))
            attachment.wake.set()
        elif kind == "stdin":
            frame = request.stdin
            if frame.HasField("snapshot_before"):  # as a snapshot message right before the frame
                ask = frame.snapshot_before
                ask.before_seq = frame.seq  # before this frame, whatever else it says
                answers.append(await self._before_stdin(agent, attachment, ask))
                attachment.wake.set()
            await agent.write_stdin(attachment, frame.seq, frame.data)
        elif kind == "ack":
            if attachment.ended is not None:
                raise attachment.ended
            agent.frames.ack(request.ack)
        elif kind == "close_stdin":
            await agent.close_stdin(attachment)
        else:
            raise errors.InvalidArgument("message", f"an Attach stream is opened once; {kind or 'nothing'} sent")

    async def _before_stdin(self, agent: RelayAgent, attachment: Attachment, ask: pb.SnapshotAsk) -> pb.SnapshotTaken:
        """A snapshot asked on the stream, taken before the stdin frame it names (what follows on the
        stream is handled after it); a failure is its answer, never the stream's
        end. The stream taken by another (``ended``) ends as at a stdin frame."""
        snapshot = self._snapshot
        try:
            if snapshot is None:
                raise errors.Unimplemented("this relay keeps no checkpoint stores: ask with a Snapshot call")
            commit = await agent.before_stdin(attachment, ask.before_seq, lambda: snapshot(ask.request))
        except errors.RcoderError as exc:
            if exc is attachment.ended:
                raise
            log.info("relay_snapshot_refused", agent_id=agent.agent_id, reason=exc.reason, message=exc.message[:300])
            return pb.SnapshotTaken(id=ask.id, failure=failure_of(exc))
        except Exception as exc:  # a bug: answered, so that the stream (asked again after a drop) goes on
            log.exception("relay_snapshot_failed_unexpectedly", agent_id=agent.agent_id)
            failed = errors.CheckpointError("snapshot", f"the relay failed: {type(exc).__name__}: {exc}")
            return pb.SnapshotTaken(id=ask.id, failure=failure_of(failed))
        return pb.SnapshotTaken(id=ask.id, commit=commit)


async def _next_of(requests: AsyncIterator[pb.AttachRequest]) -> pb.AttachRequest | None:
    return await anext(requests, None)


def _retrieved(task: asyncio.Task[Any]) -> None:
    """A read left behind: its error (the stream broke meanwhile) is the stream's, said elsewhere."""
    if not task.cancelled():
        task.exception()


def _generation(generation: int) -> None:
    if generation < 1:
        raise errors.InvalidArgument("generation", "the caller's lease generation of the session, 1 or more")


def _session(session_id: str, generation: int) -> None:
    if not session_id:
        raise errors.InvalidArgument("session_id", "name the session the agent serves")
    _generation(generation)


def spec_of(spec: pb.StartSpec) -> AgentSpec:
    """The agent ``spec`` describes, checked (it touches the file system: call it off the loop)."""
    for name in ("image", "secret_ref"):
        if getattr(spec, name):
            raise errors.Unimplemented(f"spec.{name}: a container placement is not built yet; this relay runs agents "
                                       "on its own host")  # fmt: skip
    if spec.volumes:
        raise errors.Unimplemented("spec.volumes: a container placement is not built yet")
    if not spec.command:
        raise errors.InvalidArgument("spec.command", "the agent's argv: its program and arguments")
    program = spec.command[0]
    if not os.path.isabs(program) or not os.access(program, os.X_OK) or not os.path.isfile(program):
        raise errors.InvalidArgument("spec.command", f"{program!r} is not an executable file named by absolute path")
    if not os.path.isabs(spec.cwd) or not os.path.isdir(spec.cwd):
        raise errors.InvalidArgument("spec.cwd", f"{spec.cwd!r} is not an existing folder named by absolute path")
    limits = None
    if spec.HasField("limits"):
        given = spec.limits
        if given.memory_max <= 0 or given.pids_max <= 0 or given.cpu_max < 0:
            raise errors.InvalidArgument("spec.limits", "memory_max and pids_max above 0, cpu_max 0 (none) or above")
        limits = Values(given.memory_max, given.pids_max, given.cpu_max or None)
    grants = None
    if spec.HasField("confinement"):
        given_grants = spec.confinement
        for path in (*given_grants.read_paths, *given_grants.write_paths):
            if not os.path.isabs(path):
                raise errors.InvalidArgument("spec.confinement", f"{path!r}: grants name absolute paths")
        ports = (*given_grants.connect_ports, *given_grants.bind_ports)
        if any(not 0 < port < 65536 for port in ports):
            raise errors.InvalidArgument("spec.confinement", "ports are 1 to 65535")
        connect, bind = (tuple(sorted(set(ports))) for ports in (given_grants.connect_ports, given_grants.bind_ports))
        grants = Grants(tuple(given_grants.read_paths), tuple(given_grants.write_paths), connect, bind)
    user = (spec.user.uid, spec.user.gid) if spec.HasField("user") else None
    name = spec.name or Path(program).name
    home = home_of(spec.home) if spec.HasField("home") else None
    return AgentSpec(name, tuple(spec.command), dict(spec.env), spec.cwd, limits, grants, user, home)


def home_of(home: pb.AgentHome) -> AgentHome:
    """The home ``home`` describes, checked: an absolute path, and every path in it relative and
    beneath it; ``InvalidArgument`` naming the field that is not."""
    if not os.path.isabs(home.path) or ".." in Path(home.path).parts:
        raise errors.InvalidArgument("spec.home.path", f"{home.path!r}: the home, an absolute path")
    files = {_beneath("spec.home.files.path", file.path): file.text for file in home.files}
    folders = tuple(_beneath("spec.home.folders", folder) for folder in home.folders)
    if not home.tmpdir or "/" in home.tmpdir or home.tmpdir in (".", ".."):
        raise errors.InvalidArgument("spec.home.tmpdir", f"{home.tmpdir!r}: the agent's TMPDIR's name in the "
                                     "home's tmp/, one path component")  # fmt: skip
    return AgentHome(Path(os.path.normpath(home.path)), files, folders, home.tmpdir)


def _beneath(field: str, path: str) -> str:
    """``path``, checked to be relative and to stay beneath the home."""
    parts = Path(path).parts
    if not parts or os.path.isabs(path) or ".." in parts or parts == (".",):
        raise errors.InvalidArgument(field, f"{path!r}: a path relative to the home, beneath it")
    return os.path.normpath(path)

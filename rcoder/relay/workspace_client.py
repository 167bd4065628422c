"""The daemon's side of a relayed project's files (docs/relay.md#files-and-checkpoints): the calls
of ``rcoder.session.files.project_files.Workspace`` made to the project's relay
(``rcoder.relay.workspace_service``) instead of this host's disk.

Which projects are relayed (``RelayedWorkspaces.files``): one whose relay lives (held by this
daemon, or found alive in its folder under ``<data_dir>/relays``: a turn of a relay-placed profile
started it), and every project when the default profile's placement is ``relay`` (its relay is then
started for the call) or ``container`` (the relay in the project's container of that profile,
``rcoder.relay.container_host.ContainerHostRelays``: docs/relay.md#a-container-projects-files).
A relay's refusal comes back as the error it was on the relay's side (its
class by the status code, its reason, metadata and message as sent), so the daemon's caller sees
what it sees for a local project; a relay that cannot be reached is ``RelayUnavailable``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from datetime import UTC
from pathlib import Path
from typing import Any, Protocol, TypeVar, runtime_checkable

import grpc
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from rcoder import errors
from rcoder.agent.files.blocking import Cursor, Entry, EntryKind, Listing
from rcoder.agent.files.disk import Chunk, FileHead, WriteHead, Written
from rcoder.domain import FileChange
from rcoder.logs import get_logger
from rcoder.relay.v1 import relay_pb2 as relay_pb
from rcoder.relay.v1 import workspace_pb2 as pb
from rcoder.relay.v1 import workspace_pb2_grpc as pb_grpc
from rcoder.relay.workspace_changes import change_message, change_of
from rcoder.store.checkpoint_repo import GcPass, RefTime, ref_time
from rcoder.store.git_process import GIT_TIMEOUT, GitResult
from rcoder.store.unstored import Bounds

log = get_logger("rcoder.relay.workspace_client")
CALL_TIMEOUT = 60.0  # a unary call's bound (a listing's page, a delete); streams are bounded by their use
GIT_CALL_TIMEOUT = GIT_TIMEOUT + 30.0  # a checkpoint step: git's own bound in the relay, and the way there
T = TypeVar("T")
Metadata = tuple[tuple[str, str], ...]

# each status code a relay sends, as the error class the daemon's own table gives that code
# (rcoder.api.service.STATUS_CODES); the reason picks among those one code holds
_CLASSES: dict[grpc.StatusCode, type[errors.RcoderError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: errors.InvalidArgument,
    grpc.StatusCode.NOT_FOUND: errors.NotFound,
    grpc.StatusCode.PERMISSION_DENIED: errors.PermissionDenied,
    grpc.StatusCode.OUT_OF_RANGE: errors.OutOfRange,
    grpc.StatusCode.RESOURCE_EXHAUSTED: errors.ResourceExhausted,
    grpc.StatusCode.FAILED_PRECONDITION: errors.FailedPrecondition,
}
_BY_REASON: dict[str, type[errors.RcoderError]] = {
    "SHA256_MISMATCH": errors.Sha256Mismatch,
    "NO_CHECKPOINT": errors.NoCheckpoint,
    "CHECKPOINT_FAILED": errors.CheckpointError,
}


@runtime_checkable
class SnapshotsOnStream(Protocol):
    """A relayed agent whose relay takes a snapshot asked on its Attach stream
    (``rcoder.relay.attached.AttachedAgent.snapshot_before_stdin``; a container's agent forwards it)."""

    def snapshot_before_stdin(
        self, metadata: Metadata, request: pb.SnapshotRequest
    ) -> asyncio.Future[relay_pb.SnapshotTaken] | None: ...


class Relays(Protocol):
    """What this needs of the relays that hold the projects' files and stores: the host's
    (``rcoder.relay.host.HostRelays``) or the containers' (``rcoder.relay.container_host.ContainerHostRelays``)."""

    async def channel_of(self, project: str, start: bool) -> tuple[grpc.aio.Channel, Metadata] | None: ...

    async def live_projects(self) -> list[str]: ...


def error_of(exc: grpc.aio.AioRpcError, project_id: str) -> errors.RcoderError:
    """The relay's refusal as the error it was there: the class its code (and reason) names, with
    the reason, metadata and message it sent. A status without rcoder's ErrorInfo (the relay is
    gone, or refused this daemon's secret) is ``RelayUnavailable``."""
    return _error(exc.code(), exc.details() or "", _info(exc), project_id)


def failure_error(failure: relay_pb.SnapshotFailure, project_id: str) -> errors.RcoderError:
    """A snapshot asked on an Attach stream that failed, as the error its Snapshot call would have raised."""
    code = next((c for c in grpc.StatusCode if c.value[0] == failure.code), grpc.StatusCode.UNKNOWN)
    info = error_details_pb2.ErrorInfo(reason=failure.reason, metadata=dict(failure.metadata))
    return _error(code, failure.message, info, project_id)


def _error(
    code: grpc.StatusCode, details: str, info: error_details_pb2.ErrorInfo | None, project_id: str
) -> errors.RcoderError:
    if info is None or code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.UNIMPLEMENTED):
        return errors.RelayUnavailable(
            f"project {project_id!r} is relayed and its relay did not answer ({code.name}: {details})",
            project_id=project_id,
        )
    kind = _BY_REASON.get(info.reason) or _CLASSES.get(code, errors.RcoderError)
    error = kind.__new__(kind)
    errors.RcoderError.__init__(error, details, **dict(info.metadata))
    error.reason = info.reason
    if isinstance(error, errors.CheckpointError):
        error.step = info.metadata.get("step", "")
    if isinstance(error, errors.InvalidArgument):
        error.field = info.metadata.get("field", "")
    return error


def _info(exc: grpc.aio.AioRpcError) -> error_details_pb2.ErrorInfo | None:
    try:
        status = rpc_status.from_call(exc)
    except (ValueError, DecodeError):
        return None
    for detail in status.details if status is not None else ():
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info):
            return info
    return None


def entry_of(message: pb.Entry) -> Entry:
    kind: EntryKind = message.kind if message.kind in ("file", "dir", "symlink") else "other"  # type: ignore[assignment]
    mtime = message.mtime.ToDatetime(tzinfo=UTC)
    return Entry(tuple(message.path), kind, message.size, message.mode, mtime, message.link_target)


class WorkspaceClient:
    """One project root's files through its relay: ``Workspace``'s calls, with its answers."""

    def __init__(self, channel: grpc.aio.Channel, metadata: Metadata, workspace_root: Path, max_bytes: int) -> None:
        self._stub = pb_grpc.RelayWorkspaceServiceStub(channel)
        self._metadata = metadata
        self._root = str(workspace_root)
        self._max_bytes = max_bytes

    def _project(self, project_id: str, caller: str) -> pb.Project:
        return pb.Project(workspace_root=self._root, project_id=project_id, max_file_bytes=self._max_bytes,
                          caller=caller)  # fmt: skip

    async def list(
        self,
        project_id: str,
        parts: tuple[str, ...],
        recursive: bool,
        limit: int,
        cursor: Cursor | None,
        caller: str = "",
    ) -> Listing:
        request = pb.ListFilesRequest(project=self._project(project_id, caller), path=list(parts),
                                      recursive=recursive, limit=limit)  # fmt: skip
        if cursor is not None:
            request.cursor.CopyFrom(pb.Cursor(positions=list(cursor[0]), entered=list(cursor[1])))
        try:
            answer = await self._stub.ListFiles(request, metadata=self._metadata, timeout=CALL_TIMEOUT)
        except grpc.aio.AioRpcError as exc:
            raise error_of(exc, project_id) from None
        following = (tuple(answer.next.positions), tuple(answer.next.entered)) if answer.HasField("next") else None
        return Listing([entry_of(e) for e in answer.entries], following, answer.unlisted)

    async def stat(self, project_id: str, parts: tuple[str, ...], caller: str = "") -> Entry:
        request = pb.StatFileRequest(project=self._project(project_id, caller), path=list(parts))
        try:
            answer = await self._stub.StatFile(request, metadata=self._metadata, timeout=CALL_TIMEOUT)
        except grpc.aio.AioRpcError as exc:
            raise error_of(exc, project_id) from None
        return entry_of(answer.entry)

    async def read(
        self, project_id: str, parts: tuple[str, ...], offset: int, limit: int, caller: str = ""
    ) -> AsyncIterator[Chunk]:
        request = pb.ReadFileRequest(project=self._project(project_id, caller), path=list(parts), offset=offset,
                                     limit=limit)  # fmt: skip
        call = self._stub.ReadFile(request, metadata=self._metadata)
        try:
            async for message in call:
                head = None
                if message.has_head:
                    mtime = message.mtime.ToDatetime(tzinfo=UTC)
                    head = FileHead(message.size, message.mode, mtime, message.sha256)
                yield Chunk(message.data, message.offset, head)
        except grpc.aio.AioRpcError as exc:
            raise error_of(exc, project_id) from None
        finally:
            call.cancel()  # a reader that stopped early ends the relay's stream too

    async def write(
        self,
        head: WriteHead,
        chunks: AsyncIterator[bytes],
        caller: str = "",
        check: Callable[[], Awaitable[None]] | None = None,
    ) -> Written:
        """The file written by the relay from ``chunks``; ``check`` runs once every chunk is sent,
        before the relay is told the stream ended (it renames then): raising there cancels the
        call, and the relay removes what it wrote."""
        ours: list[BaseException] = []  # what failed on this side (the caller's stream, ``check``)

        async def requests() -> AsyncIterator[pb.WriteFileRequest]:
            try:
                first = pb.WriteHead(project=self._project(head.project_id, caller), path=list(head.parts),
                                     mode=head.mode, if_sha256=head.if_sha256)  # fmt: skip
                yield pb.WriteFileRequest(head=first)
                async for data in chunks:
                    yield pb.WriteFileRequest(data=data)
                if check is not None:
                    await check()
            except BaseException as exc:
                ours.append(exc)  # grpc cancels the call on it; raised below in place of the cancel
                raise

        call = self._stub.WriteFile(requests(), metadata=self._metadata)
        try:
            answer = await call
        except grpc.aio.AioRpcError as exc:
            if ours:
                raise ours[0] from None
            raise error_of(exc, head.project_id) from None
        except BaseException:
            if ours:
                raise ours[0] from None
            call.cancel()
            raise
        if ours:  # the relay answered before the stream's failure reached it: not taken as written
            raise ours[0]
        return Written(answer.sha256, answer.size, answer.mode)

    async def delete(self, project_id: str, parts: tuple[str, ...], recursive: bool, caller: str = "") -> str:
        request = pb.DeleteFileRequest(project=self._project(project_id, caller), path=list(parts),
                                       recursive=recursive)  # fmt: skip
        try:
            answer = await self._stub.DeleteFile(request, metadata=self._metadata, timeout=CALL_TIMEOUT)
        except grpc.aio.AioRpcError as exc:
            raise error_of(exc, project_id) from None
        return str(answer.kind)


class RelayedWorkspaces:
    """Which projects' files are their relay's, and a client of each (``Relayed`` of
    ``rcoder.session.files.project_files``). ``by_default``: the default profile's placement is
    ``relay`` or ``container``, so every project is, its relay started for the call when none lives."""

    def __init__(self, relays: Relays, workspace_root: Path, max_bytes: int, by_default: bool) -> None:
        self._relays = relays
        self._root = workspace_root
        self._max_bytes = max_bytes
        self._by_default = by_default

    async def files(self, project_id: str) -> WorkspaceClient | None:
        try:
            found = await self._relays.channel_of(project_id, self._by_default)
        except errors.AgentError as exc:  # its relay (or its relay's container) could not start
            raise errors.RelayUnavailable(exc.summary, project_id=project_id) from exc
        if found is None:
            return None
        channel, metadata = found
        return WorkspaceClient(channel, metadata, self._root, self._max_bytes)

    async def live(self) -> list[str]:
        """The projects whose relays live now (their stores are swept while they do)."""
        return await self._relays.live_projects()

    async def checkpoints(self, project_id: str, work_tree: str, bounds: Bounds) -> CheckpointClient:
        """The project's checkpoint store in its relay (started when none lives): a relayed
        project's snapshots are taken where its files are, whatever asks."""
        try:
            found = await self._relays.channel_of(project_id, True)
        except errors.AgentError as exc:
            raise errors.RelayUnavailable(exc.summary, project_id=project_id) from exc
        if found is None:  # a container's: the project has no folder to bind yet
            raise errors.RelayUnavailable(f"project {project_id!r} has no folder for its relay to hold yet",
                                          project_id=project_id)  # fmt: skip
        channel, metadata = found
        project = pb.Project(workspace_root=str(self._root), project_id=project_id)
        store = pb.CheckpointStore(project=project, work_tree=work_tree or str(self._root / project_id),
                                   max_file_bytes=bounds.max_file_bytes, max_snapshot_bytes=bounds.max_snapshot_bytes,
                                   max_store_bytes=bounds.max_store_bytes)  # fmt: skip
        return CheckpointClient(channel, metadata, store)


class CheckpointClient:
    """A relayed project's checkpoint store, in its relay (``rcoder.relay.workspace_service``):
    the steps of ``rcoder.store.checkpoint_repo.CheckpointRepo`` the daemon's checkpoints take,
    each a call (``rcoder.session.turns.checkpoints.Repo``). ``work_tree`` is the project's
    folder on the relay's side, never opened here."""

    def __init__(self, channel: grpc.aio.Channel, metadata: Metadata, store: pb.CheckpointStore) -> None:
        self._stub = pb_grpc.RelayWorkspaceServiceStub(channel)
        self._metadata = metadata
        self._store = store
        self.work_tree = Path(store.work_tree)
        self._patterns: tuple[str, ...] | None = None
        # the commits whose refs this client wrote or saw written, and has not deleted since: the
        # relay's store has one writer, this daemon (its retention is not built), so ``kept`` can
        # answer them without a call; any other is asked (``resolve``)
        self._kept: set[str] = set()

    @property
    def project_id(self) -> str:
        return self._store.project.project_id

    @property
    def patterns(self) -> tuple[str, ...] | None:
        """The exclude patterns of the last snapshot taken through this client (None: none yet)."""
        return self._patterns

    def kept(self, commit: str) -> bool:
        """Whether ``commit``'s ref is known written (``_kept``); False sends the caller to ``resolve``."""
        return commit in self._kept

    async def _call(self, method: Callable[..., Awaitable[T]], request: object, timeout: float = GIT_CALL_TIMEOUT) -> T:
        try:
            return await method(request, metadata=self._metadata, timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            raise error_of(exc, self.project_id) from None

    async def snapshot(self, patterns: Sequence[str], message: str, capped: bool = True) -> str:
        request = pb.SnapshotRequest(store=self._store, patterns=list(patterns), message=message, capped=capped)
        answer = await self._call(self._stub.Snapshot, request)
        self._patterns = tuple(patterns)
        self._kept.add(answer.commit)  # its ref is written before the answer
        return str(answer.commit)

    def snapshot_before_stdin(
        self, agent: object, patterns: Sequence[str], message: str
    ) -> Coroutine[Any, Any, str] | None:
        """The snapshot taken by ``agent``'s relay before the next stdin frame reaches the agent,
        asked on its Attach stream (docs/relay.md#the-before-snapshot-on-the-stream): the relay
        holds that frame until the snapshot is taken, so the caller need not wait before writing it.
        What awaits its commit (raising as ``snapshot`` does), or None when ``agent`` cannot be
        asked so (a local agent, one of another relay than this store's, a relay that does not
        take them): then ``snapshot``."""
        if not isinstance(agent, SnapshotsOnStream):
            return None
        request = pb.SnapshotRequest(store=self._store, patterns=list(patterns), message=message, capped=True)
        answer = agent.snapshot_before_stdin(self._metadata, request)
        return None if answer is None else self._taken(answer, tuple(patterns))

    async def _taken(self, answer: asyncio.Future[relay_pb.SnapshotTaken], patterns: tuple[str, ...]) -> str:
        try:
            async with asyncio.timeout(GIT_CALL_TIMEOUT):
                taken = await answer
        except (TimeoutError, ConnectionError) as exc:
            why = str(exc) or f"no answer within {GIT_CALL_TIMEOUT:g} s"
            raise errors.RelayUnavailable(f"project {self.project_id!r} is relayed and its relay did not answer the "
                                          f"snapshot asked on its agent's stream ({why})",
                                          project_id=self.project_id) from None  # fmt: skip
        if taken.HasField("failure"):
            raise failure_error(taken.failure, self.project_id)
        self._patterns = patterns
        self._kept.add(taken.commit)  # its ref is written before the answer
        return str(taken.commit)

    async def keep(self, commit: str) -> None:
        await self._call(self._stub.KeepCommit, pb.KeepCommitRequest(store=self._store, commit=commit))
        self._kept.add(commit)

    async def keep_existing(self, commit: str) -> None:
        await self._call(self._stub.KeepCommit, pb.KeepCommitRequest(store=self._store, commit=commit, existing=True))
        self._kept.add(commit)

    async def resolve(self, ref: str) -> str | None:
        answer = await self._call(self._stub.ResolveCommit, pb.ResolveCommitRequest(store=self._store, ref=ref))
        return str(answer.commit) or None

    async def refs(self, prefix: str) -> dict[str, RefTime]:
        answer = await self._call(self._stub.ListRefs, pb.ListRefsRequest(store=self._store, prefix=prefix))
        return {name: ref_time(seconds, answer.taken_ns.get(name, 0)) for name, seconds in answer.refs.items()}

    async def delete_refs(self, names: Sequence[str]) -> None:
        if names:
            self._kept.difference_update(
                name.rpartition("/")[2] for name in names
            )  # first: a failed delete may have done some
            await self._call(self._stub.DeleteRefs, pb.DeleteRefsRequest(store=self._store, names=list(names)))

    async def changes(
        self, before: str, after: str, path: str = "", listed_only: bool = True
    ) -> tuple[FileChange, ...]:
        if before == after:
            return ()
        request = pb.ListChangesRequest(store=self._store, before=before, after=after, path=path,
                                        listed_only=listed_only)  # fmt: skip
        answer = await self._call(self._stub.ListChanges, request)
        return tuple(change_of(c) for c in answer.changes)

    async def diff(self, before: str, after: str, path: str, limit: int) -> GitResult:
        request = pb.DiffRequest(store=self._store, before=before, after=after, path=path, limit=limit)
        answer = await self._call(self._stub.Diff, request)
        return GitResult(answer.diff, answer.truncated)

    async def restore(self, commit: str) -> list[FileChange]:
        answer = await self._call(self._stub.Restore, pb.RestoreRequest(store=self._store, commit=commit))
        return [change_of(c) for c in answer.not_restored]

    async def give_back(self, changes: Sequence[FileChange]) -> None:
        request = pb.GiveBackRequest(store=self._store, changes=[change_message(c) for c in changes])
        await self._call(self._stub.GiveBack, request)

    async def gc(self, bound: float) -> GcPass:
        request = pb.CollectGarbageRequest(store=self._store, bound_seconds=bound)
        answer = await self._call(self._stub.CollectGarbage, request, timeout=bound + GIT_CALL_TIMEOUT)
        return GcPass(answer.packs, answer.freed, answer.cut)

    async def store_bytes(self) -> int:
        answer = await self._call(self._stub.StoreSize, pb.StoreSizeRequest(store=self._store))
        return int(answer.bytes)

    async def remove_store(self) -> None:
        self._kept.clear()
        await self._call(self._stub.RemoveStore, pb.RemoveStoreRequest(store=self._store))

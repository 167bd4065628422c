"""The relay's second service, ``rcoder.relay.v1.RelayWorkspaceService``: a project's files and its
checkpoints, done where they are (docs/relay.md#files-and-checkpoints).

Each call is the daemon's own file work (``rcoder.agent.files.disk.ProjectDisk``: paths beneath the
project, sizes, whole files, compare-and-swap, symlink-proof), so a relayed project answers as a
local one does; errors go back as the gRPC status and ErrorInfo of ``rcoder.relay.service``'s
table, which the daemon's ``rcoder.relay.workspace_client`` turns into the same error types.
What needs the daemon's state (whether a turn runs in the project, the snapshots taken ahead)
stays the daemon's.

The checkpoints are the daemon's git store code (``rcoder.store.checkpoint_repo.CheckpointRepo``),
one store per project in the relay's state folder (``checkpoints/<project>.git``, its index in
``checkpoint-index/<project>``); the daemon keeps deciding what is snapshotted when, which refs
a run names and which go (``rcoder.session.turns.checkpoints``), and asks the relay for each git
step. A store's object is kept while the relay lives: a restore needs the snapshot taken just
before it in the same one.
"""

from __future__ import annotations

import asyncio
import hashlib
import shutil
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import timestamp_pb2

from rcoder import errors
from rcoder.agent.files.beneath import path_parts
from rcoder.agent.files.blocking import Cursor, Entry
from rcoder.agent.files.disk import ABSENT, CHUNK_BYTES, ProjectDisk, WriteHead
from rcoder.agent.files.ownership import give_back
from rcoder.agent.files.threads import FileThreads
from rcoder.agent.files.upload_journal import UploadJournal
from rcoder.logs import get_logger
from rcoder.relay.service import abort
from rcoder.relay.v1 import workspace_pb2 as pb
from rcoder.relay.v1 import workspace_pb2_grpc as pb_grpc
from rcoder.relay.workspace_changes import change_message, change_of
from rcoder.store.checkpoint_repo import CheckpointRepo, store_bytes
from rcoder.store.git_jail import GitJail
from rcoder.store.git_process import ChildGuard
from rcoder.store.unstored import Bounds

log = get_logger("rcoder.relay.workspace")
UPLOADS_FOLDER = "uploads"  # in the relay's state folder: the writes under way
STORES_FOLDER = "checkpoints"  # in the relay's state folder: a bare git store per project
INDEX_FOLDER = "checkpoint-index"  # in the relay's state folder: each store's index, a folder each
MAX_PAGE = 1000


class Workspaces:
    """The relay's disks, one per workspace root and file bound a daemon names, sharing one set of
    file threads (fair between projects and callers). Each root has its journal of the writes under
    way (``<uploads>/<a hash of the root>``), swept at the root's first call: what a killed relay's
    writes left there is removed before this relay writes anything (``ProjectDisk.sweep_uploads``).
    Counts each call by its name (``calls``)."""

    def __init__(self, threads: FileThreads, uploads: Path) -> None:
        self._threads = threads
        self._uploads = uploads
        self._disks: dict[tuple[str, int], ProjectDisk] = {}
        self._swept: dict[str, asyncio.Task[int]] = {}  # per root: its journal's sweep, once
        self.calls: dict[str, int] = {}

    def named(self, project: pb.Project, call: str, log_later: bool = False) -> str:
        """``project``'s id, its root and id checked; the call counted and logged (``log_later``: on
        the loop's next pass, after the work that follows this returns or first waits)."""
        if not project.workspace_root or not Path(project.workspace_root).is_absolute():
            raise errors.InvalidArgument("project.workspace_root", "the absolute folder that holds the projects")
        if not project.project_id or project.project_id in (".", "..") or "/" in project.project_id:
            raise errors.InvalidArgument("project.project_id", "a project's folder name")
        self.calls[call] = calls = self.calls.get(call, 0) + 1
        if log_later:
            asyncio.get_running_loop().call_soon(_log_call, call, project.project_id, calls)
        else:
            _log_call(call, project.project_id, calls)
        return project.project_id

    async def disk(self, project: pb.Project, call: str) -> tuple[ProjectDisk, str, str]:
        """The disk of ``project``'s root, its project id and its caller; the call counted, and the
        root's journal swept first when this relay has not yet."""
        project_id = self.named(project, call)
        if project.max_file_bytes <= 0:
            raise errors.InvalidArgument("project.max_file_bytes", "the largest file, in bytes, above 0")
        root = project.workspace_root
        key = (root, project.max_file_bytes)
        disk = self._disks.get(key)
        if disk is None:
            journal = UploadJournal(self._uploads / hashlib.sha256(root.encode()).hexdigest()[:16])
            disk = ProjectDisk(Path(root), project.max_file_bytes, journal, self._threads)
            self._disks[key] = disk
        sweep = self._swept.get(root)
        if sweep is None:
            sweep = self._swept[root] = asyncio.get_running_loop().create_task(self._sweep(root, disk))
        await asyncio.shield(sweep)  # one sweep, whichever call came first; a cancelled call leaves it running
        return disk, project_id, project.caller

    @staticmethod
    async def _sweep(root: str, disk: ProjectDisk) -> int:
        removed = await asyncio.to_thread(disk.sweep_uploads)
        if removed:
            log.warning("relay_uploads_swept", workspace_root=root, removed=removed)
        return removed

    def close(self) -> None:
        self._threads.close()


def _log_call(call: str, project_id: str, calls: int) -> None:
    log.info("relay_workspace_call", call=call, project_id=project_id, calls=calls)


class CheckpointStores:
    """The projects' checkpoint stores in the relay's state folder, one ``CheckpointRepo`` each,
    kept while the relay lives (its last snapshot is what the next one and a restore build on);
    git runs as the relay's children, marked and ended whole (``guard``), each confined by the
    kernel to what its command needs (``jail``; None where the kernel has no Landlock)."""

    def __init__(self, state_dir: Path, guard: ChildGuard, jail: GitJail | None) -> None:
        self._folder = state_dir
        self._guard = guard
        self._jail = jail  # each git confined by the kernel, as the daemon's (docs/checkpoints.md#confinement)
        self._repos: dict[str, CheckpointRepo] = {}

    def repo(
        self, store: pb.CheckpointStore, call: str, workspaces: Workspaces, log_later: bool = False
    ) -> CheckpointRepo:
        project_id = workspaces.named(store.project, call, log_later)
        if not store.work_tree or not Path(store.work_tree).is_absolute():
            raise errors.InvalidArgument("store.work_tree", "the absolute folder snapshotted (the session's cwd)")
        work_tree = Path(store.work_tree)
        given = (store.max_file_bytes, store.max_snapshot_bytes, store.max_store_bytes)
        bounds = Bounds(*given) if all(v > 0 for v in given) else Bounds()
        repo = self._repos.get(project_id)
        if repo is None or repo.work_tree != work_tree.absolute() or repo.bounds != bounds:
            git_dir = self._folder / STORES_FOLDER / f"{project_id}.git"
            index = self._folder / INDEX_FOLDER / project_id / "index"
            repo = CheckpointRepo(git_dir, work_tree, index, self._guard, bounds=bounds, jail=self._jail)
            self._repos[project_id] = repo
        return repo

    def forget(self, project_id: str) -> CheckpointRepo | None:
        return self._repos.pop(project_id, None)


def parts_of(path: list[str] | Any) -> tuple[str, ...]:
    """A path sent as its names, checked by the daemon's own rules (``path_parts``)."""
    return path_parts("/".join(path), required=False) if path else ()


def entry_message(entry: Entry) -> pb.Entry:
    mtime = timestamp_pb2.Timestamp()
    mtime.FromDatetime(entry.mtime)
    return pb.Entry(path=list(entry.path), kind=entry.kind, size=entry.size, mode=entry.mode, mtime=mtime,
                    link_target=entry.link_target)  # fmt: skip


def mtime_of(stamp: timestamp_pb2.Timestamp) -> datetime:
    return stamp.ToDatetime(tzinfo=UTC)


class RelayWorkspaceService(pb_grpc.RelayWorkspaceServiceServicer):
    def __init__(self, workspaces: Workspaces, stores: CheckpointStores) -> None:
        self._workspaces = workspaces
        self._stores = stores

    def _repo(self, store: pb.CheckpointStore, call: str) -> CheckpointRepo:
        return self._stores.repo(store, call, self._workspaces)

    async def ListFiles(
        self, request: pb.ListFilesRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ListFilesResponse:
        try:
            disk, project_id, caller = await self._workspaces.disk(request.project, "ListFiles")
            if not 0 < request.limit <= MAX_PAGE:
                raise errors.InvalidArgument("limit", f"1 to {MAX_PAGE} entries")
            cursor: Cursor | None = None
            if request.HasField("cursor"):
                cursor = (tuple(request.cursor.positions), tuple(request.cursor.entered))
            parts = parts_of(request.path)
            listing = await disk.list(project_id, parts, request.recursive, request.limit, cursor, caller)
        except errors.RcoderError as exc:
            await abort(context, exc)
        answer = pb.ListFilesResponse(entries=[entry_message(e) for e in listing.entries], unlisted=listing.unlisted)
        if listing.next is not None:
            answer.next.CopyFrom(pb.Cursor(positions=list(listing.next[0]), entered=list(listing.next[1])))
        return answer

    async def StatFile(
        self, request: pb.StatFileRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.StatFileResponse:
        try:
            disk, project_id, caller = await self._workspaces.disk(request.project, "StatFile")
            entry = await disk.stat(project_id, parts_of(request.path), caller)
        except errors.RcoderError as exc:
            await abort(context, exc)
        return pb.StatFileResponse(entry=entry_message(entry))

    async def ReadFile(
        self, request: pb.ReadFileRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[pb.ReadFileResponse]:
        try:
            disk, project_id, caller = await self._workspaces.disk(request.project, "ReadFile")
            if request.offset < 0 or request.limit < 0:
                raise errors.InvalidArgument("offset", "offset and limit are 0 or more")
            async for chunk in disk.read(project_id, parts_of(request.path), request.offset, request.limit, caller):
                message = pb.ReadFileResponse(data=chunk.data, offset=chunk.offset)
                if chunk.head is not None:
                    message.has_head = True
                    message.size, message.mode, message.sha256 = chunk.head.size, chunk.head.mode, chunk.head.sha256
                    message.mtime.FromDatetime(chunk.head.mtime)
                yield message
        except errors.RcoderError as exc:
            await abort(context, exc)

    async def WriteFile(
        self, requests: AsyncIterator[pb.WriteFileRequest], context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.WriteFileResponse:
        try:
            first = await anext(requests, None)
            if first is None or first.WhichOneof("message") != "head":
                raise errors.InvalidArgument("head", "a WriteFile stream's first message is its WriteHead")
            given = first.head
            disk, project_id, caller = await self._workspaces.disk(given.project, "WriteFile")
            if given.mode > 0o777:
                raise errors.InvalidArgument("mode", f"{given.mode:#o}: permission bits only, at most 0777 (511)")
            expected = given.if_sha256.lower()
            if expected and expected != ABSENT and len(expected) != 64:
                raise errors.InvalidArgument("if_sha256", "64 hex digits (a SHA-256), or 'absent' for no file yet")
            parts = parts_of(given.path)
            if not parts:
                raise errors.InvalidArgument("path", "the file's path in the project")
            head = WriteHead(project_id, parts, given.mode, expected, True)
            written = await disk.write(head, _data(requests), caller)
        except errors.RcoderError as exc:
            await abort(context, exc)
        return pb.WriteFileResponse(sha256=written.sha256, size=written.size, mode=written.mode)

    async def DeleteFile(
        self, request: pb.DeleteFileRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.DeleteFileResponse:
        try:
            disk, project_id, caller = await self._workspaces.disk(request.project, "DeleteFile")
            parts = parts_of(request.path)
            if not parts:
                raise errors.InvalidArgument("path", "the entry's path in the project (the project's folder stays)")
            kind = await disk.delete(project_id, parts, request.recursive, caller)
        except errors.RcoderError as exc:
            await abort(context, exc)
        return pb.DeleteFileResponse(kind=kind)

    # ------------------------------------------------------------ checkpoints

    async def Snapshot(
        self, request: pb.SnapshotRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.SnapshotResponse:
        try:
            commit = await self.take_snapshot(request, "Snapshot")
        except errors.RcoderError as exc:
            await abort(context, exc)
        return pb.SnapshotResponse(commit=commit)

    async def take_snapshot(self, request: pb.SnapshotRequest, call: str = "SnapshotOnStream") -> str:
        """The snapshot ``request`` asks for: its commit, or one of rcoder's errors. Asked by the
        Snapshot call, and on an Attach stream before a stdin frame (``rcoder.relay.service``),
        logged under ``call``. One asked on a stream holds the prompt's frame until it is taken, so
        the log line (which costs as much as a small project's walk) is written on the loop's next
        pass: after it, or while a large project's walk runs in a thread
        (docs/benchmarks.md#the-first-chunks-path-in-the-relay)."""
        repo = self._stores.repo(request.store, call, self._workspaces, log_later=True)
        try:
            return await repo.snapshot(tuple(request.patterns), request.message, request.capped)
        except OSError as exc:
            raise errors.CheckpointError("snapshot", f"the project could not be read: {exc}") from exc

    async def ResolveCommit(
        self, request: pb.ResolveCommitRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ResolveCommitResponse:
        try:
            commit = await self._repo(request.store, "ResolveCommit").resolve(request.ref)
        except errors.RcoderError as exc:
            await abort(context, exc)
        return pb.ResolveCommitResponse(commit=commit or "")

    async def KeepCommit(
        self, request: pb.KeepCommitRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.KeepCommitResponse:
        try:
            repo = self._repo(request.store, "KeepCommit")
            await (repo.keep_existing(request.commit) if request.existing else repo.keep(request.commit))
        except errors.RcoderError as exc:
            await abort(context, exc)
        return pb.KeepCommitResponse()

    async def ListRefs(
        self, request: pb.ListRefsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ListRefsResponse:
        try:
            refs = await self._repo(request.store, "ListRefs").refs(request.prefix)
        except errors.RcoderError as exc:
            await abort(context, exc)
        return pb.ListRefsResponse(
            refs={name: when.seconds for name, when in refs.items()},
            taken_ns={name: when.taken_ns for name, when in refs.items()},
        )

    async def DeleteRefs(
        self, request: pb.DeleteRefsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.DeleteRefsResponse:
        try:
            await self._repo(request.store, "DeleteRefs").delete_refs(list(request.names))
        except errors.RcoderError as exc:
            await abort(context, exc)
        return pb.DeleteRefsResponse()

    async def ListChanges(
        self, request: pb.ListChangesRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ListChangesResponse:
        try:
            repo = self._repo(request.store, "ListChanges")
            found = await repo.changes(request.before, request.after, request.path, request.listed_only)
        except errors.RcoderError as exc:
            await abort(context, exc)
        return pb.ListChangesResponse(changes=[change_message(c) for c in found])

    async def Diff(self, request: pb.DiffRequest, context: grpc.aio.ServicerContext[Any, Any]) -> pb.DiffResponse:
        try:
            out = await self._repo(request.store, "Diff").diff(
                request.before, request.after, request.path, request.limit
            )
        except errors.RcoderError as exc:
            await abort(context, exc)
        return pb.DiffResponse(diff=out.out, truncated=out.truncated)

    async def Restore(
        self, request: pb.RestoreRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.RestoreResponse:
        try:
            lost = await self._repo(request.store, "Restore").restore(request.commit)
        except errors.RcoderError as exc:
            await abort(context, exc)
        except OSError as exc:
            await abort(context, errors.CheckpointError("restore", f"the project could not be written: {exc}"))
        return pb.RestoreResponse(not_restored=[change_message(c) for c in lost])

    async def GiveBack(
        self, request: pb.GiveBackRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.GiveBackResponse:
        try:
            repo = self._repo(request.store, "GiveBack")
            changes = [change_of(c) for c in request.changes]
            await asyncio.to_thread(give_back, repo.work_tree, changes)
        except errors.RcoderError as exc:
            await abort(context, exc)
        except OSError as exc:
            await abort(
                context, errors.CheckpointError("give-back", f"the project's owner could not be given its files: {exc}")
            )
        return pb.GiveBackResponse()

    async def RemoveStore(
        self, request: pb.RemoveStoreRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.RemoveStoreResponse:
        try:
            repo = self._repo(request.store, "RemoveStore")
            self._stores.forget(request.store.project.project_id)
            await asyncio.to_thread(shutil.rmtree, repo.git_dir, True)
            await asyncio.to_thread(shutil.rmtree, repo.index.parent, True)
        except errors.RcoderError as exc:
            await abort(context, exc)
        return pb.RemoveStoreResponse()

    async def CollectGarbage(
        self, request: pb.CollectGarbageRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.CollectGarbageResponse:
        try:
            if request.bound_seconds <= 0:
                raise errors.InvalidArgument("bound_seconds", "the seconds a pass may take, above 0")
            done = await self._repo(request.store, "CollectGarbage").gc(request.bound_seconds)
        except errors.RcoderError as exc:
            await abort(context, exc)
        return pb.CollectGarbageResponse(packs=done.packs, freed=done.freed, cut=done.cut)

    async def StoreSize(
        self, request: pb.StoreSizeRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.StoreSizeResponse:
        try:
            repo = self._repo(request.store, "StoreSize")
        except errors.RcoderError as exc:
            await abort(context, exc)
        return pb.StoreSizeResponse(bytes=await asyncio.to_thread(store_bytes, repo.git_dir))


async def _data(requests: AsyncIterator[pb.WriteFileRequest]) -> AsyncIterator[bytes]:
    """The data of a WriteFile after its head, each message checked."""
    async for request in requests:
        if request.WhichOneof("message") != "data":
            raise errors.InvalidArgument("head", "a WriteFile stream names its file once, first")
        if len(request.data) > CHUNK_BYTES:
            raise errors.InvalidArgument("data", f"at most {CHUNK_BYTES} bytes per message")
        if request.data:
            yield request.data

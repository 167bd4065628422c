"""The relay's second service, ``rcoder.relay.v1.RelayWorkspaceService``: a project's files, done
where they are (docs/relay.md#files-and-checkpoints).

Each call is the daemon's own file work (``rcoder.agent.files.disk.ProjectDisk``: paths beneath the
project, sizes, whole files, compare-and-swap, symlink-proof), so a relayed project answers as a
local one does; errors go back as the gRPC status and ErrorInfo of ``rcoder.relay.service``'s
table, which the daemon's ``rcoder.relay.workspace_client`` turns into the same error types.
What needs the daemon's state (whether a turn runs in the project, the snapshots taken ahead)
stays the daemon's.
"""

from __future__ import annotations

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
from rcoder.agent.files.threads import FileThreads
from rcoder.agent.files.upload_journal import UploadJournal
from rcoder.logs import get_logger
from rcoder.relay.service import abort
from rcoder.relay.v1 import workspace_pb2 as pb
from rcoder.relay.v1 import workspace_pb2_grpc as pb_grpc

log = get_logger("rcoder.relay.workspace")
UPLOADS_FOLDER = "uploads"  # in the relay's state folder: the writes under way
MAX_PAGE = 1000


class Workspaces:
    """The relay's disks, one per workspace root and file bound a daemon names, sharing one set of
    file threads (fair between projects and callers) and one journal of the writes under way.
    Counts each call by its name (``calls``), which a test reads to see the relay did the work."""

    def __init__(self, threads: FileThreads, journal: UploadJournal) -> None:
        self._threads = threads
        self._journal = journal
        self._disks: dict[tuple[str, int], ProjectDisk] = {}
        self.calls: dict[str, int] = {}

    def disk(self, project: pb.Project, call: str) -> tuple[ProjectDisk, str, str]:
        """The disk of ``project``'s root, its project id and its caller; the call counted."""
        if not project.workspace_root or not Path(project.workspace_root).is_absolute():
            raise errors.InvalidArgument("project.workspace_root", "the absolute folder that holds the projects")
        if not project.project_id or project.project_id in (".", "..") or "/" in project.project_id:
            raise errors.InvalidArgument("project.project_id", "a project's folder name")
        if project.max_file_bytes <= 0:
            raise errors.InvalidArgument("project.max_file_bytes", "the largest file, in bytes, above 0")
        key = (project.workspace_root, project.max_file_bytes)
        disk = self._disks.get(key)
        if disk is None:
            disk = ProjectDisk(Path(project.workspace_root), project.max_file_bytes, self._journal, self._threads)
            self._disks[key] = disk
        self.calls[call] = self.calls.get(call, 0) + 1
        log.info("relay_workspace_call", call=call, project_id=project.project_id, calls=self.calls[call])
        return disk, project.project_id, project.caller

    def close(self) -> None:
        self._threads.close()


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
    def __init__(self, workspaces: Workspaces) -> None:
        self._workspaces = workspaces

    async def ListFiles(
        self, request: pb.ListFilesRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ListFilesResponse:
        try:
            disk, project_id, caller = self._workspaces.disk(request.project, "ListFiles")
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
            disk, project_id, caller = self._workspaces.disk(request.project, "StatFile")
            entry = await disk.stat(project_id, parts_of(request.path), caller)
        except errors.RcoderError as exc:
            await abort(context, exc)
        return pb.StatFileResponse(entry=entry_message(entry))

    async def ReadFile(
        self, request: pb.ReadFileRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[pb.ReadFileResponse]:
        try:
            disk, project_id, caller = self._workspaces.disk(request.project, "ReadFile")
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
            disk, project_id, caller = self._workspaces.disk(given.project, "WriteFile")
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
            disk, project_id, caller = self._workspaces.disk(request.project, "DeleteFile")
            parts = parts_of(request.path)
            if not parts:
                raise errors.InvalidArgument("path", "the entry's path in the project (the project's folder stays)")
            kind = await disk.delete(project_id, parts, request.recursive, caller)
        except errors.RcoderError as exc:
            await abort(context, exc)
        return pb.DeleteFileResponse(kind=kind)


async def _data(requests: AsyncIterator[pb.WriteFileRequest]) -> AsyncIterator[bytes]:
    """The data of a WriteFile after its head, each message checked."""
    async for request in requests:
        if request.WhichOneof("message") != "data":
            raise errors.InvalidArgument("head", "a WriteFile stream names its file once, first")
        if len(request.data) > CHUNK_BYTES:
            raise errors.InvalidArgument("data", f"at most {CHUNK_BYTES} bytes per message")
        if request.data:
            yield request.data

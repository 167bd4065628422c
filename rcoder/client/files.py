"""A project's files (docs/files.md): ``client.list_files``, ``read_file``, ``write_file``,
``delete_file`` and the values they answer with."""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Any

import grpc

from rcoder.client._record import Record, enum_member, optional_datetime
from rcoder.client.errors import from_rpc_error
from rcoder.v1 import agent_runner_pb2 as pb
from rcoder.v1 import agent_runner_pb2_grpc as pb_grpc

CHUNK_BYTES = 1 << 20  # the most data one WriteFileChunk carries (as the daemon takes it)
FileData = bytes | Iterable[bytes] | AsyncIterable[bytes]


class FileKind(StrEnum):
    UNSPECIFIED = "unspecified"
    FILE = "file"
    DIR = "dir"
    SYMLINK = "symlink"  # link_target says where it points
    OTHER = "other"  # a FIFO, socket or device


@dataclass(frozen=True, kw_only=True, slots=True)
class FileEntry(Record):
    """One entry of a project (``ListFiles``), as the entry itself is: a link is not followed."""

    path: str  # relative to the project, '/'-separated
    kind: FileKind
    size: int
    mode: int  # the permission bits, e.g. 0o644
    mtime: datetime | None
    link_target: str  # a link's target; "" for other kinds
    raw: pb.FileEntry = field(repr=False, compare=False)


@dataclass(frozen=True, kw_only=True, slots=True)
class FilePage:
    """One page of ``ListFiles``; an empty ``next_page_token`` means it was the last."""

    entries: tuple[FileEntry, ...]
    next_page_token: str
    unlisted: int  # names that are not UTF-8, left out


@dataclass(frozen=True, kw_only=True, slots=True)
class FileHead:
    """The whole file, as ``ReadFile``'s first chunk describes it."""

    size: int
    mode: int
    sha256: str
    mtime: datetime | None


@dataclass(frozen=True, kw_only=True, slots=True)
class WrittenFile(Record):
    """What ``WriteFile`` wrote."""

    sha256: str
    size: int
    mode: int
    raw: pb.WriteFileResponse = field(repr=False, compare=False)


def entry_from_proto(m: pb.FileEntry) -> FileEntry:
    return FileEntry(
        path=m.path, kind=enum_member(FileKind, pb.FileKind, m.kind, "FILE_KIND_"), size=m.size, mode=m.mode,
        mtime=optional_datetime(m, "mtime"), link_target=m.link_target, raw=m,
    )  # fmt: skip


class FileRead:
    """A file being read: ``async for data in read`` gives its chunks (at most 1 MiB each); ``head``
    describes the whole file once the first is read; ``await read.bytes()`` reads it all."""

    def __init__(self, open_call: Callable[[], Any]) -> None:
        self._open_call = open_call
        self.head: FileHead | None = None

    async def __aiter__(self) -> AsyncIterator[bytes]:
        call = self._open_call()
        try:
            async for chunk in call:
                if self.head is None:
                    mtime = optional_datetime(chunk, "mtime")
                    self.head = FileHead(size=chunk.size, mode=chunk.mode, sha256=chunk.sha256, mtime=mtime)
                if chunk.data:
                    yield chunk.data
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc) from exc
        finally:
            call.cancel()  # a reader that stops early ends the stream (a no-op once it is over)

    async def bytes(self) -> bytes:
        return b"".join([data async for data in self])


async def _pieces(data: FileData) -> AsyncIterator[bytes]:
    """``data`` in pieces of at most ``CHUNK_BYTES``."""
    if isinstance(data, bytes | bytearray | memoryview):
        view = memoryview(data)
        for start in range(0, len(view), CHUNK_BYTES):
            yield bytes(view[start : start + CHUNK_BYTES])
        return
    if isinstance(data, AsyncIterable):
        async for part in data:
            for start in range(0, len(part), CHUNK_BYTES):
                yield part[start : start + CHUNK_BYTES]
        return
    for part in data:
        for start in range(0, len(part), CHUNK_BYTES):
            yield part[start : start + CHUNK_BYTES]


async def write_chunks(head: pb.WriteFileChunk, data: FileData) -> AsyncIterator[pb.WriteFileChunk]:
    """The request stream of a WriteFile: ``head`` with the first piece, then the rest."""
    first = True
    async for piece in _pieces(data):
        if first:
            head.data = piece
            yield head
            first = False
        else:
            yield pb.WriteFileChunk(data=piece)
    if first:  # no data at all: an empty file
        yield head


class Files:
    """The file calls of ``RcoderClient`` (its token, timeouts and errors)."""

    def __init__(
        self,
        stub: pb_grpc.AgentRunnerStub,
        unary: Callable[[Any, Any], Awaitable[Any]],
        metadata: tuple[tuple[str, str], ...],
        check_open: Callable[[], None],
    ) -> None:
        self._stub = stub
        self._unary = unary
        self._metadata = metadata
        self._check_open = check_open

    async def page(
        self, project_id: str, path: str = "", *, recursive: bool = False, page_size: int = 0, page_token: str = ""
    ) -> FilePage:
        request = pb.ListFilesRequest(
            project_id=project_id, path=path, recursive=recursive, page_size=page_size, page_token=page_token
        )
        answer = await self._unary(self._stub.ListFiles, request)
        return FilePage(
            entries=tuple(entry_from_proto(e) for e in answer.entries),
            next_page_token=answer.next_page_token,
            unlisted=answer.unlisted,
        )

    async def list(
        self, project_id: str, path: str = "", *, recursive: bool = False, page_size: int = 0
    ) -> AsyncIterator[FileEntry]:
        token = ""
        while True:
            page = await self.page(project_id, path, recursive=recursive, page_size=page_size, page_token=token)
            for entry in page.entries:
                yield entry
            token = page.next_page_token
            if not token:
                return

    def read(self, project_id: str, path: str, *, offset: int = 0, limit: int = 0, timeout: float | None) -> FileRead:
        request = pb.ReadFileRequest(project_id=project_id, path=path, offset=offset, limit=limit)

        def open_call() -> Any:
            self._check_open()
            return self._stub.ReadFile(request, metadata=self._metadata, timeout=timeout)

        return FileRead(open_call)

    async def write(self, head: pb.WriteFileChunk, data: FileData, timeout: float | None) -> WrittenFile:
        self._check_open()
        try:
            answer = await self._stub.WriteFile(write_chunks(head, data), metadata=self._metadata, timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc) from exc
        return WrittenFile(sha256=answer.sha256, size=answer.size, mode=answer.mode, raw=answer)

    async def delete(self, request: pb.DeleteFileRequest) -> FileKind:
        answer = await self._unary(self._stub.DeleteFile, request)
        return enum_member(FileKind, pb.FileKind, answer.kind, "FILE_KIND_")

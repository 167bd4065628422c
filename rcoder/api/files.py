"""The file RPCs' handlers (docs/files.md): ListFiles, ReadFile, WriteFile, DeleteFile.

Each checks its request, the caller's scope (the project must be one of the caller's, as for
``Chat``; a reader may list and read, not write or delete: ``rcoder.api.callers``), and calls
``rcoder.session.files.project_files``. They are served by the host that receives them, never forwarded: hosts
that share a store share the workspace too (docs/hosts.md), so every host sees the same files.

WriteFile is the one call whose client streams: the server's gate (``rcoder.api.gate``) read its
first chunk, and the rest are read here, each at most 1 MiB of data, each checked.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import AsyncIterator
from typing import Any, NoReturn

import grpc

from rcoder import errors
from rcoder.api import convert
from rcoder.api.gate import Undecodable
from rcoder.api.scope import Call, Scope
from rcoder.logs import get_logger
from rcoder.session.files.project_files import (
    ABSENT,
    CHUNK_BYTES,
    MAX_DEPTH,
    MAX_POSITION,
    Cursor,
    Entry,
    ProjectFiles,
    WriteHead,
    path_parts,
)  # fmt: skip
from rcoder.session.sessions.workspace import check_project_id
from rcoder.v1 import agent_runner_pb2 as pb

log = get_logger("rcoder.api")
DEFAULT_PAGE = 1000
MAX_PAGE = 10000
_SHA256 = re.compile(r"[0-9a-f]{64}")
_KINDS = {"file": pb.FILE_KIND_FILE, "dir": pb.FILE_KIND_DIR, "symlink": pb.FILE_KIND_SYMLINK,
          "other": pb.FILE_KIND_OTHER}  # fmt: skip
_FILES_TOKEN = "files "  # noqa: S105 (a page token's prefix, not a password)
_HEAD_FIELDS = ("project_id", "path", "mode", "if_sha256", "while_busy")


class FileRpcs:
    """The AgentRunner's file methods (``AgentRunnerService`` is one)."""

    _files: ProjectFiles
    _scope: Scope

    async def _abort(self, context: grpc.aio.ServicerContext[Any, Any], exc: errors.RcoderError) -> NoReturn:
        raise NotImplementedError  # pragma: no cover (AgentRunnerService's)

    async def ListFiles(
        self, request: pb.ListFilesRequest, context: grpc.aio.ServicerContext[Any, Any], call: Call
    ) -> pb.ListFilesResponse:
        try:
            check_project_id(request.project_id)
            parts = path_parts(request.path, required=False)
            self._scope.project(call, request.project_id)
            if request.page_size > MAX_PAGE:
                raise errors.InvalidArgument("page_size", f"at most {MAX_PAGE}")
            made_for = [request.project_id, list(parts), request.recursive]
            cursor = _decode_token(request.page_token, made_for)
            listing = await self._files.list(
                request.project_id, parts, request.recursive, request.page_size or DEFAULT_PAGE, cursor,
                call.caller.name,
            )  # fmt: skip
        except errors.RcoderError as exc:
            await self._abort(context, exc)
        token = _encode_token(made_for, listing.next) if listing.next is not None else ""
        return pb.ListFilesResponse(
            entries=[_entry(e) for e in listing.entries], next_page_token=token, unlisted=listing.unlisted
        )

    async def ReadFile(
        self, request: pb.ReadFileRequest, context: grpc.aio.ServicerContext[Any, Any], call: Call
    ) -> AsyncIterator[bytes]:
        try:
            check_project_id(request.project_id)
            parts = path_parts(request.path)
            self._scope.project(call, request.project_id)
            chunks = self._files.read(request.project_id, parts, request.offset, request.limit, call.caller.name)
            async for chunk in chunks:
                message = pb.FileChunk(data=chunk.data, offset=chunk.offset)
                if chunk.head is not None:
                    message.size, message.mode, message.sha256 = chunk.head.size, chunk.head.mode, chunk.head.sha256
                    message.mtime.CopyFrom(convert.timestamp(chunk.head.mtime))
                yield message.SerializeToString()  # serialized here: see rcoder.api.server._serializer
        except errors.RcoderError as exc:
            await self._abort(context, exc)

    async def WriteFile(
        self, request: pb.WriteFileChunk, context: grpc.aio.ServicerContext[Any, Any], call: Call
    ) -> pb.WriteFileResponse:
        try:
            head = _write_head(request)
            self._scope.project(call, request.project_id)
            written = await self._files.write(head, _chunks(request, context), call.caller.name)
        except errors.RcoderError as exc:
            await self._abort(context, exc)
        log.info("file_written", client=call.caller.name, project_id=head.project_id, path=request.path,
                 size=written.size, sha256=written.sha256, while_busy=head.while_busy)  # fmt: skip
        return pb.WriteFileResponse(sha256=written.sha256, size=written.size, mode=written.mode)

    async def DeleteFile(
        self, request: pb.DeleteFileRequest, context: grpc.aio.ServicerContext[Any, Any], call: Call
    ) -> pb.DeleteFileResponse:
        try:
            check_project_id(request.project_id)
            parts = path_parts(request.path)
            self._scope.project(call, request.project_id)
            kind = await self._files.delete(
                request.project_id, parts, request.recursive, request.while_busy, call.caller.name
            )
        except errors.RcoderError as exc:
            await self._abort(context, exc)
        log.info("file_deleted", client=call.caller.name, project_id=request.project_id, path=request.path,
                 kind=kind, while_busy=request.while_busy)  # fmt: skip
        return pb.DeleteFileResponse(kind=_KINDS[kind])


def _entry(entry: Entry) -> pb.FileEntry:
    return pb.FileEntry(
        path="/".join(entry.path), kind=_KINDS[entry.kind], size=entry.size, mode=entry.mode,
        mtime=convert.timestamp(entry.mtime), link_target=entry.link_target,
    )  # fmt: skip


def _write_head(request: pb.WriteFileChunk) -> WriteHead:
    check_project_id(request.project_id)
    parts = path_parts(request.path)
    if request.mode > 0o777:
        raise errors.InvalidArgument("mode", f"{request.mode:#o}: permission bits only, at most 0777 (511)")
    expected = request.if_sha256.lower()
    if expected and expected != ABSENT and not _SHA256.fullmatch(expected):
        raise errors.InvalidArgument("if_sha256", "64 hex digits (a SHA-256), or 'absent' for no file yet")
    if len(request.data) > CHUNK_BYTES:
        raise errors.InvalidArgument("data", f"at most {CHUNK_BYTES} bytes per chunk")
    return WriteHead(request.project_id, parts, request.mode, expected, request.while_busy)


async def _chunks(first: pb.WriteFileChunk, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[bytes]:
    """The data of every chunk of a WriteFile, the first included, each checked."""
    if first.data:
        yield first.data
    while True:
        read = await context.read()
        if read is grpc.aio.EOF:
            return
        message, _ = read
        if isinstance(message, Undecodable):
            raise errors.InvalidArgument("request", f"a chunk could not be decoded ({message.error})", "BAD_REQUEST")
        for field in _HEAD_FIELDS:
            if getattr(message, field):
                raise errors.InvalidArgument(field, "set on the first chunk only")
        if len(message.data) > CHUNK_BYTES:
            raise errors.InvalidArgument("data", f"at most {CHUNK_BYTES} bytes per chunk")
        if message.data:
            yield message.data


def _encode_token(made_for: list[Any], cursor: Cursor) -> str:
    positions, entered = cursor
    text = _FILES_TOKEN + json.dumps([*made_for, list(positions), list(entered)])
    return base64.urlsafe_b64encode(text.encode()).decode()


def _decode_token(token: str, made_for: list[Any]) -> Cursor | None:
    """Where the page ``token`` asks for starts: the position in each folder the page before was
    in, and the folders it had entered (docs/files.md#pages); ``InvalidArgument`` for a token of
    another listing, or one that is not ours (an older daemon's included)."""
    if not token:
        return None
    try:
        text = base64.b64decode(token.encode(), altchars=b"-_", validate=True).decode()
        if not text.startswith(_FILES_TOKEN):
            raise ValueError(text)
        *made, positions, entered = json.loads(text.removeprefix(_FILES_TOKEN))
        if not isinstance(positions, list) or not isinstance(entered, list):
            raise TypeError(text)
        if len(positions) != len(entered) + 1 or len(entered) > MAX_DEPTH + 1:
            raise ValueError(text)
        for position in positions:
            if not isinstance(position, int) or isinstance(position, bool) or not 0 <= position <= MAX_POSITION:
                raise ValueError(text)
        for name in entered:
            if not isinstance(name, str) or path_parts(name, "page_token") != (name,):
                raise ValueError(text)
    except (binascii.Error, UnicodeError, ValueError, TypeError, errors.InvalidArgument):
        raise errors.InvalidArgument("page_token", "not a token from a previous ListFiles answer") from None
    if made != made_for:
        raise errors.InvalidArgument(
            "page_token", "made for another listing: send the project_id, path and recursive it came from"
        )
    return tuple(positions), tuple(entered)

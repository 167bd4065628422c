"""A project's files through the API (docs/files.md): listed, read and written beneath the
project, never through a link out of it, whole or not at all; against a real daemon over gRPC."""

from __future__ import annotations

import asyncio
import hashlib
import os
import sys
from collections.abc import AsyncIterator, Awaitable, Iterable
from functools import partial
from pathlib import Path
from typing import Any

import grpc
import pytest

from rcoder.v1 import agent_runner_pb2 as pb
from tests.conftest import DaemonFactory
from tests.harness import Client, error_info, eventually
from tests.turns import read_until, rest_of, start_turn

PROJECT = "proj"
MIB = 1 << 20


def project(tmp_path: Path) -> Path:
    folder = tmp_path / "workspace" / PROJECT
    folder.mkdir(parents=True, exist_ok=True)
    return folder


async def refused(call: Awaitable[Any]) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    return caught.value


def said(exc: grpc.aio.AioRpcError) -> tuple[str, str]:
    return exc.code().name, error_info(exc).reason


async def read_all(client: Client, path: str, **fields: Any) -> list[pb.FileChunk]:
    fields.setdefault("project_id", PROJECT)
    async with asyncio.timeout(60):
        return [chunk async for chunk in client.stub.ReadFile(pb.ReadFileRequest(path=path, **fields))]


async def read_error(client: Client, path: str, project_id: str = PROJECT) -> grpc.aio.AioRpcError:
    return await refused(read_all(client, path, project_id=project_id))


def chunks_of(data: bytes, size: int = MIB, **head: Any) -> list[pb.WriteFileChunk]:
    head.setdefault("project_id", PROJECT)
    pieces = [data[i : i + size] for i in range(0, len(data), size)] or [b""]
    return [pb.WriteFileChunk(data=pieces[0], **head)] + [pb.WriteFileChunk(data=p) for p in pieces[1:]]


async def write(client: Client, path: str, data: bytes, **head: Any) -> pb.WriteFileResponse:
    async with asyncio.timeout(60):
        answer: pb.WriteFileResponse = await client.stub.WriteFile(iter(chunks_of(data, path=path, **head)))
    return answer


async def listing(client: Client, path: str = "", page_size: int = 0, **fields: Any) -> list[pb.FileEntry]:
    """Every entry, page by page."""
    entries, token = [], ""
    while True:
        request = pb.ListFilesRequest(project_id=PROJECT, path=path, page_size=page_size, page_token=token, **fields)
        page = await client.stub.ListFiles(request)
        entries += page.entries
        if page_size:
            assert len(page.entries) <= page_size
        token = page.next_page_token
        if not token:
            return entries


def depth_first(paths: list[str]) -> bool:
    """Whether every path comes after its folder, and a folder's contents follow it together."""
    for i, path in enumerate(paths):
        parent = path.rpartition("/")[0]
        if parent and parent not in paths[:i]:
            return False
        inside = [j for j, other in enumerate(paths) if other.startswith(path + "/")]
        if inside != list(range(i + 1, i + 1 + len(inside))):
            return False
    return True


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(".rcoder-upload-"))


def gone(path: Path) -> bool:
    return not path.exists()


def writing(folder: Path) -> bool:
    """A write's temporary file is in ``folder`` (the daemon is writing it)."""
    return folder.is_dir() and bool(leftovers(folder))


async def test_a_listing_goes_depth_first_page_by_page_and_shows_links_with_their_targets(
    make_daemon: DaemonFactory, tmp_path: Path
) -> None:
    root = project(tmp_path)
    (root / "src" / "pkg").mkdir(parents=True)
    (root / "src" / "pkg" / "mod.py").write_text("x = 1\n")
    (root / "src" / "main.py").write_text("print('hi')\n")
    (root / "README").write_bytes(b"12345")
    os.chmod(root / "README", 0o640)
    (root / "a-b").mkdir()
    os.symlink("/etc", root / "etc-link")  # leads out: listed as a link, never entered
    os.symlink("src", root / "src-link")  # inside: a link too, not entered by a recursive listing
    _, client = await make_daemon()

    top = sorted(await listing(client), key=lambda e: e.path)  # the folder's own order (docs/files.md#pages)
    assert [(e.path, e.kind) for e in top] == [
        ("README", pb.FILE_KIND_FILE), ("a-b", pb.FILE_KIND_DIR), ("etc-link", pb.FILE_KIND_SYMLINK),
        ("src", pb.FILE_KIND_DIR), ("src-link", pb.FILE_KIND_SYMLINK),
    ]  # fmt: skip
    readme, _, etc_link, *_ = top
    assert (readme.size, readme.mode) == (5, 0o640)
    assert abs(readme.mtime.seconds - (root / "README").stat().st_mtime) < 2
    assert (etc_link.link_target, etc_link.size) == ("/etc", 4)

    everything = [e.path for e in await listing(client, recursive=True)]
    assert sorted(everything) == [
        "README", "a-b", "etc-link", "src", "src-link", "src/main.py", "src/pkg", "src/pkg/mod.py",
    ]  # fmt: skip
    assert depth_first(everything), everything
    for size in (1, 2, 3):  # every page boundary, inside folders and out of them: the same order
        assert [e.path for e in await listing(client, page_size=size, recursive=True)] == everything
    # a folder by its path, through a link that stays inside; a file as its one entry
    assert sorted(e.path for e in await listing(client, "src-link")) == ["src-link/main.py", "src-link/pkg"]
    assert [e.path for e in await listing(client, "src/main.py")] == ["src/main.py"]
    assert [e.path for e in await listing(client, "etc-link")] == ["etc-link"]

    other = pb.ListFilesRequest(project_id=PROJECT, path="src", page_size=1)
    token = (await client.stub.ListFiles(other)).next_page_token
    wrong = await refused(client.stub.ListFiles(pb.ListFilesRequest(project_id=PROJECT, page_token=token)))
    assert said(wrong) == ("INVALID_ARGUMENT", "INVALID_ARGUMENT") and "another listing" in (wrong.details() or "")
    deep = root / "a-b" / "/".join(["d"] * 66)
    deep.mkdir(parents=True)
    (deep / "bottom.txt").write_bytes(b"")
    page = await client.stub.ListFiles(pb.ListFilesRequest(project_id=PROJECT, path="a-b", recursive=True))
    assert [len(e.path.split("/")) for e in page.entries] == list(range(2, 67))  # 65 folders below a-b
    assert page.unlisted == 1  # the 65th is listed, not entered

    missing = await refused(client.stub.ListFiles(pb.ListFilesRequest(project_id="nowhere")))
    assert said(missing) == ("NOT_FOUND", "PROJECT_NOT_FOUND")
    assert not (tmp_path / "workspace" / "nowhere").exists()


async def test_a_50_mib_binary_reads_back_in_chunks_of_at_most_1_mib_with_its_sha256_and_by_range(
    make_daemon: DaemonFactory, tmp_path: Path
) -> None:
    data = os.urandom(50 * MIB + 12345)
    (project(tmp_path) / "blob.bin").write_bytes(data)
    os.chmod(project(tmp_path) / "blob.bin", 0o600)
    _, client = await make_daemon()

    chunks = await read_all(client, "blob.bin")
    first = chunks[0]
    assert (first.size, first.mode, first.sha256) == (len(data), 0o600, sha(data))
    assert all(len(c.data) <= MIB for c in chunks) and len(chunks) == 51
    assert [c.offset for c in chunks] == [i * MIB for i in range(51)]
    assert all(not c.sha256 and not c.size for c in chunks[1:])
    assert b"".join(c.data for c in chunks) == data

    ranged = await read_all(client, "blob.bin", offset=MIB - 10, limit=MIB + 20)
    assert b"".join(c.data for c in ranged) == data[MIB - 10 : 2 * MIB + 10]
    assert ranged[0].sha256 == sha(data)  # the whole file's, whatever the range
    past = await read_all(client, "blob.bin", offset=len(data) + 5)
    assert [(c.data, c.size) for c in past] == [(b"", len(data))]


async def test_a_written_file_reads_back_byte_exact_with_its_mode_and_folders_are_made(
    make_daemon: DaemonFactory, tmp_path: Path
) -> None:
    root = project(tmp_path)
    _, client = await make_daemon()
    data = os.urandom(3 * MIB + 7)

    answer = await write(client, "new/deep/file.bin", data, mode=0o750)
    assert (answer.sha256, answer.size, answer.mode) == (sha(data), len(data), 0o750)
    on_disk = root / "new" / "deep" / "file.bin"
    assert on_disk.read_bytes() == data and on_disk.stat().st_mode & 0o777 == 0o750
    chunks = await read_all(client, "new/deep/file.bin")
    assert b"".join(c.data for c in chunks) == data and chunks[0].mode == 0o750

    # replaced in one rename: mode 0 keeps the replaced file's, and an empty file is a file
    answer = await write(client, "new/deep/file.bin", b"")
    assert (answer.size, answer.mode, answer.sha256) == (0, 0o750, sha(b""))
    assert on_disk.read_bytes() == b"" and leftovers(on_disk.parent) == []
    assert (await write(client, "plain.txt", b"hi\n")).mode == 0o644

    gone = await client.stub.DeleteFile(pb.DeleteFileRequest(project_id=PROJECT, path="new/deep/file.bin"))
    assert gone.kind == pb.FILE_KIND_FILE and not on_disk.exists()
    full = await refused(client.stub.DeleteFile(pb.DeleteFileRequest(project_id=PROJECT, path="new")))
    assert said(full) == ("FAILED_PRECONDITION", "FOLDER_NOT_EMPTY")
    folder = await client.stub.DeleteFile(pb.DeleteFileRequest(project_id=PROJECT, path="new", recursive=True))
    assert folder.kind == pb.FILE_KIND_DIR and not (root / "new").exists()
    missing = await refused(client.stub.DeleteFile(pb.DeleteFileRequest(project_id=PROJECT, path="new")))
    assert said(missing) == ("NOT_FOUND", "FILE_NOT_FOUND")


async def test_of_two_writers_based_on_the_same_file_exactly_one_wins(
    make_daemon: DaemonFactory, tmp_path: Path
) -> None:
    target = project(tmp_path) / "shared.txt"
    target.write_bytes(b"base\n")
    _, client = await make_daemon()
    both_started = asyncio.Event()

    async def writer(body: bytes, started: asyncio.Event) -> pb.WriteFileResponse | grpc.aio.AioRpcError:
        async def stream() -> AsyncIterator[pb.WriteFileChunk]:
            yield pb.WriteFileChunk(project_id=PROJECT, path="shared.txt", if_sha256=sha(b"base\n"), data=body[:3])
            started.set()
            await both_started.wait()  # both past the first chunk before either ends
            yield pb.WriteFileChunk(data=body[3:])

        try:
            answer: pb.WriteFileResponse = await client.stub.WriteFile(stream())
        except grpc.aio.AioRpcError as exc:
            return exc
        return answer

    started = [asyncio.Event(), asyncio.Event()]
    bodies = [b"from writer one\n" * 1000, b"from writer two\n" * 1000]
    async with asyncio.timeout(30):
        tasks = [asyncio.create_task(writer(b, s)) for b, s in zip(bodies, started, strict=True)]
        await asyncio.gather(*(s.wait() for s in started))
        both_started.set()
        results = await asyncio.gather(*tasks)
    won = [i for i, r in enumerate(results) if isinstance(r, pb.WriteFileResponse)]
    lost = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
    assert len(won) == 1 and len(lost) == 1, results
    assert target.read_bytes() == bodies[won[0]]
    assert said(lost[0]) == ("ABORTED", "SHA256_MISMATCH")
    assert error_info(lost[0]).metadata["current_sha256"] == sha(bodies[won[0]])
    assert leftovers(target.parent) == []

    # "absent": only where there is no file yet
    stale = await refused(write(client, "shared.txt", b"x", if_sha256="absent"))
    assert said(stale) == ("ABORTED", "SHA256_MISMATCH")
    assert (await write(client, "fresh.txt", b"x", if_sha256="absent")).size == 1


async def test_of_two_writers_naming_one_file_by_two_paths_one_through_an_inside_link_exactly_one_wins(
    make_daemon: DaemonFactory, tmp_path: Path
) -> None:
    """``if_sha256`` holds by the file, not by the path: ``real/shared.txt`` and ``via/shared.txt``
    (``via -> real``) are one file, so of two writers based on it one wins, every try."""
    root = project(tmp_path)
    (root / "real").mkdir()
    (root / "via").symlink_to("real")
    target = root / "real" / "shared.txt"
    _, client = await make_daemon()

    async def writer(
        path: str, base: bytes, body: bytes, started: asyncio.Event, go: asyncio.Event
    ) -> pb.WriteFileResponse | grpc.aio.AioRpcError:
        async def stream() -> AsyncIterator[pb.WriteFileChunk]:
            yield pb.WriteFileChunk(project_id=PROJECT, path=path, if_sha256=sha(base), data=body[:3])
            started.set()
            await go.wait()  # both past the early compare before either ends
            yield pb.WriteFileChunk(data=body[3:])

        try:
            answer: pb.WriteFileResponse = await client.stub.WriteFile(stream())
        except grpc.aio.AioRpcError as exc:
            return exc
        return answer

    for attempt in range(12):
        base = f"base {attempt}\n".encode()
        target.write_bytes(base)
        bodies = [f"through real {attempt}\n".encode() * 500, f"through the link {attempt}\n".encode() * 500]
        started, go = [asyncio.Event(), asyncio.Event()], asyncio.Event()
        async with asyncio.timeout(30):
            tasks = [
                asyncio.create_task(writer(path, base, body, ready, go))
                for path, body, ready in zip(("real/shared.txt", "via/shared.txt"), bodies, started, strict=True)
            ]
            await asyncio.gather(*(s.wait() for s in started))
            go.set()
            results = await asyncio.gather(*tasks)
        won = [i for i, r in enumerate(results) if isinstance(r, pb.WriteFileResponse)]
        lost = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
        assert len(won) == 1 and len(lost) == 1, (attempt, results)
        assert said(lost[0]) == ("ABORTED", "SHA256_MISMATCH")
        assert target.read_bytes() == bodies[won[0]]
        assert (root / "via").is_symlink()
    assert leftovers(target.parent) == []


async def test_a_cut_write_stream_leaves_neither_a_partial_file_nor_its_temporary(
    make_daemon: DaemonFactory, tmp_path: Path
) -> None:
    root = project(tmp_path)
    (root / "kept.txt").write_bytes(b"the old text\n")
    _, client = await make_daemon()
    never = asyncio.Event()

    for path in ("kept.txt", "new.txt"):

        async def stream(path: str = path) -> AsyncIterator[pb.WriteFileChunk]:
            yield pb.WriteFileChunk(project_id=PROJECT, path=path, data=b"a" * MIB)
            yield pb.WriteFileChunk(data=b"b" * MIB)
            await never.wait()  # the client goes away mid-file

        call = client.stub.WriteFile(stream())
        await eventually(lambda: bool(leftovers(root)))  # the daemon is writing it
        call.cancel()
        await eventually(lambda: not leftovers(root))
        assert (root / "kept.txt").read_bytes() == b"the old text\n"
        assert not (root / "new.txt").exists()


@pytest.mark.parametrize(
    ("path", "problem"),
    [
        ("../escape.txt", "'..'"), ("a/../../b", "'..'"), ("/etc/passwd", "absolute"), ("a\0b", "NUL"),
        ("x" * 256, "longer than 255 bytes"), ("a/" * 2049, "longer than 4096 bytes"),
    ],
)  # fmt: skip
async def test_a_bad_path_is_invalid_argument_for_every_file_rpc(
    make_daemon: DaemonFactory, tmp_path: Path, path: str, problem: str
) -> None:
    project(tmp_path)
    _, client = await make_daemon()
    stub = client.stub
    calls: Iterable[Awaitable[Any]] = (
        stub.ListFiles(pb.ListFilesRequest(project_id=PROJECT, path=path)),
        read_all(client, path),
        write(client, path, b"x"),
        stub.DeleteFile(pb.DeleteFileRequest(project_id=PROJECT, path=path)),
    )
    for call in calls:
        exc = await refused(call)
        assert said(exc) == ("INVALID_ARGUMENT", "INVALID_ARGUMENT")
        assert problem in (exc.details() or "") and error_info(exc).metadata["field"] == "path"
    assert not (tmp_path / "workspace" / "escape.txt").exists()


async def test_a_link_leading_out_is_never_followed_to_read_or_write_and_nothing_outside_changes(
    make_daemon: DaemonFactory, tmp_path: Path
) -> None:
    root = project(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_bytes(b"not yours\n")
    os.symlink(outside / "secret.txt", root / "secret-link")  # a file out of the project
    os.symlink("../../outside", root / "dir-link")  # a folder out of it, by a relative target
    (root / "src").mkdir()
    (root / "src" / "a.txt").write_bytes(b"inside\n")
    os.symlink("../src", root / "src" / "self")  # stays inside: followed
    _, client = await make_daemon()
    stub = client.stub

    for path in ("secret-link", "dir-link/secret.txt"):
        exc = await read_error(client, path)
        assert said(exc) == ("FAILED_PRECONDITION", "LINK_LEADS_OUT"), path
    assert b"".join(c.data for c in await read_all(client, "src/self/self/a.txt")) == b"inside\n"

    # a folder link in the middle of the path: refused, nothing made or written outside
    for path in ("dir-link/new.txt", "dir-link/deeper/new.txt", "dir-link/secret.txt"):
        exc = await refused(write(client, path, b"pwned\n"))
        assert said(exc) == ("FAILED_PRECONDITION", "LINK_LEADS_OUT"), path
        exc = await refused(stub.DeleteFile(pb.DeleteFileRequest(project_id=PROJECT, path=path)))
        assert said(exc) == ("FAILED_PRECONDITION", "LINK_LEADS_OUT"), path
    # the link itself as the last name: not written through; deleted as a link
    exc = await refused(write(client, "secret-link", b"pwned\n"))
    assert said(exc) == ("FAILED_PRECONDITION", "PATH_IS_LINK")
    assert sorted(p.name for p in outside.iterdir()) == ["secret.txt"]
    assert (outside / "secret.txt").read_bytes() == b"not yours\n"
    gone = await stub.DeleteFile(pb.DeleteFileRequest(project_id=PROJECT, path="secret-link"))
    assert gone.kind == pb.FILE_KIND_SYMLINK and not (root / "secret-link").is_symlink()
    gone = await stub.DeleteFile(pb.DeleteFileRequest(project_id=PROJECT, path="dir-link", recursive=True))
    assert gone.kind == pb.FILE_KIND_SYMLINK
    assert (outside / "secret.txt").read_bytes() == b"not yours\n"
    assert leftovers(root) == []


async def test_a_file_past_max_file_bytes_is_refused_both_ways_and_leaves_nothing(
    make_daemon: DaemonFactory, tmp_path: Path
) -> None:
    root = project(tmp_path)
    (root / "big.bin").write_bytes(b"z" * (2 * MIB))
    _, client = await make_daemon(max_file_bytes="1MiB")

    exc = await read_error(client, "big.bin")
    assert said(exc) == ("RESOURCE_EXHAUSTED", "FILE_TOO_LARGE") and "max_file_bytes" in (exc.details() or "")
    exc = await refused(write(client, "upload.bin", b"y" * (MIB + 1), size=MIB // 4))
    assert said(exc) == ("RESOURCE_EXHAUSTED", "FILE_TOO_LARGE")
    assert not (root / "upload.bin").exists() and leftovers(root) == []
    assert (await write(client, "upload.bin", b"y" * MIB)).size == MIB


async def test_a_write_while_a_turn_runs_in_the_project_is_refused_unless_while_busy(
    make_daemon: DaemonFactory, tmp_path: Path
) -> None:
    root = project(tmp_path)
    (root / "notes.txt").write_bytes(b"before\n")
    _, client = await make_daemon()
    stub = client.stub
    call, begin = await start_turn(client, project_id=PROJECT, prompt="hang")

    exc = await refused(write(client, "notes.txt", b"during\n"))
    assert said(exc) == ("FAILED_PRECONDITION", "PROJECT_BUSY")
    assert error_info(exc).metadata["run_id"] == begin.run_id
    exc = await refused(stub.DeleteFile(pb.DeleteFileRequest(project_id=PROJECT, path="notes.txt")))
    assert said(exc) == ("FAILED_PRECONDITION", "PROJECT_BUSY")
    assert (root / "notes.txt").read_bytes() == b"before\n"
    # reads go on; another project is not busy; while_busy says the platform means it
    assert (await read_all(client, "notes.txt"))[0].data == b"before\n"
    assert (await write(client, "notes.txt", b"during\n", while_busy=True)).size == 7
    assert (root / "notes.txt").read_bytes() == b"during\n"

    await stub.Cancel(pb.CancelRequest(run_id=begin.run_id))
    await read_until(call, "completed")
    await rest_of(call)
    assert (await write(client, "notes.txt", b"after\n")).size == 6


async def test_a_reader_may_list_and_read_but_not_write_or_delete_and_changes_are_audited(
    make_daemon: DaemonFactory, tmp_path: Path
) -> None:
    from tests.test_tenants import ACME, ACME_READER, ADMIN, as_, clients

    for name in ("acme-1", "beta-1"):
        (tmp_path / "workspace" / name).mkdir(parents=True)
        (tmp_path / "workspace" / name / "f.txt").write_bytes(b"text\n")
    daemon, client = await make_daemon(auth_token=ADMIN, clients=clients(tmp_path))
    stub = client.stub

    listed = await stub.ListFiles(pb.ListFilesRequest(project_id="acme-1"), metadata=as_(ACME_READER))
    assert [e.path for e in listed.entries] == ["f.txt"]
    read = [c async for c in stub.ReadFile(pb.ReadFileRequest(project_id="acme-1", path="f.txt"),
                                           metadata=as_(ACME_READER))]  # fmt: skip
    assert read[0].data == b"text\n"
    # one at a time: a grpc.aio call starts when it is made, and the audit below is in order
    write = stub.WriteFile(iter(chunks_of(b"x", path="f.txt", project_id="acme-1")), metadata=as_(ACME_READER))
    assert said(await refused(write)) == ("PERMISSION_DENIED", "ROLE_LACKS_METHOD")
    delete = stub.DeleteFile(pb.DeleteFileRequest(project_id="acme-1", path="f.txt"), metadata=as_(ACME_READER))
    assert said(await refused(delete)) == ("PERMISSION_DENIED", "ROLE_LACKS_METHOD")
    outside = await refused(stub.ListFiles(pb.ListFilesRequest(project_id="beta-1"), metadata=as_(ACME_READER)))
    assert said(outside) == ("PERMISSION_DENIED", "PROJECT_OUT_OF_SCOPE")
    beta = await refused(stub.WriteFile(iter(chunks_of(b"x", path="f.txt", project_id="beta-1")), metadata=as_(ACME)))
    assert said(beta) == ("PERMISSION_DENIED", "PROJECT_OUT_OF_SCOPE")
    assert (tmp_path / "workspace" / "beta-1" / "f.txt").read_bytes() == b"text\n"

    await stub.WriteFile(iter(chunks_of(b"new\n", path="g.txt", project_id="acme-1")), metadata=as_(ACME))
    await stub.DeleteFile(pb.DeleteFileRequest(project_id="acme-1", path="g.txt"), metadata=as_(ACME))
    lines = await daemon.wait_log("audit", count=5)
    assert [(r["client"], r["method"], r["project_id"], r["path"], r["code"]) for r in lines] == [
        ("acme-console", "WriteFile", "acme-1", "f.txt", "PERMISSION_DENIED"),  # what it named, though refused
        ("acme-console", "DeleteFile", "acme-1", "f.txt", "PERMISSION_DENIED"),
        ("acme-chat", "WriteFile", "beta-1", "f.txt", "PERMISSION_DENIED"),
        ("acme-chat", "WriteFile", "acme-1", "g.txt", "OK"),
        ("acme-chat", "DeleteFile", "acme-1", "g.txt", "OK"),
    ]
    (written,) = await daemon.wait_log("file_written")
    assert (written["path"], written["sha256"]) == ("g.txt", sha(b"new\n"))


async def test_the_python_client_lists_reads_writes_and_deletes_files(
    make_daemon: DaemonFactory, tmp_path: Path
) -> None:
    from rcoder.client import Conflict, FailedPrecondition, FileKind, NotFound, RcoderClient

    root = project(tmp_path)
    daemon, _ = await make_daemon()
    data = os.urandom(2 * MIB + 3)

    async def pieces() -> AsyncIterator[bytes]:
        yield data[:100]
        yield data[100:]  # more than a chunk: the client cuts it

    async with RcoderClient(daemon.address, token=daemon.token) as client:
        written = await client.write_file(PROJECT, "bin/data.bin", pieces(), mode=0o600)
        assert (written.sha256, written.size, written.mode) == (sha(data), len(data), 0o600)
        read = client.read_file(PROJECT, "bin/data.bin")
        assert await read.bytes() == data
        assert read.head is not None and (read.head.sha256, read.head.size) == (sha(data), len(data))
        assert await client.read_file(PROJECT, "bin/data.bin", offset=5, limit=10).bytes() == data[5:15]
        await client.write_file(PROJECT, "note.txt", b"one\n")
        entries = [(e.path, e.kind) async for e in client.list_files(PROJECT, recursive=True, page_size=1)]
        assert sorted(entries) == [("bin", FileKind.DIR), ("bin/data.bin", FileKind.FILE), ("note.txt", FileKind.FILE)]
        assert depth_first([path for path, _ in entries])
        with pytest.raises(Conflict) as conflict:
            await client.write_file(PROJECT, "note.txt", b"two\n", if_sha256=sha(b"other"))
        assert conflict.value.metadata["current_sha256"] == sha(b"one\n")
        with pytest.raises(FailedPrecondition):
            await client.read_file(PROJECT, "bin").bytes()
        assert await client.delete_file(PROJECT, "bin", recursive=True) is FileKind.DIR
        with pytest.raises(NotFound):
            await client.delete_file(PROJECT, "bin")
    assert sorted(p.name for p in root.iterdir()) == ["note.txt"]


async def test_rcoder_files_ls_cat_put_and_rm(make_daemon: DaemonFactory, tmp_path: Path) -> None:
    from tests.test_client_cli import rcoder

    root = project(tmp_path)
    (root / "src").mkdir()
    os.symlink("/etc", root / "etc-link")
    local = tmp_path / "local.bin"
    local.write_bytes(b"\x00binary\xff" * 1000)
    daemon, _ = await make_daemon()
    common = ("--project", PROJECT, "--target", daemon.address, "--config", str(daemon.config))

    code, out, err = await rcoder("files", "put", "src/a.bin", str(local), "--mode", "640", *common)
    assert code == 0, err
    assert out == f"wrote src/a.bin: 8000 bytes, mode 640, sha256 {sha(local.read_bytes())}\n"
    code, out, _ = await rcoder("files", "put", "b.txt", *common, stdin=b"from stdin\n")
    assert code == 0 and (root / "b.txt").read_bytes() == b"from stdin\n"
    code, out, _ = await rcoder("files", "ls", "-r", *common)
    lines = {line.split()[-1]: line for line in out.splitlines()}
    assert sorted(lines) == ["/etc", "b.txt", "src/", "src/a.bin"]
    assert lines["/etc"].startswith("lrwx") and lines["/etc"].endswith("etc-link -> /etc")
    assert lines["src/a.bin"].startswith("-rw-r----- ") and " 8000 " in lines["src/a.bin"]
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "rcoder", "files", "cat", "src/a.bin", *common, stdout=asyncio.subprocess.PIPE
    )
    async with asyncio.timeout(60):
        data, _ = await proc.communicate()
    assert proc.returncode == 0 and data == local.read_bytes()
    code, out, _ = await rcoder("files", "rm", "src", "-r", *common)
    assert (code, out) == (0, "deleted src (dir)\n") and not (root / "src").exists()
    code, _, err = await rcoder("files", "cat", "../x", *common)
    assert code == 1 and "INVALID_ARGUMENT" in err and "'..'" in err


async def test_the_temporary_file_of_a_write_cut_by_sigkill_of_the_daemon_is_removed_when_it_starts_again(
    make_daemon: DaemonFactory, tmp_path: Path
) -> None:
    root = project(tmp_path)
    (root / "sub").mkdir()
    (root / "sub" / f".rcoder-upload-{'0' * 32}.tmp").write_bytes(b"the project's own, no write's")
    daemon, client = await make_daemon()
    never = asyncio.Event()

    async def stream() -> AsyncIterator[pb.WriteFileChunk]:
        yield pb.WriteFileChunk(project_id=PROJECT, path="sub/big.bin", data=b"a" * MIB)
        await never.wait()  # the daemon is killed mid-file

    call = client.stub.WriteFile(stream())
    await eventually(lambda: len(leftovers(root / "sub")) == 2)  # the daemon is writing it
    await daemon.kill()
    call.cancel()
    assert len(leftovers(root / "sub")) == 2  # nothing ended the write: its file is still there

    _, client = await make_daemon()
    await client.stub.ListFiles(pb.ListFilesRequest(project_id=PROJECT))  # serving: the start is done
    assert leftovers(root / "sub") == [f".rcoder-upload-{'0' * 32}.tmp"]  # a file no write noted stays
    assert not (root / "sub" / "big.bin").exists()


async def test_a_cancelled_write_removes_the_folders_it_made_and_only_those(
    make_daemon: DaemonFactory, tmp_path: Path
) -> None:
    root = project(tmp_path)
    (root / "kept").mkdir()
    (root / "via").symlink_to("kept")
    _, client = await make_daemon()
    never = asyncio.Event()

    # a folder of the project's own on the way stays, as does one reached through an inside link
    for path, made in (("new/deeper/f.bin", root / "new"), ("via/made/deeper/f.bin", root / "kept" / "made")):

        async def stream(path: str = path) -> AsyncIterator[pb.WriteFileChunk]:
            yield pb.WriteFileChunk(project_id=PROJECT, path=path, data=b"a" * MIB)
            await never.wait()  # the client goes away mid-file

        call = client.stub.WriteFile(stream())
        await eventually(partial(writing, made / "deeper"))
        call.cancel()
        await eventually(partial(gone, made))
        assert (root / "kept").is_dir() and (root / "via").is_symlink()
    assert sorted(p.name for p in root.iterdir()) == ["kept", "via"]
    assert list((root / "kept").iterdir()) == []


async def test_the_folders_a_write_cut_by_sigkill_made_are_removed_when_the_daemon_starts_again(
    make_daemon: DaemonFactory, tmp_path: Path
) -> None:
    root = project(tmp_path)
    (root / "sub").mkdir()
    daemon, client = await make_daemon()
    never = asyncio.Event()

    async def stream() -> AsyncIterator[pb.WriteFileChunk]:
        yield pb.WriteFileChunk(project_id=PROJECT, path="sub/made/deeper/big.bin", data=b"a" * MIB)
        await never.wait()  # the daemon is killed mid-file

    call = client.stub.WriteFile(stream())
    await eventually(lambda: writing(root / "sub" / "made" / "deeper"))
    await daemon.kill()
    call.cancel()
    (root / "sub" / "theirs").mkdir()  # made by someone else meanwhile: an empty folder no write noted

    _, client = await make_daemon()
    await client.stub.ListFiles(pb.ListFilesRequest(project_id=PROJECT))  # serving: the start is done
    assert sorted(p.name for p in (root / "sub").iterdir()) == ["theirs"]


async def test_a_write_into_a_folder_a_cancelled_write_made_and_removes_meanwhile_still_lands(
    make_daemon: DaemonFactory, tmp_path: Path
) -> None:
    """Writer A makes ``nN/`` and is cancelled, removing it, while writer B writes ``nN/b``: B makes
    the folder again rather than fail NOT_FOUND (made once only, 4 to 6 of 150 tries failed)."""
    root = project(tmp_path)
    _, client = await make_daemon()
    never = asyncio.Event()
    failed: list[str] = []
    for attempt in range(200):
        path = f"n{attempt}"

        async def cut(path: str = path) -> AsyncIterator[pb.WriteFileChunk]:
            yield pb.WriteFileChunk(project_id=PROJECT, path=f"{path}/a", data=b"a")
            await never.wait()  # cancelled below

        made = client.stub.WriteFile(cut())
        landing = asyncio.ensure_future(write(client, f"{path}/b", b"b"))
        # not a wait for anything: it spreads the cancel over the moments of B's folder and file
        await asyncio.sleep(0.001 * (attempt % 5))
        made.cancel()
        try:
            await landing
        except grpc.aio.AioRpcError as exc:
            failed.append(f"{path}: {exc.code().name} {exc.details()}")
    assert failed == []
    assert all((root / f"n{attempt}" / "b").read_bytes() == b"b" for attempt in range(200))

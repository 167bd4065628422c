"""``read_file_mb_per_s``: ReadFile of a 100 MiB file over loopback, in MB/s (docs/files.md).

Three ways to the same file's bytes, interleaved, each repetition read whole:

- a plain local read, 1 MiB at a time, with its SHA-256 (the least the daemon must do: it sends
  the file's SHA-256 in the first chunk): the disk and the CPU of this machine;
- a raw gRPC stream (``python scripts/bench_files.py serve FILE``, another process): a grpc.aio
  server that streams the file as ``FileChunk``s of 1 MiB and does nothing else, no hash: what
  grpcio's asyncio server and client cost here;
- the daemon's ``ReadFile``.

The line is the daemon's median MB/s (target >= 200); its ratio to the raw stream and to the local
read are in its details.

``files_fair`` (docs/files.md#pages, #fair-share), on a project of ``huge_folder_files`` files in
one folder:

- ``list_files_page_ms``: a ``ListFiles`` page of 1 entry, the first page and the one after it
  (its token), median in ms (target <= 50: a page costs what it lists; before the cursor, 2.5 s
  at 300,000 files);
- ``small_read_under_flood_ms``: another project's 16-byte ``ReadFile``, sent once the first of
  ``FLOOD`` ListFiles pages of 10,000 in the huge folder has answered, median in ms (target
  <= 1000; before the fair share, 16 s with 12 in flight); how many of the flood were still in
  flight when it completed is in its details.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import statistics
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_common import Bench, Result, judged

from rcoder.v1 import agent_runner_pb2 as pb

CHUNK = 1 << 20
RAW_METHOD = "/bench.Raw/Read"
PROJECT = "files-bench"
FLOOD = 12  # small_read_under_flood_ms: ListFiles pages of FLOOD_PAGE in flight at once
FLOOD_PAGE = 10_000


def local_read(path: Path) -> tuple[int, str]:
    digest, size = hashlib.sha256(), 0
    with path.open("rb", buffering=0) as fh:
        while data := fh.read(CHUNK):
            digest.update(data)
            size += len(data)
    return size, digest.hexdigest()


async def serve(path: Path) -> None:
    """The raw stream: every call streams ``path`` in ``FileChunk``s of 1 MiB."""

    async def read(_: bytes, context: Any) -> AsyncIterator[bytes]:
        with path.open("rb", buffering=0) as fh:
            offset = 0
            while data := await asyncio.to_thread(fh.read, CHUNK):
                yield pb.FileChunk(data=data, offset=offset).SerializeToString()
                offset += len(data)

    server = grpc.aio.server()
    handler = grpc.unary_stream_rpc_method_handler(read, request_deserializer=None, response_serializer=None)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("bench.Raw", {"Read": handler}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(f"port {port}", flush=True)
    await server.wait_for_termination()


@contextlib.asynccontextmanager
async def raw_server(path: Path) -> AsyncIterator[grpc.aio.Channel]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, __file__, "serve", str(path), stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 60)
        if not line.startswith(b"port "):
            raise RuntimeError(f"the raw stream server did not start (exit {await proc.wait()})")
        async with grpc.aio.insecure_channel(f"127.0.0.1:{int(line.split()[1])}") as channel:
            yield channel
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 9)
        await proc.wait()


async def _raw_read(channel: grpc.aio.Channel) -> int:
    call = channel.unary_stream(RAW_METHOD, request_serializer=None, response_deserializer=pb.FileChunk.FromString)
    size = 0
    async for chunk in call(b""):
        size += len(chunk.data)
    return size


async def _daemon_read(stub: Any, path: str) -> tuple[int, str]:
    size, sha = 0, ""
    async for chunk in stub.ReadFile(pb.ReadFileRequest(project_id=PROJECT, path=path), timeout=300):
        sha = sha or chunk.sha256
        size += len(chunk.data)
    return size, sha


async def read_file(bench: Bench) -> Result:

    size = bench.sizes.read_file_bytes
    folder = bench.workspace / PROJECT
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "big.bin"
    await asyncio.to_thread(path.write_bytes, os.urandom(size))
    expected = hashlib.sha256(path.read_bytes()).hexdigest()
    times: dict[str, list[float]] = {"local": [], "raw": [], "daemon": []}
    config = bench.config({"fake": bench.fake_profile()})
    async with bench.daemon(config) as (_, stub), raw_server(path) as channel:
        await _daemon_read(stub, "big.bin")  # warm: the page cache, the channel
        await _raw_read(channel)
        for _ in range(max(bench.sizes.reps, 1)):
            began = time.perf_counter()
            got = await asyncio.to_thread(local_read, path)
            times["local"].append(time.perf_counter() - began)
            began = time.perf_counter()
            raw = await _raw_read(channel)
            times["raw"].append(time.perf_counter() - began)
            began = time.perf_counter()
            read = await _daemon_read(stub, "big.bin")
            times["daemon"].append(time.perf_counter() - began)
            if got != (size, expected) or raw != size or read != (size, expected):
                raise RuntimeError(f"read back {read} / raw {raw} / local {got}, not ({size}, {expected})")
    rate = {key: size / statistics.median(values) / 1e6 for key, values in times.items()}
    what = f"ReadFile of a {size >> 20} MiB file over loopback (SHA-256 included), in MB/s"
    details = {
        "local_read_mb_per_s": rate["local"],
        "raw_grpc_mb_per_s": rate["raw"],
        "vs_raw_grpc": rate["daemon"] / rate["raw"],
        "vs_local_read": rate["daemon"] / rate["local"],
        "bytes": size,
        "reps": len(times["daemon"]),
    }
    return judged("read_file_mb_per_s", what, rate["daemon"], ">= 200", details)


def _fill(folder: Path, count: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for n in range(count):
            os.close(os.open(f"f{n:07d}", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd))
    finally:
        os.close(fd)


async def files_fair(bench: Bench) -> list[Result]:

    count = bench.sizes.huge_folder_files
    await asyncio.to_thread(_fill, bench.workspace / "files-huge" / "many", count)
    small = bench.workspace / "files-small"
    small.mkdir(parents=True, exist_ok=True)
    (small / "note.txt").write_bytes(b"sixteen bytes..\n")
    pages: list[float] = []
    reads: list[float] = []
    in_flight: list[int] = []
    config = bench.config({"fake": bench.fake_profile()})
    async with bench.daemon(config) as (_, stub):
        one = pb.ListFilesRequest(project_id="files-huge", path="many", page_size=1)
        await stub.ListFiles(one)  # warm: the channel, the folder's inodes
        for _ in range(max(bench.sizes.reps, 1)):
            began = time.perf_counter()
            first = await stub.ListFiles(one)
            pages.append(time.perf_counter() - began)
            after = pb.ListFilesRequest(project_id="files-huge", path="many", page_size=1,
                                        page_token=first.next_page_token)  # fmt: skip
            began = time.perf_counter()
            await stub.ListFiles(after)
            pages.append(time.perf_counter() - began)
        big = pb.ListFilesRequest(project_id="files-huge", path="many", page_size=FLOOD_PAGE)
        note = pb.ReadFileRequest(project_id="files-small", path="note.txt")
        for _ in range(max(bench.sizes.reps, 1)):
            flood = [asyncio.ensure_future(stub.ListFiles(big, timeout=600)) for _ in range(FLOOD)]
            try:
                await asyncio.wait(flood, return_when=asyncio.FIRST_COMPLETED)
                began = time.perf_counter()
                data = b"".join([chunk.data async for chunk in stub.ReadFile(note, timeout=600)])
                reads.append(time.perf_counter() - began)
                in_flight.append(sum(not call.done() for call in flood))
                if data != b"sixteen bytes..\n":
                    raise RuntimeError(f"read back {data!r}")
            finally:
                await asyncio.gather(*flood, return_exceptions=True)
    page_ms = statistics.median(pages) * 1e3
    read_ms = statistics.median(reads) * 1e3
    return [
        judged(
            "list_files_page_ms", f"a ListFiles page of 1 in a folder of {count} files (first and next), in ms",
            page_ms, "<= 50", {"files": count, "max_ms": max(pages) * 1e3, "pages": len(pages)},
        ),
        judged(
            "small_read_under_flood_ms",
            f"another project's 16-byte ReadFile while {FLOOD} ListFiles of {FLOOD_PAGE} in a folder of "
            f"{count} files are in flight, in ms",
            read_ms, "<= 1000",
            {"files": count, "max_ms": max(reads) * 1e3, "flood_in_flight_min": min(in_flight), "reps": len(reads)},
        ),
    ]  # fmt: skip


if __name__ == "__main__" and sys.argv[1:2] == ["serve"]:
    asyncio.run(serve(Path(sys.argv[2])))

"""Fair file RPCs (docs/files.md#fair-share, #pages): one tenant listing a huge folder from many
calls at once holds a bounded share of the file threads, so another project's small ``ReadFile``
is served while those listings are still in flight; and a listing's pages, each read from where
the page before stopped, give every entry once.

Ordering, not timing: the flood is known to be inside the daemon (its first call has answered)
before the small read is sent, and the read must complete while most of the flood has not.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from rcoder.v1 import agent_runner_pb2 as pb
from tests.conftest import DaemonFactory

HUGE = 40_000  # files in project A's folder
FLOOD = 24  # ListFiles of project A at once
PAGE = 10_000


def fill(folder: Path, count: int) -> None:
    folder.mkdir(parents=True)
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for n in range(count):
            os.close(os.open(f"f{n:06d}", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd))
    finally:
        os.close(fd)


async def test_another_projects_small_read_completes_while_one_tenant_floods_listings_of_a_huge_folder(
    make_daemon: DaemonFactory, tmp_path: Path
) -> None:
    await asyncio.to_thread(fill, tmp_path / "workspace" / "big", HUGE)
    small = tmp_path / "workspace" / "small"
    small.mkdir()
    (small / "note.txt").write_bytes(b"sixteen bytes..\n")
    _, client = await make_daemon()
    stub = client.stub
    request = pb.ListFilesRequest(project_id="big", page_size=PAGE)
    flood = [asyncio.ensure_future(stub.ListFiles(request, timeout=300)) for _ in range(FLOOD)]
    try:
        # the flood is in the daemon: one of its calls has answered, the others are in flight
        done, _ = await asyncio.wait(flood, return_when=asyncio.FIRST_COMPLETED)
        assert len(next(iter(done)).result().entries) == PAGE
        chunks = [c async for c in stub.ReadFile(pb.ReadFileRequest(project_id="small", path="note.txt"))]
        pending = sum(not call.done() for call in flood)
        assert b"".join(c.data for c in chunks) == b"sixteen bytes..\n"
        # before: all four shared threads queued the flood's pages first, and the read completed
        # after nearly all of them
        assert pending >= FLOOD // 2, f"only {pending} of {FLOOD} listings were still in flight"
    finally:
        await asyncio.gather(*flood, return_exceptions=True)
    assert all(len(call.result().entries) == PAGE for call in flood)


async def test_pages_of_a_folder_give_every_entry_once_and_resume_where_they_stopped(
    make_daemon: DaemonFactory, tmp_path: Path
) -> None:
    folder = tmp_path / "workspace" / "proj"
    await asyncio.to_thread(fill, folder / "many", 5_000)
    for name in ("a", "b/c", "b/d/e"):
        (folder / "tree" / name).mkdir(parents=True)
        (folder / "tree" / name / "x.txt").write_text(name)
    _, client = await make_daemon()

    async def pages(path: str, size: int, recursive: bool = False, added: Path | None = None) -> list[str]:
        paths, token = [], ""
        while True:
            request = pb.ListFilesRequest(
                project_id="proj", path=path, page_size=size, page_token=token, recursive=recursive
            )
            page = await client.stub.ListFiles(request)
            assert len(page.entries) <= size
            paths += [e.path for e in page.entries]
            if added is not None and page.next_page_token:
                (added / f"new{len(paths)}").touch()  # added meanwhile: may show or not, moves nothing
            token = page.next_page_token
            if not token:
                return paths

    whole = await pages("many", 10_000)
    assert sorted(whole) == sorted(f"many/f{n:06d}" for n in range(5_000))
    assert await pages("many", 7) == whole  # the same order, page after page
    grown = await pages("many", 333, added=folder / "many")
    assert set(whole) <= set(grown) and len(grown) == len(set(grown))  # none skipped, none twice
    tree = await pages("tree", 10_000, recursive=True)
    for size in (1, 2, 3):
        assert await pages("tree", size, recursive=True) == tree
    assert sorted(tree) == sorted(
        ["tree/a", "tree/a/x.txt", "tree/b", "tree/b/c", "tree/b/c/x.txt", "tree/b/d", "tree/b/d/e",
         "tree/b/d/e/x.txt"]
    )  # fmt: skip

"""What a rewind does to a file someone holds open (docs/checkpoints.md#rewind): a file the
rewind restores is unlinked and written anew, so a process that held the old one open (another
session's agent, a build watcher) goes on writing to the unlinked file, and those writes are lost;
a file the rewind leaves as it is stays the one the process writes."""

from __future__ import annotations

import os
from pathlib import Path

from rcoder.v1 import agent_runner_pb2 as pb
from tests.conftest import DaemonFactory
from tests.harness import completed


async def test_a_rewound_file_held_open_is_a_new_file_and_the_holders_later_writes_are_lost(
    make_daemon: DaemonFactory, tmp_path: Path
) -> None:
    project = tmp_path / "workspace" / "proj"
    project.mkdir(parents=True)
    (project / "notes.txt").write_text("v1\n")
    (project / "same.txt").write_text("left alone\n")
    _, client = await make_daemon()
    events = await client.chat(prompt="shell printf 'v2\\n' > notes.txt\nhello")
    assert [c.path for c in completed(events).changes] == ["notes.txt"]

    # the holder stands for another agent with both files open for appending across the rewind
    changed = os.open(project / "notes.txt", os.O_WRONLY | os.O_APPEND)
    kept = os.open(project / "same.txt", os.O_WRONLY | os.O_APPEND)
    try:
        await client.stub.RewindSession(
            pb.RewindSessionRequest(session_id=events[0].session_id, run_id=events[0].run_id)
        )
        os.write(changed, b"written after the rewind\n")
        os.write(kept, b"written after the rewind\n")
        held = os.fstat(changed)
        assert held.st_nlink == 0, "the old notes.txt is unlinked, not rewritten in place"
        assert os.stat(project / "notes.txt").st_ino != held.st_ino
        assert (project / "notes.txt").read_text() == "v1\n"  # the holder's write went nowhere
        assert os.fstat(kept).st_nlink == 1
        assert (project / "same.txt").read_text() == "left alone\nwritten after the rewind\n"
    finally:
        os.close(changed)
        os.close(kept)

"""Another session's work is never undone behind its back (docs/checkpoints.md#other-sessions-work):
a rewind that would change files a later run of another session wrote is refused, naming those
runs, unless the request takes them too; then that session's next turn and its runs say so."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from rcoder.v1 import agent_runner_pb2 as pb
from tests.conftest import DaemonFactory
from tests.harness import error_info, started


async def test_a_rewind_that_would_undo_another_session_s_run_is_refused_unless_it_takes_it_and_says_so(
    make_daemon: DaemonFactory, tmp_path: Path
) -> None:
    project = tmp_path / "workspace" / "proj"
    _, client = await make_daemon()
    a = await client.chat(prompt="shell echo feature > feature.py")
    session_a, turn_a = a[0].session_id, a[0].run_id
    b = await client.chat(prompt="remember 5")
    session_b = b[0].session_id
    b_turn = await client.chat(prompt="shell echo bugfix > bugfix.py && echo fixed >> feature.py", session_id=session_b)
    run_b = b_turn[0].run_id
    assert (project / "bugfix.py").exists()

    request = pb.RewindSessionRequest(session_id=session_a, run_id=turn_a)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await client.stub.RewindSession(request)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION, refused.value.details()
    info = error_info(refused.value)
    assert info.reason == "OTHER_SESSIONS_WORK"
    assert info.metadata["run_ids"] == run_b and info.metadata["session_ids"] == session_b
    assert run_b in refused.value.details()
    # refused before anything changed, and no run recorded
    assert (project / "bugfix.py").read_text() == "bugfix\n"
    assert (project / "feature.py").read_text() == "feature\nfixed\n"
    runs_a = await client.stub.ListRuns(pb.ListRunsRequest(session_id=session_a))
    assert [r.kind for r in runs_a.runs] == [pb.RUN_KIND_TURN]

    request = pb.RewindSessionRequest(session_id=session_a, run_id=turn_a, include_other_sessions=True)
    done = await client.stub.RewindSession(request)
    assert not (project / "feature.py").exists() and not (project / "bugfix.py").exists()
    assert {c.path for c in done.changes} == {"feature.py", "bugfix.py"}
    runs_b = await client.stub.ListRuns(pb.ListRunsRequest(session_id=session_b))
    assert {r.run_id: r.rewound_by for r in runs_b.runs} == {b[0].run_id: "", run_b: done.run_id}
    # B's next turn is told, by which run; the one after is not told again
    told = await client.chat(prompt="which?", session_id=session_b)
    assert done.run_id in started(told).fallback_reason, started(told)
    assert "rewound" in started(told).fallback_reason
    later = await client.chat(prompt="which?", session_id=session_b)
    assert started(later).fallback_reason == ""


async def test_another_session_s_runs_before_the_rewound_one_are_not_in_its_way(
    make_daemon: DaemonFactory, tmp_path: Path
) -> None:
    project = tmp_path / "workspace" / "proj"
    _, client = await make_daemon()
    await client.chat(prompt="shell echo notes > notes.md")  # session B, before A's turn: kept
    a = await client.chat(prompt="shell echo feature > feature.py && echo more >> notes.md")
    done = await client.stub.RewindSession(pb.RewindSessionRequest(session_id=a[0].session_id, run_id=a[0].run_id))
    assert {c.path for c in done.changes} == {"feature.py", "notes.md"}
    assert (project / "notes.md").read_text() == "notes\n" and not (project / "feature.py").exists()

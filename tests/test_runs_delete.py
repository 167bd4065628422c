"""ListRuns and DeleteSession against the real daemon, on both stores (SQLite and PostgreSQL):
a session's runs page oldest first with their prompts; a deleted session (a running turn
cancelled first) is unknown afterwards by every id, its agent ended, its forks left standing; and
the SQLite files no longer hold a deleted prompt once the daemon has stopped."""

from __future__ import annotations

import base64
from pathlib import Path

import grpc
import pytest

from rcoder.v1 import agent_runner_pb2 as pb
from tests.conftest import DaemonFactory
from tests.harness import Client, FakeAgentSetup, completed, error_info, processes_mentioning, started, text_of
from tests.turns import rest_of, start_turn


@pytest.fixture(params=["sqlite", "postgres"])
def store(request: pytest.FixtureRequest) -> dict[str, str]:
    """The daemon's store keys: SQLite in its data_dir, or a fresh PostgreSQL schema."""
    return {} if request.param == "sqlite" else {"store_url": str(request.getfixturevalue("pg_url"))}


async def status_of(call: object) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call  # type: ignore[misc]
    return caught.value.code()


async def list_runs(client: Client, session_id: str, page_size: int = 0, token: str = "") -> pb.ListRunsResponse:
    request = pb.ListRunsRequest(session_id=session_id, page_size=page_size, page_token=token)
    response: pb.ListRunsResponse = await client.stub.ListRuns(request)
    return response


async def test_runs_page_oldest_first_with_their_prompts_and_outcomes(
    make_daemon: DaemonFactory, store: dict[str, str]
) -> None:
    _, client = await make_daemon(**store)
    first = await client.chat(prompt="remember 1", request_id="req-1")
    session_id = first[0].session_id
    for n in range(2, 6):
        await client.chat(prompt=f"remember {n}", session_id=session_id)
    running, begin = await start_turn(client, prompt="hang", session_id=session_id)

    pages, token = [], ""
    while True:
        page = await list_runs(client, session_id, page_size=2, token=token)
        pages.append(page.runs)
        token = page.next_page_token
        if not token:
            break

    runs = [run for page in pages for run in page]
    assert [len(page) for page in pages] == [2, 2, 2]
    assert [r.prompt for r in runs] == ["remember 1", "remember 2", "remember 3", "remember 4", "remember 5", "hang"]
    assert [r.run_id for r in runs][-1] == begin.run_id
    assert all(r.session_id == session_id for r in runs)
    assert [r.started_at.ToDatetime() for r in runs] == sorted(r.started_at.ToDatetime() for r in runs)
    assert runs[0].resume == pb.RESUME_OUTCOME_NEW and runs[1].resume == pb.RESUME_OUTCOME_LIVE
    assert runs[0].request_id == "req-1" and runs[0].run_id == first[0].run_id
    assert all(r.status == pb.RUN_STATUS_COMPLETED and r.stop_reason == pb.STOP_REASON_END_TURN for r in runs[:5])
    assert all(r.HasField("ended_at") for r in runs[:5])
    # the running turn shows its prompt already, with no end
    assert runs[5].status == pb.RUN_STATUS_RUNNING and not runs[5].HasField("ended_at")
    assert runs[5].stop_reason == pb.STOP_REASON_UNSPECIFIED
    whole = await list_runs(client, session_id)
    assert [r.run_id for r in whole.runs] == [r.run_id for r in runs] and not whole.next_page_token

    await client.stub.Cancel(pb.CancelRequest(run_id=begin.run_id))
    assert completed(await rest_of(running)).stop_reason == pb.STOP_REASON_CANCELLED


async def test_bad_list_runs_requests_get_their_status(make_daemon: DaemonFactory) -> None:
    _, client = await make_daemon()
    one = (await client.chat(prompt="remember 1"))[0].session_id
    other = (await client.chat(prompt="remember 2"))[0].session_id
    await client.chat(prompt="remember 3", session_id=one)
    token = (await list_runs(client, one, page_size=1)).next_page_token
    assert token

    cases = [
        (pb.ListRunsRequest(), grpc.StatusCode.INVALID_ARGUMENT, "session_id"),
        (pb.ListRunsRequest(session_id="nope"), grpc.StatusCode.NOT_FOUND, ""),
        (pb.ListRunsRequest(session_id=one, page_size=1001), grpc.StatusCode.INVALID_ARGUMENT, "page_size"),
        (pb.ListRunsRequest(session_id="a b"), grpc.StatusCode.INVALID_ARGUMENT, "session_id"),
        (pb.ListRunsRequest(session_id=one, page_token="not a token"), grpc.StatusCode.INVALID_ARGUMENT, "page_token"),
        (pb.ListRunsRequest(session_id=other, page_token=token), grpc.StatusCode.INVALID_ARGUMENT, "page_token"),
        (
            pb.ListRunsRequest(session_id=one, page_token=base64.urlsafe_b64encode(b"runs [1, 2, 3]").decode()),
            grpc.StatusCode.INVALID_ARGUMENT,
            "page_token",
        ),
    ]
    for request, code, field in cases:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await client.stub.ListRuns(request)
        assert caught.value.code() == code, request
        if field:
            assert error_info(caught.value).metadata["field"] == field
    for delete, code in (
        (pb.DeleteSessionRequest(), grpc.StatusCode.INVALID_ARGUMENT),
        (pb.DeleteSessionRequest(session_id="nope"), grpc.StatusCode.NOT_FOUND),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await client.stub.DeleteSession(delete)
        assert caught.value.code() == code and error_info(caught.value).reason
    # the good token goes on with the same session
    rest = await list_runs(client, one, page_size=1, token=token)
    assert [r.prompt for r in rest.runs] == ["remember 3"] and not rest.next_page_token


async def test_delete_cancels_the_running_turn_ends_the_agent_and_forgets_every_id(
    make_daemon: DaemonFactory, fake: FakeAgentSetup, store: dict[str, str]
) -> None:
    _, client = await make_daemon(**store)
    first = await client.chat(prompt="remember 42")
    session_id = first[0].session_id
    running, begin = await start_turn(client, prompt="hang", session_id=session_id)
    assert processes_mentioning(str(fake.state_dir)), "the agent runs"

    answer: pb.DeleteSessionResponse = await client.stub.DeleteSession(pb.DeleteSessionRequest(session_id=session_id))

    assert answer.turn_cancelled and answer.agent_stopped
    assert (answer.runs, answer.transcript_entries) == (2, 2)  # the cancelled turn has its entry too
    # stored history: the first turn's started, text and completed, the cancelled one's started and completed
    assert answer.events >= 5, answer.events
    assert completed(await rest_of(running)).stop_reason == pb.STOP_REASON_CANCELLED
    assert not processes_mentioning(str(fake.state_dir)), "the agent was ended"
    assert len(answer.left) == 1 and "does not know where this agent keeps" in answer.left[0]
    stub = client.stub
    for call in (
        stub.GetSession(pb.GetSessionRequest(session_id=session_id)),
        stub.ListRuns(pb.ListRunsRequest(session_id=session_id)),
        stub.Cancel(pb.CancelRequest(session_id=session_id)),
        stub.CloseSession(pb.CloseSessionRequest(session_id=session_id)),
        stub.DeleteSession(pb.DeleteSessionRequest(session_id=session_id)),
        stub.Cancel(pb.CancelRequest(run_id=begin.run_id)),
    ):
        assert await status_of(call) == grpc.StatusCode.NOT_FOUND
    for run_id in (first[0].run_id, begin.run_id):
        assert await status_of(rest_of(stub.Subscribe(pb.SubscribeRequest(run_id=run_id)))) == grpc.StatusCode.NOT_FOUND
    listed = await stub.ListSessions(pb.ListSessionsRequest())
    assert session_id not in {s.session_id for s in listed.sessions}


async def test_a_fork_survives_the_deletion_of_its_source(make_daemon: DaemonFactory, store: dict[str, str]) -> None:
    _, client = await make_daemon(**store)
    first = await client.chat(prompt="remember 7")
    source = first[0].session_id
    forked = await client.stub.ForkSession(pb.ForkSessionRequest(session_id=source, project_id="proj"))
    branch = forked.session.session_id

    await client.stub.DeleteSession(pb.DeleteSessionRequest(session_id=source))

    assert (await client.stub.GetSession(pb.GetSessionRequest(session_id=branch))).session_id == branch
    on_branch = await client.chat(prompt="what number?", session_id=branch)
    assert text_of(on_branch) == "I remember: 7", "the branch kept its copy of the history"
    assert started(on_branch).resume == pb.RESUME_OUTCOME_FALLBACK_RESEEDED
    assert [r.prompt for r in (await list_runs(client, branch)).runs] == ["what number?"]


async def test_the_sqlite_files_no_longer_hold_a_deleted_prompt_once_the_daemon_stopped(
    make_daemon: DaemonFactory, tmp_path: Path
) -> None:
    daemon, client = await make_daemon()
    erased, kept = b"erase-me-7f3c1a9e-unique", b"keep-me-2b8d40c5-unique"
    doomed = (await client.chat(prompt=f"remember {erased.decode()}"))[0].session_id
    await client.chat(prompt="and again", session_id=doomed)
    await client.chat(prompt=f"remember {kept.decode()}")

    await client.stub.DeleteSession(pb.DeleteSessionRequest(session_id=doomed))
    await daemon.stop()

    files = sorted((tmp_path / "data").glob("rcoder.db*"))
    assert files, "the store's files"
    held = b"".join(path.read_bytes() for path in files)
    assert kept in held, "the grep finds text that was not deleted"
    assert erased not in held, [p.name for p in files if erased in p.read_bytes()]

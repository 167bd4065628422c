"""ForkSession: a branch shares the history so far, and later turns on either branch never reach
the other; through the agent's session/fork where it has one, re-seeded from the transcript where not."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from rcoder.session.resume.opening import CONTINUED, UNOPENED_BRANCH
from rcoder.v1 import agent_runner_pb2 as pb
from tests.conftest import DaemonFactory
from tests.harness import Client, FakeAgentSetup, completed, processes_mentioning, started, text_of
from tests.turns import read_until, rest_of, start_turn

FORKING = "resume,load,meta,close,fork"


def remembered(answer: str) -> set[str]:
    assert answer.startswith("I remember: "), answer
    return set(answer.removeprefix("I remember: ").split(", "))


async def fork(client: Client, session_id: str, project_id: str = "proj") -> pb.ForkSessionResponse:
    request = pb.ForkSessionRequest(session_id=session_id, project_id=project_id)
    response: pb.ForkSessionResponse = await client.stub.ForkSession(request, timeout=60)
    return response


async def fork_into(client: Client, session_id: str, agent: str) -> pb.ForkSessionResponse:
    request = pb.ForkSessionRequest(session_id=session_id, project_id="proj", agent=agent)
    response: pb.ForkSessionResponse = await client.stub.ForkSession(request, timeout=60)
    return response


async def test_a_fork_through_the_agent_is_live_and_the_branches_diverge(
    make_daemon: DaemonFactory, fake: FakeAgentSetup
) -> None:
    _, client = await make_daemon({"fake": fake.profile("--caps", FORKING)})
    first = await client.chat(prompt="remember 1")
    source = first[0].session_id

    forked = await fork(client, source)

    branch = forked.session.session_id
    assert forked.method == pb.FORK_METHOD_AGENT and not forked.fallback_reason
    assert branch != source and forked.session.project_id == "proj" and forked.session.agent == "fake"
    assert forked.session.status == pb.SESSION_STATUS_LIVE
    assert forked.session.provider_session_id not in {"", started(first).provider_session_id}
    assert [r["params"]["sessionId"] for r in fake.requests("session/fork")] == [started(first).provider_session_id]

    on_branch = await client.chat(prompt="remember 2", session_id=branch)
    assert started(on_branch).resume == pb.RESUME_OUTCOME_LIVE
    assert text_of(on_branch) == "I remember: 1, 2"
    on_source = await client.chat(prompt="remember 3", session_id=source)
    assert text_of(on_source) == "I remember: 1, 3"
    again = await client.chat(prompt="and now?", session_id=branch)
    assert text_of(again) == "I remember: 1, 2", "a turn on the source reached the branch"
    got = await client.stub.GetSession(pb.GetSessionRequest(session_id=branch))
    assert got.turns == 2 and got.provider_session_id == forked.session.provider_session_id


async def test_without_session_fork_the_branch_is_reseeded_from_the_transcript(
    make_daemon: DaemonFactory, fake: FakeAgentSetup
) -> None:
    _, client = await make_daemon()
    first = await client.chat(prompt="remember 1")
    source = first[0].session_id
    await client.chat(prompt="remember 2", session_id=source)

    forked = await fork(client, source)

    branch = forked.session.session_id
    assert forked.method == pb.FORK_METHOD_RESEEDED
    assert "session/fork" in forked.fallback_reason and "re-seeded" in forked.fallback_reason
    assert forked.session.provider_session_id == "" and forked.session.status == pb.SESSION_STATUS_IDLE
    assert not fake.requests("session/fork"), "an agent that does not advertise fork must not be asked"
    await client.chat(prompt="remember 3", session_id=source)  # after the fork: never on the branch

    on_branch = await client.chat(prompt="remember 4", session_id=branch)
    opened = started(on_branch)
    assert opened.resume == pb.RESUME_OUTCOME_FALLBACK_RESEEDED and opened.fallback_reason == UNOPENED_BRANCH
    assert text_of(on_branch) == "I remember: 1, 2, 4"
    assert opened.provider_session_id != started(first).provider_session_id

    # a fork of the branch holds the branch's history: the source's history before the first fork,
    # then the branch's own turns, and nothing the source said later
    second = await fork(client, branch)
    later = await client.chat(prompt="what?", session_id=second.session.session_id)
    # (the re-seed summary lists the newest turns first, so only the set is fixed)
    assert remembered(text_of(later)) == {"1", "2", "4"}


async def test_a_busy_session_is_forked_as_it_stands(make_daemon: DaemonFactory, fake: FakeAgentSetup) -> None:
    _, client = await make_daemon()
    source = (await client.chat(prompt="remember 1"))[0].session_id
    call, _ = await start_turn(client, prompt="remember 2 stream 1 hang", session_id=source)
    await read_until(call, "agent_message")

    forked = await fork(client, source)

    assert forked.method == pb.FORK_METHOD_RESEEDED
    await client.stub.Cancel(pb.CancelRequest(session_id=source), timeout=30)
    assert completed(await rest_of(call)).stop_reason == pb.STOP_REASON_CANCELLED
    on_branch = await client.chat(prompt="what?", session_id=forked.session.session_id)
    assert text_of(on_branch) == "I remember: 1", "the branch got what the running turn had not stored"


async def test_a_fork_the_agent_fails_falls_back_to_reseeding_and_says_why(
    make_daemon: DaemonFactory, fake: FakeAgentSetup
) -> None:
    # idle_timeout = 0: the fork runs in a new agent process, which finds no stored session
    _, client = await make_daemon({"fake": fake.profile("--caps", FORKING)}, idle_timeout=0)
    first = await client.chat(prompt="remember 1")
    (fake.state_dir / "sessions" / f"{started(first).provider_session_id}.json").unlink()

    forked = await fork(client, first[0].session_id)

    assert forked.method == pb.FORK_METHOD_RESEEDED
    assert "session/fork failed" in forked.fallback_reason, forked.fallback_reason
    assert len(fake.requests("session/fork")) == 1
    on_branch = await client.chat(prompt="what?", session_id=forked.session.session_id)
    assert started(on_branch).resume == pb.RESUME_OUTCOME_FALLBACK_RESEEDED
    assert text_of(on_branch) == "I remember: 1"


@pytest.mark.parametrize(
    ("session_id", "project_id", "code", "says"),
    [
        ("", "proj", grpc.StatusCode.INVALID_ARGUMENT, "session_id"),
        ("no-such-session", "proj", grpc.StatusCode.NOT_FOUND, "no-such-session"),
        ("KNOWN", "other", grpc.StatusCode.PERMISSION_DENIED, "another project"),
        ("KNOWN", "", grpc.StatusCode.INVALID_ARGUMENT, "project_id"),
        ("KNOWN", "../etc", grpc.StatusCode.INVALID_ARGUMENT, "project_id"),
    ],
)
async def test_a_bad_fork_request_is_refused_and_creates_nothing(
    make_daemon: DaemonFactory, session_id: str, project_id: str, code: grpc.StatusCode, says: str
) -> None:
    _, client = await make_daemon()
    known = (await client.chat(prompt="remember 1"))[0].session_id
    request = pb.ForkSessionRequest(session_id=known if session_id == "KNOWN" else session_id, project_id=project_id)

    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await client.stub.ForkSession(request, timeout=30)

    assert caught.value.code() == code and says in (caught.value.details() or "")
    listed = await client.stub.ListSessions(pb.ListSessionsRequest())
    assert [s.session_id for s in listed.sessions] == [known]


async def test_a_fork_whose_agent_is_still_opening_the_branch_at_shutdown_is_ended_by_the_daemon(
    make_daemon: DaemonFactory, fake: FakeAgentSetup, tmp_path: Path
) -> None:
    first_daemon, client = await make_daemon({"fake": fake.profile("--caps", FORKING)})
    source = (await client.chat(prompt="remember 1"))[0].session_id
    assert await first_daemon.stop() == 0
    # the same store, but its agents never answer session/fork (nor session/new): the fork's launch is held
    daemon, client = await make_daemon({"fake": fake.profile("--caps", FORKING, "--hang", "open")})
    forking = asyncio.create_task(fork(client, source))
    (spawned,) = await daemon.wait_log("agent_initialized", timeout=30)  # its session/fork is on its way

    assert await daemon.stop() == 0

    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await asyncio.wait_for(forking, 30)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE, caught.value
    # ended by the daemon before it exited (not by the kernel's parent-death signal after it)
    assert [r["pid"] for r in daemon.logs("agent_stopped")] == [spawned["pid"]], daemon.logs("agent_stopped")
    assert not [*(tmp_path / "data" / "agent-pids").glob("*")], "an agent's process group is still recorded"
    assert processes_mentioning(str(fake.state_dir)) == []


async def test_a_fork_into_another_agent_continues_the_conversation_there(
    make_daemon: DaemonFactory, fake: FakeAgentSetup
) -> None:
    # two profiles of the fake agent, told apart by what their environment says; both can fork,
    # and still no agent is asked to fork another's session
    profiles = {
        "first": fake.profile("--caps", FORKING, env={"WHO": "first"}),
        "second": fake.profile("--caps", FORKING, env={"WHO": "second"}),
    }
    _, client = await make_daemon(profiles, default_agent="first")
    source = (await client.chat(prompt="remember 1"))[0].session_id
    await client.chat(prompt="remember 2", session_id=source)

    forked = await fork_into(client, source, "second")

    branch = forked.session.session_id
    assert forked.method == pb.FORK_METHOD_RESEEDED and forked.session.agent == "second"
    assert "continued from another agent" in forked.fallback_reason, forked.fallback_reason
    assert not fake.requests("session/fork")
    on_branch = await client.chat(prompt="remember 3 env WHO", session_id=branch)
    opened = started(on_branch)
    assert opened.resume == pb.RESUME_OUTCOME_FALLBACK_RESEEDED and opened.agent == "second"
    assert opened.fallback_reason == CONTINUED
    assert text_of(on_branch) == "I remember: 1, 2, 3 env[WHO]=second"
    prompts = [r["params"]["prompt"][0]["text"] for r in fake.requests("session/prompt")]
    assert "another agent (profile 'first')" in prompts[-1], prompts[-1][:300]
    later = await client.chat(prompt="what? env WHO", session_id=branch)  # its next turn: live on "second"
    assert started(later).agent == "second" and started(later).resume == pb.RESUME_OUTCOME_LIVE
    assert text_of(later) == "I remember: 1, 2, 3 env[WHO]=second"
    await client.stub.CloseSession(pb.CloseSessionRequest(session_id=branch), timeout=30)
    resumed = await client.chat(prompt="what? env WHO", session_id=branch)  # a new process: "second" again
    assert started(resumed).agent == "second" and started(resumed).resume == pb.RESUME_OUTCOME_RESUMED
    assert text_of(resumed) == "I remember: 1, 2, 3 env[WHO]=second"
    on_source = await client.chat(prompt="what? env WHO", session_id=source)
    assert text_of(on_source) == "I remember: 1, 2 env[WHO]=first", "the branch's turns reached the source"
    wrong = await client.chat_error(prompt="hi", session_id=branch, agent="first")
    assert wrong.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_a_fork_into_an_unknown_agent_is_invalid_argument(make_daemon: DaemonFactory) -> None:
    _, client = await make_daemon()
    source = (await client.chat(prompt="remember 1"))[0].session_id
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await fork_into(client, source, "nobody")
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "no agent profile named 'nobody'" in (caught.value.details() or "")

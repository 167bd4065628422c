"""Chat end to end: new sessions, live reuse, resume by every route, fallback, restarts."""

from __future__ import annotations

import asyncio

import pytest

from rcoder.v1 import agent_runner_pb2 as pb
from tests.conftest import DaemonFactory
from tests.harness import FakeAgentSetup, completed, started, text_of


async def test_a_new_session_streams_started_first_and_completed_last(make_daemon: DaemonFactory) -> None:
    _, client = await make_daemon()
    events = await client.chat(prompt="remember 42 stream 3")

    kinds = [e.WhichOneof("event") for e in events]
    assert kinds[0] == "started" and kinds[-1] == "completed"
    assert kinds.count("started") == 1 and kinds.count("completed") == 1
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    assert {e.run_id for e in events} == {events[0].run_id}
    first = started(events)
    assert first.resume == pb.RESUME_OUTCOME_NEW
    assert first.resume_method == "new"
    assert first.agent == "fake"
    assert first.provider_session_id.startswith("fake-")
    assert events[0].session_id and events[0].session_id != first.provider_session_id
    assert completed(events).stop_reason == pb.STOP_REASON_END_TURN
    assert completed(events).provider_session_id == first.provider_session_id
    assert text_of(events) == "c0 c1 c2 I remember: 42"


async def test_a_second_turn_on_the_live_agent_remembers(make_daemon: DaemonFactory, fake: FakeAgentSetup) -> None:
    _, client = await make_daemon()
    first = await client.chat(prompt="remember 42")
    second = await client.chat(prompt="what number?", session_id=first[0].session_id)

    assert started(second).resume == pb.RESUME_OUTCOME_LIVE
    assert second[0].session_id == first[0].session_id
    assert text_of(second) == "I remember: 42"
    assert len(fake.pids()) == 1, "a live turn must not start another agent"


@pytest.mark.parametrize(
    ("caps", "route"),
    [("resume", "resume"), ("load", "load"), ("meta", "meta"), ("resume,load,meta", "resume")],
)
async def test_the_returned_session_id_resumes_on_a_new_agent_by_the_advertised_route(
    make_daemon: DaemonFactory, fake: FakeAgentSetup, caps: str, route: str
) -> None:
    # idle_timeout = 0 closes the agent right after each turn, so the next one must resume
    _, client = await make_daemon({"fake": fake.profile("--caps", caps)}, idle_timeout=0)
    first = await client.chat(prompt="remember 42")
    second = await client.chat(prompt="what number?", session_id=first[0].session_id)

    assert started(second).resume == pb.RESUME_OUTCOME_RESUMED, started(second)
    assert started(second).resume_method == route
    assert second[0].session_id == first[0].session_id
    assert started(second).provider_session_id == started(first).provider_session_id
    assert text_of(second) == "I remember: 42"
    assert len(fake.pids()) == 2


@pytest.mark.parametrize("route", ["resume", "load", "meta"])
async def test_a_profile_can_force_the_resume_route(
    make_daemon: DaemonFactory, fake: FakeAgentSetup, route: str
) -> None:
    _, client = await make_daemon({"fake": fake.profile(resume=route)}, idle_timeout=0)
    first = await client.chat(prompt="remember 7")
    second = await client.chat(prompt="and?", session_id=first[0].session_id)

    assert started(second).resume_method == route
    assert text_of(second) == "I remember: 7"
    provider_id = started(first).provider_session_id
    if route == "meta":
        params = fake.requests("session/new")[-1]["params"]
        assert params["_meta"]["claudeCode"]["options"]["resume"] == provider_id
    else:
        assert fake.requests(f"session/{route}")[-1]["params"]["sessionId"] == provider_id


async def test_a_load_replay_is_history_not_output_of_the_new_turn(
    make_daemon: DaemonFactory, fake: FakeAgentSetup
) -> None:
    _, client = await make_daemon({"fake": fake.profile("--caps", "load")}, idle_timeout=0)
    first = await client.chat(prompt="remember 5")
    second = await client.chat(prompt="again", session_id=first[0].session_id)

    assert started(second).resume_method == "load"
    assert text_of(second) == "I remember: 5"


async def test_the_session_resumes_after_the_daemon_restarts(make_daemon: DaemonFactory) -> None:
    daemon, client = await make_daemon()
    first = await client.chat(prompt="remember 42")
    assert await daemon.stop() == 0

    _, client2 = await make_daemon()
    second = await client2.chat(prompt="what number?", session_id=first[0].session_id)

    assert started(second).resume == pb.RESUME_OUTCOME_RESUMED
    assert second[0].session_id == first[0].session_id
    assert text_of(second) == "I remember: 42"


async def test_the_agent_is_asked_to_resume_the_providers_id_never_rcoders(
    make_daemon: DaemonFactory, fake: FakeAgentSetup
) -> None:
    _, client = await make_daemon(idle_timeout=0)
    first = await client.chat(prompt="remember 1")
    await client.chat(prompt="again", session_id=first[0].session_id)

    provider_id = started(first).provider_session_id
    resumes = fake.requests("session/resume")
    assert [r["params"]["sessionId"] for r in resumes] == [provider_id]
    rcoder_ids = {first[0].session_id, first[0].run_id}
    for message in fake.requests():
        text = str(message)
        assert not any(i in text for i in rcoder_ids), f"rcoder's own id reached the agent: {message}"


@pytest.mark.parametrize("gone_style", ["32002", "32603", "exit"])
@pytest.mark.parametrize("caps", ["resume", "load", "meta"])
async def test_an_unknown_session_falls_back_to_a_new_one_and_says_why(
    make_daemon: DaemonFactory, fake: FakeAgentSetup, caps: str, gone_style: str
) -> None:
    _, client = await make_daemon({"fake": fake.profile("--caps", caps, "--gone-style", gone_style)})
    events = await client.chat(prompt="remember 3", session_id="no-such-session")

    begin = started(events)
    assert begin.resume == pb.RESUME_OUTCOME_FALLBACK_NEW
    assert begin.resume_method == "new"
    expected = {"32002": "-32002", "32603": "Session not found", "exit": "No conversation found"}[gone_style]
    assert expected in begin.fallback_reason
    assert events[0].session_id not in {"", "no-such-session"}
    assert begin.provider_session_id != "no-such-session"
    assert completed(events).stop_reason == pb.STOP_REASON_END_TURN
    assert text_of(events) == "I remember: 3"


async def test_a_known_session_the_agent_lost_is_reseeded_from_the_transcript(
    make_daemon: DaemonFactory, fake: FakeAgentSetup
) -> None:
    _, client = await make_daemon(idle_timeout=0)
    first = await client.chat(prompt="remember 42")
    for path in (fake.state_dir / "sessions").iterdir():
        path.unlink()  # the agent's own store is wiped

    second = await client.chat(prompt="what number?", session_id=first[0].session_id)

    begin = started(second)
    assert begin.resume == pb.RESUME_OUTCOME_FALLBACK_RESEEDED
    assert "-32002" in begin.fallback_reason
    assert second[0].session_id == first[0].session_id
    assert begin.provider_session_id != started(first).provider_session_id
    assert text_of(second) == "I remember: 42", "the re-seed carried the earlier turn"
    session = await client.stub.GetSession(pb.GetSessionRequest(session_id=first[0].session_id))
    assert session.provider_session_id == begin.provider_session_id
    assert session.turns == 2


async def test_without_reseeding_a_lost_session_falls_back_to_a_blank_one(
    make_daemon: DaemonFactory, fake: FakeAgentSetup
) -> None:
    _, client = await make_daemon(idle_timeout=0, reseed_on_fallback=False)
    first = await client.chat(prompt="remember 42")
    for path in (fake.state_dir / "sessions").iterdir():
        path.unlink()

    second = await client.chat(prompt="what number?", session_id=first[0].session_id)

    assert started(second).resume == pb.RESUME_OUTCOME_FALLBACK_NEW
    assert text_of(second) == "I remember nothing."


async def test_an_adopted_provider_id_is_resumed_and_gets_an_rcoder_session(
    make_daemon: DaemonFactory, fake: FakeAgentSetup
) -> None:
    _, client = await make_daemon(idle_timeout=0)
    first = await client.chat(prompt="remember 9")
    provider_id = started(first).provider_session_id
    # forget rcoder's record of it: a second daemon with a fresh store, same agent state
    _, other = await make_daemon(data_dir=str(fake.root / "other-data"))
    events = await other.chat(prompt="what?", session_id=provider_id)

    assert started(events).resume == pb.RESUME_OUTCOME_RESUMED
    assert events[0].session_id not in {provider_id, first[0].session_id}
    assert text_of(events) == "I remember: 9"


async def test_two_sessions_driven_concurrently_never_cross(make_daemon: DaemonFactory, fake: FakeAgentSetup) -> None:
    _, client = await make_daemon(idle_timeout=0)
    a1, b1 = await asyncio.gather(
        client.chat(prompt="remember 11 stream 20"), client.chat(prompt="remember 22 stream 20")
    )
    a2, b2 = await asyncio.gather(
        client.chat(prompt="which? stream 5", session_id=a1[0].session_id),
        client.chat(prompt="which? stream 5", session_id=b1[0].session_id),
    )

    assert text_of(a2).endswith("I remember: 11")
    assert text_of(b2).endswith("I remember: 22")
    for first, second in ((a1, a2), (b1, b2)):
        record = await client.stub.GetSession(pb.GetSessionRequest(session_id=first[0].session_id))
        assert record.provider_session_id == started(first).provider_session_id == started(second).provider_session_id
    assert started(a1).provider_session_id != started(b1).provider_session_id


async def test_a_replay_after_the_load_answer_that_stalls_never_leaks_into_the_new_turn(
    make_daemon: DaemonFactory, fake: FakeAgentSetup
) -> None:
    # Gemini's order: session/load is answered, then the history streams; this one stalls for
    # 1.5 s (three times the quiet window the end of a replay was once guessed by) before the
    # last answer. rcoder knows the replay is over by seeing the last turn it recorded.
    flags = ("--caps", "load", "--replay-after-response", "--replay-pause", "1500")
    daemon, client = await make_daemon({"fake": fake.profile(*flags, kind="gemini")})
    first = await client.chat(prompt="remember 42")
    await client.chat(prompt="remember 7", session_id=first[0].session_id)
    await client.stub.CloseSession(pb.CloseSessionRequest(session_id=first[0].session_id))

    again = await client.chat(prompt="what number?", session_id=first[0].session_id)
    assert started(again).resume_method == "load"
    (over,) = await daemon.wait_log("session_replay_over")
    assert over["known_by"] == "recognised"
    assert text_of(again) == "I remember: 42, 7", "no history in the new turn"

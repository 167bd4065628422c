"""Chat end to end with an agent that advertises ``session/list``: a session it lists is resumed;
one it does not list falls back at once (re-seeded when rcoder knows it), spending no resume."""

from __future__ import annotations

from rcoder.v1 import agent_runner_pb2 as pb
from tests.conftest import DaemonFactory
from tests.harness import FakeAgentSetup, started, text_of

NOT_LISTED = "is not in the agent's session list"


def resumes(fake: FakeAgentSetup) -> list[str]:
    return [r["params"]["sessionId"] for r in fake.requests("session/resume") + fake.requests("session/load")]


async def test_a_session_the_agent_lists_is_resumed(make_daemon: DaemonFactory, fake: FakeAgentSetup) -> None:
    # idle_timeout = 0: the agent is closed after each turn, so the next one resumes
    _, client = await make_daemon({"fake": fake.profile("--caps", "resume,list")}, idle_timeout=0)
    first = await client.chat(prompt="remember 42")
    second = await client.chat(prompt="what number?", session_id=first[0].session_id)

    assert started(second).resume == pb.RESUME_OUTCOME_RESUMED
    assert text_of(second) == "I remember: 42"
    assert resumes(fake) == [started(first).provider_session_id]
    (listing,) = fake.requests("session/list")
    assert listing["params"]["cwd"] == fake.requests("session/resume")[0]["params"]["cwd"]


async def test_a_known_session_the_agent_no_longer_lists_is_reseeded_without_a_resume(
    make_daemon: DaemonFactory, fake: FakeAgentSetup
) -> None:
    _, client = await make_daemon({"fake": fake.profile("--caps", "resume,load,list")}, idle_timeout=0)
    first = await client.chat(prompt="remember 42")
    provider_id = started(first).provider_session_id
    for path in (fake.state_dir / "sessions").iterdir():
        path.unlink()  # the agent's own store is wiped: it lists nothing now
    second = await client.chat(prompt="what number?", session_id=first[0].session_id)

    begin = started(second)
    assert begin.resume == pb.RESUME_OUTCOME_FALLBACK_RESEEDED, begin
    assert begin.resume_method == "new"
    assert NOT_LISTED in begin.fallback_reason and provider_id in begin.fallback_reason
    assert text_of(second) == "I remember: 42", "re-seeded from rcoder's transcript"
    assert not resumes(fake), "no resume was spent on the lost session"
    assert len(fake.requests("session/list")) == 1


async def test_an_unknown_session_id_the_agent_does_not_list_starts_one_agent_and_a_new_session(
    make_daemon: DaemonFactory, fake: FakeAgentSetup
) -> None:
    _, client = await make_daemon({"fake": fake.profile("--caps", "resume,list")})
    events = await client.chat(prompt="remember 3", session_id="no-such-session")

    begin = started(events)
    assert begin.resume == pb.RESUME_OUTCOME_FALLBACK_NEW
    assert NOT_LISTED in begin.fallback_reason and "'no-such-session'" in begin.fallback_reason
    assert text_of(events) == "I remember: 3"
    assert not resumes(fake)
    assert len(fake.pids()) == 1, "the fallback opened on the agent that listed"

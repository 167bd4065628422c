"""``rcoder chat --session`` never surprises (docs/clients.md#continuing-a-session): an id the daemon has no
record of is said loudly before the turn, or refused with ``--known-session``; the turn runs on the
session's own agent, found by rcoder's id or the agent's. A real daemon, ``rcoder`` as a person runs it."""

from __future__ import annotations

from typing import Any

from rcoder.v1 import agent_runner_pb2 as pb
from tests.conftest import DaemonFactory
from tests.harness import Daemon, FakeAgentSetup, started
from tests.test_client_cli import SUMMARY, rcoder, terminal  # noqa: F401 (terminal: the fixture)

WARNING = "rcoder: WARNING: not a session of this daemon: resuming no-such-session as the agent's own id, on fake"


def target(daemon: Daemon) -> tuple[str, ...]:
    return ("--target", daemon.address, "--config", str(daemon.config))


async def test_an_id_the_daemon_has_no_record_of_is_said_loudly_before_the_turn(make_daemon: DaemonFactory) -> None:
    daemon, _ = await make_daemon()

    code, out, err = await rcoder("chat", "--project", "demo", "--session", "no-such-session", *target(daemon), "hi")
    assert code == 0, err
    assert err.splitlines()[0].startswith(WARNING), err
    assert "(a new rcoder session; --known-session refuses instead)" in err.splitlines()[0]
    assert out.strip(), "the turn ran"


async def test_with_known_session_an_unknown_id_is_an_error_and_no_turn_runs(
    make_daemon: DaemonFactory, fake: FakeAgentSetup
) -> None:
    daemon, client = await make_daemon()

    code, out, err = await rcoder(
        "chat", "--project", "demo", "--session", "no-such-session", "--known-session", *target(daemon), "hi"
    )
    assert code == 1 and out == ""
    assert err.startswith("rcoder: not a session of this daemon: no-such-session (--known-session;"), err
    assert not (await client.stub.ListSessions(pb.ListSessionsRequest())).sessions
    assert not fake.requests(), "no agent was started"


async def test_a_known_session_runs_on_its_own_agent_with_no_warning(
    make_daemon: DaemonFactory, fake: FakeAgentSetup
) -> None:
    daemon, client = await make_daemon({"fake": fake.profile(), "other": fake.profile()})
    first = await client.chat(project_id="demo", prompt="remember 7", agent="other")
    session_id = first[0].session_id

    code, out, err = await rcoder(
        "chat", "--project", "demo", "--session", session_id, "--known-session", *target(daemon), "what number?"
    )
    assert code == 0, err
    assert "WARNING" not in err and out.strip() == "I remember: 7"
    match = SUMMARY.search(err)
    assert match is not None and match.group(1) == session_id


async def test_the_agents_own_id_of_a_known_session_continues_it_on_that_sessions_agent(
    make_daemon: DaemonFactory, fake: FakeAgentSetup
) -> None:
    daemon, client = await make_daemon({"fake": fake.profile(), "other": fake.profile()})
    first = await client.chat(project_id="demo", prompt="remember 8", agent="other")
    provider_id = started(first).provider_session_id

    code, out, err = await rcoder("chat", "--project", "demo", "--session", provider_id, *target(daemon), "number?")
    assert code == 0, err
    assert f"rcoder: {provider_id} is agent other's id of session {first[0].session_id}" in err
    match = SUMMARY.search(err)
    assert match is not None and match.group(1) == first[0].session_id, err  # not a new session on the default
    assert out.strip() == "I remember: 8"


async def test_at_the_terminal_an_unknown_id_is_asked_its_prompt_then_said_loudly(
    make_daemon: DaemonFactory,
    terminal: Any,  # noqa: F811 (the fixture imported above)
) -> None:
    daemon, _ = await make_daemon()

    term = await terminal(daemon, "chat", "--project", "demo", "--session", "no-such-session")
    await term.expect("> ")  # its slash commands are none: it is not refused for that
    term.type(b"hi\r")
    await term.expect(WARNING)
    await term.expect(SUMMARY.pattern)
    assert await term.exit_code() == 0

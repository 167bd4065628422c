"""A session's config options and slash commands through ACP (issue 26): set before the prompt,
checked against what the agent offers, kept with the session and set again in a new agent process,
reported in RunStarted, GetSession and typed events. The fake agent records what reached it."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from rcoder.client import (
    AvailableCommands,
    ConfigOptionUpdate,
    InvalidArgument,
    RcoderClient,
    SlashCommand,
    Started,
)
from rcoder.v1 import agent_runner_pb2 as pb
from tests.conftest import DaemonFactory
from tests.harness import Client, FakeAgentSetup, completed, error_info, started, text_of

OPTIONS = ("--offer", "options")


def offered(events: list[pb.ChatStream]) -> dict[str, pb.ConfigOption]:
    return {o.id: o for o in started(events).config_options}


def sets(fake: FakeAgentSetup, method: str = "session/set_config_option") -> list[dict[str, Any]]:
    return [m["params"] for m in fake.requests(method)]


async def show(client: Client, session_id: str = "", agent: str = "", **options: str) -> list[pb.ChatStream]:
    events = await client.chat(prompt="show-options", session_id=session_id, agent=agent, config_options=options)
    assert completed(events).stop_reason == pb.STOP_REASON_END_TURN, completed(events)
    return events


async def test_options_differing_from_the_agents_are_set_before_the_prompt_and_the_same_ones_are_not_sent(
    make_daemon: DaemonFactory, fake: FakeAgentSetup
) -> None:
    _, client = await make_daemon({"fake": fake.profile(*OPTIONS)})

    first = await show(client, model="fake-large", mode="code")  # code is the agent's default already
    assert text_of(first).endswith("options[model=fake-large mode=code]")
    assert [(p["configId"], p["value"]) for p in sets(fake)] == [("model", "fake-large")]
    methods = [m.get("method") for m in fake.requests() if m.get("method", "").startswith("session/")]
    assert methods.index("session/set_config_option") < methods.index("session/prompt")
    options = offered(first)
    assert options["model"].current_value == "fake-large" and options["model"].chosen
    assert options["model"].category == "model" and options["model"].type == "select"
    values = [(v.value, v.name) for v in options["model"].values]
    assert values == [("fake-small", "Fake small"), ("fake-large", "Fake large")]
    assert options["mode"].current_value == "code" and options["mode"].chosen
    assert [v.value for v in options["mode"].values] == ["ask", "code", "plan"]

    # on the live agent: the same value is not sent again, a new one is
    session_id = first[0].session_id
    second = await show(client, session_id, model="fake-large")
    assert started(second).resume == pb.RESUME_OUTCOME_LIVE
    assert len(sets(fake)) == 1
    third = await show(client, session_id, mode="plan")
    assert text_of(third).endswith("options[model=fake-large mode=plan]")
    assert [(p["configId"], p["value"]) for p in sets(fake)][1:] == [("mode", "plan")]
    assert offered(third)["mode"].current_value == "plan"

    session = await client.stub.GetSession(pb.GetSessionRequest(session_id=session_id))
    assert {o.id: (o.current_value, o.chosen) for o in session.config_options} == {
        "model": ("fake-large", True),
        "mode": ("plan", True),
    }


async def test_a_value_or_an_id_the_agent_does_not_offer_is_invalid_argument_and_no_prompt_reaches_it(
    make_daemon: DaemonFactory, fake: FakeAgentSetup
) -> None:
    _, client = await make_daemon({"fake": fake.profile(*OPTIONS)})

    # a new session: the agent is opened to know what it offers, and nothing is set or prompted
    error = await client.chat_error(prompt="hello", config_options={"model": "gpt-9", "mode": "plan"})
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "config_options.model" in error.details() and "values offered: fake-small, fake-large" in error.details()
    assert error_info(error).reason == "CONFIG_VALUE_UNKNOWN"
    assert fake.requests("session/new") and not fake.requests("session/prompt")
    assert not sets(fake)

    events = await show(client)  # the live session of a turn that works
    session_id = events[0].session_id
    prompts = len(fake.requests("session/prompt"))
    error = await client.chat_error(prompt="hello", session_id=session_id, config_options={"temperature": "1"})
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "config option 'temperature'" in error.details() and "it offers: model, mode" in error.details()
    assert error_info(error).reason == "CONFIG_OPTION_UNKNOWN"
    error = await client.chat_error(
        prompt="hello", session_id=session_id, config_options={"model": "fake-large", "mode": "sleepy"}
    )
    assert "values offered: ask, code, plan" in error.details()
    assert len(fake.requests("session/prompt")) == prompts and not sets(fake)  # not even the valid one

    # the session is unharmed: still live, still at its values
    after = await show(client, session_id)
    assert started(after).resume == pb.RESUME_OUTCOME_LIVE
    assert text_of(after).endswith("options[model=fake-small mode=code]")


async def test_an_agent_without_options_refuses_any_with_invalid_argument(
    make_daemon: DaemonFactory, fake: FakeAgentSetup
) -> None:
    _, client = await make_daemon()
    events = await client.chat(prompt="hello")
    assert not started(events).config_options
    error = await client.chat_error(prompt="hello", session_id=events[0].session_id, config_options={"model": "x"})
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "it offers: none" in error.details()


async def test_chosen_options_are_set_again_in_a_new_agent_process_after_an_eviction_and_a_restart(
    make_daemon: DaemonFactory, fake: FakeAgentSetup
) -> None:
    daemon, client = await make_daemon({"fake": fake.profile(*OPTIONS)}, idle_timeout=0)  # every turn a new process
    first = await show(client, model="fake-large", mode="plan")
    session_id = first[0].session_id

    second = await show(client, session_id)  # no options asked: the chosen ones are set again
    assert started(second).resume == pb.RESUME_OUTCOME_RESUMED
    assert text_of(second).endswith("options[model=fake-large mode=plan]")
    assert len(fake.pids()) >= 2
    assert [(p["configId"], p["value"]) for p in sets(fake)] == [("mode", "plan"), ("model", "fake-large")] * 2  # by id

    # the agent leaves plan mode itself: the session keeps what the agent says, not the first choice
    moved = await client.chat(prompt="agent-mode ask", session_id=session_id)
    assert completed(moved).stop_reason == pb.STOP_REASON_END_TURN
    assert await daemon.stop() == 0

    _, client = await make_daemon({"fake": fake.profile(*OPTIONS)}, idle_timeout=0)
    stored = await client.stub.GetSession(pb.GetSessionRequest(session_id=session_id))
    assert {o.id: o.current_value for o in stored.config_options} == {"model": "fake-large", "mode": "ask"}
    third = await show(client, session_id, model="fake-small")  # the request's value over the stored one
    assert started(third).resume == pb.RESUME_OUTCOME_RESUMED
    assert text_of(third).endswith("options[model=fake-small mode=ask]")
    assert [(p["configId"], p["value"]) for p in sets(fake)][-1:] == [("mode", "ask")]  # model: the default


async def test_an_agent_with_modes_only_gets_mode_through_set_mode(
    make_daemon: DaemonFactory, fake: FakeAgentSetup
) -> None:
    _, client = await make_daemon({"fake": fake.profile("--offer", "modes")}, idle_timeout=0)
    first = await show(client, mode="plan")
    assert text_of(first).endswith("mode=plan]")
    assert [(p["modeId"]) for p in sets(fake, "session/set_mode")] == ["plan"]
    assert not sets(fake)
    mode = offered(first)["mode"]
    assert (mode.type, mode.category, mode.current_value, mode.chosen) == ("mode", "mode", "plan", True)
    assert list(offered(first)) == ["mode"]

    second = await show(client, first[0].session_id)  # a new process: set again, by set_mode
    assert text_of(second).endswith("mode=plan]")
    assert len(sets(fake, "session/set_mode")) == 2

    error = await client.chat_error(prompt="hi", session_id=first[0].session_id, config_options={"model": "x"})
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "it offers: mode" in error.details()


@pytest.mark.parametrize("offer", ["options", "modes"])
async def test_the_agent_changing_its_options_is_a_typed_event(
    make_daemon: DaemonFactory, fake: FakeAgentSetup, offer: str
) -> None:
    _, client = await make_daemon({"fake": fake.profile("--offer", offer)})
    events = await client.chat(prompt="agent-mode plan")
    updates = [e.config_option_update for e in events if e.WhichOneof("event") == "config_option_update"]
    assert len(updates) == 1
    assert {o.id: o.current_value for o in updates[0].config_options}["mode"] == "plan"
    session = await client.stub.GetSession(pb.GetSessionRequest(session_id=events[0].session_id))
    assert {o.id: o.current_value for o in session.config_options}["mode"] == "plan"


async def test_slash_commands_are_a_typed_event_and_getsession_keeps_the_last_list(
    make_daemon: DaemonFactory, fake: FakeAgentSetup
) -> None:
    daemon, client = await make_daemon(
        {"early": fake.profile("--commands-at-open"), "fake": fake.profile()}, idle_timeout=0
    )
    # listed just after session/new, before any prompt: the first turn's stream tells them
    early = await client.chat(prompt="hello", agent="early")
    kinds = [e.WhichOneof("event") for e in early]
    assert kinds.count("available_commands") == 1 and kinds.index("available_commands") == 1, kinds
    listed = next(e.available_commands for e in early if e.WhichOneof("event") == "available_commands")
    assert [(c.name, c.description, c.input_hint) for c in listed.commands] == [
        ("review", "Review the changes", "what to review"),
        ("compact", "Compact the conversation", ""),
    ]

    # listed during a turn
    events = await client.chat(prompt="commands")
    assert [e.WhichOneof("event") for e in events].count("available_commands") == 1
    assert await daemon.stop() == 0
    _, client = await make_daemon({"fake": fake.profile()})
    for session_id in (early[0].session_id, events[0].session_id):
        session = await client.stub.GetSession(pb.GetSessionRequest(session_id=session_id))
        assert [c.name for c in session.commands] == ["review", "compact"]
        assert session.commands[0].input_hint == "what to review"


async def test_the_config_options_map_is_bounded(make_daemon: DaemonFactory, fake: FakeAgentSetup) -> None:
    _, client = await make_daemon()
    cases: list[tuple[dict[str, str], str]] = [
        ({f"o{i}": "v" for i in range(33)}, "at most 32 options"),
        ({"": "v"}, "an empty config id"),
        ({"model": ""}, "an empty value"),
        ({"mo del": "v"}, "without spaces"),
        ({"model": "a\nb"}, "without control characters"),
        ({"model": "x" * 513}, "at most 512 characters"),
    ]
    for options, problem in cases:
        error = await client.chat_error(prompt="hello", config_options=options)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, options
        assert problem in error.details(), (options, error.details())
    assert not fake.requests()  # no agent was started for any


async def test_the_python_client_sends_config_options_and_reads_them_as_typed_events_and_session_fields(
    make_daemon: DaemonFactory, fake: FakeAgentSetup
) -> None:
    daemon, _ = await make_daemon({"fake": fake.profile(*OPTIONS, "--commands-at-open")})
    async with RcoderClient(daemon.address, token=daemon.token) as client:
        turn = client.chat("proj", "agent-mode ask", config_options={"model": "fake-large"})
        events = [event async for event in turn]
        begin = next(e for e in events if isinstance(e, Started))
        model = {o.id: o for o in begin.config_options}["model"]
        assert (model.current_value, model.chosen, model.value_ids()) == (
            "fake-large",
            True,
            ("fake-small", "fake-large"),
        )
        update = next(e for e in events if isinstance(e, ConfigOptionUpdate))
        assert {o.id: o.current_value for o in update.config_options} == {"model": "fake-large", "mode": "ask"}
        listed = next(e for e in events if isinstance(e, AvailableCommands))
        assert listed.commands[0] == SlashCommand("review", "Review the changes", "what to review")

        session = await client.sessions.get(turn.session_id)
        assert {o.id: (o.current_value, o.chosen) for o in session.config_options} == {
            "model": ("fake-large", True),
            "mode": ("ask", False),
        }
        assert [c.name for c in session.commands] == ["review", "compact"]
        with pytest.raises(InvalidArgument, match="values offered: fake-small, fake-large"):
            await client.chat("proj", "hi", session_id=turn.session_id, config_options={"model": "huge"}).text()

"""TurnRunner with real fake-agent processes and a real SQLite store: how a turn ends.

No gRPC and no daemon: the runner is built from its parts (store, pool, run registry,
metrics, clock, spawn). What the agents receive is read as it arrives from their request
log, a FIFO (see ``AgentRequests``), so a test acts "once the agent got the prompt".
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from rcoder.agent.launcher import AgentLauncher
from rcoder.agent.pool import AgentPool
from rcoder.agent.processes.tree import Trees
from rcoder.config import AgentProfile, Settings, load_settings
from rcoder.domain import (
    ChatTurn,
    OpenMethod,
    ResumeOutcome,
    RunCompleted,
    RunEventBody,
    RunStarted,
    RunStatus,
    SessionRecord,
    StopReason,
    TextChunk,
    new_id,
)
from rcoder.errors import AgentUnavailable, NotFound
from rcoder.metrics import Metrics
from rcoder.session.guards.disk import DiskGuard
from rcoder.session.guards.spend import SpendGuard
from rcoder.session.guards.usage_writer import UsageWriter
from rcoder.session.hosts.leases import LeaseKeeper
from rcoder.session.resume.opening import Action, SessionOpener, TurnPlan
from rcoder.session.runs.history import History
from rcoder.session.runs.run import Run, RunRegistry
from rcoder.session.turns.checkpoints import Checkpoints
from rcoder.session.turns.ending import TurnEnder
from rcoder.session.turns.live_sessions import LiveSessions
from rcoder.session.turns.permissions import PermissionBroker
from rcoder.session.turns.records import TurnRecords
from rcoder.session.turns.runner import Phase, TurnRunner, TurnSteps
from rcoder.store.sqlite import SqliteStore
from tests.conftest import base_settings
from tests.harness import FakeAgentSetup, write_config
from tests.processes import CLOSE_BOUND, START_BOUND, drain, ended, reaped
from tests.session.conftest import AgentRequests

TURN_BOUND = START_BOUND + CLOSE_BOUND


class Tasks:
    """The runner's ``spawn``: the sessions' owners' scope of tasks, to be waited for."""

    def __init__(self, live: LiveSessions) -> None:
        self.live = live

    def __call__(self, work: Coroutine[Any, Any, None], name: str) -> None:
        self.live.spawn(work, name)

    async def settled(self) -> None:
        """Every turn and background step (a cancel, a kill) over, bounded."""
        assert await self.live.wait_idle(TURN_BOUND), "tasks still running"

    async def aclose(self) -> None:
        """Cancel what is still running (as the intake does when rcoder stops) and wait, bounded."""
        await self.live.cancel_all(TURN_BOUND)
        assert await self.live.wait_idle(TURN_BOUND), "tasks still running"


@dataclass
class Turns:
    """A TurnRunner over its real parts, and the turns it was given."""

    settings: Settings
    store: SqliteStore
    pool: AgentPool
    runs: RunRegistry
    runner: TurnRunner
    tasks: Tasks

    @property
    def live(self) -> LiveSessions:
        """The sessions' owners: which run holds a session."""
        return self.tasks.live

    @property
    def profile(self) -> AgentProfile:
        profile = self.settings.profile("fake")
        assert profile is not None
        return profile

    def plan(self, prompt: str, record: SessionRecord | None = None, action: Action = Action.NEW) -> TurnPlan:
        session_id = record.session_id if record else new_id()
        cwd = record.cwd if record else str(self.settings.workspace_root / "proj")
        os.makedirs(cwd, exist_ok=True)
        return TurnPlan(
            turn=ChatTurn(project_id="proj", prompt=prompt, session_id=session_id if record else ""),
            profile=self.profile,
            session_id=session_id,
            run_id=new_id(),
            cwd=cwd,
            record=record,
            action=action,
        )

    def start(self, plan: TurnPlan) -> tuple[Run, asyncio.Future[Run]]:
        """Claim the session for a new run and start the turn, the way the intake does."""
        run = Run(plan.run_id, plan.session_id, 1000)
        self.live.hold(run)
        ready: asyncio.Future[Run] = asyncio.get_running_loop().create_future()
        self.tasks(self.runner.run(plan, run, ready), f"run-{plan.run_id}")
        return run, ready


TurnsFactory = Callable[..., Coroutine[Any, Any, Turns]]


@pytest.fixture
async def make_turns(
    tmp_path: Path, fake: FakeAgentSetup, agent_requests: AgentRequests
) -> AsyncIterator[TurnsFactory]:
    """A runner over the fake agent (``flags`` for it, ``agent`` keys for its profile, top-level
    keys as settings); on teardown its turns end, its pool and store close, no agent is left."""
    made: list[Turns] = []

    async def make(*flags: str, agent: dict[str, Any] | None = None, **top: Any) -> Turns:
        config = write_config(
            tmp_path / "rcoder.toml",
            {"fake": fake.profile(*flags, **(agent or {}))},
            **{**base_settings(tmp_path), "heartbeat_interval": 0, **top},
        )
        settings = load_settings(config, environ={})
        store = SqliteStore(tmp_path / "rcoder.db")
        await store.open()
        metrics = Metrics()
        launcher = AgentLauncher(settings, Trees())
        pool = AgentPool(settings, launcher, metrics)
        runs = RunRegistry(settings.run_retention)
        leases = LeaseKeeper.local(settings.lease_ttl, metrics)
        live = LiveSessions(settings.max_queued_turns, runs, store, pool, leases)
        tasks = Tasks(live)
        clock = lambda: datetime.now(UTC)  # noqa: E731
        history = History(store, runs, settings.history_max_bytes_per_run, clock)
        checkpoints = Checkpoints(settings, store, launcher.trees)
        records = TurnRecords(store, pool, clock, leases)
        steps = TurnSteps(
            SessionOpener(settings, store, pool, metrics, live, clock), records,
            TurnEnder(store, pool, runs, metrics, clock, live, history, checkpoints, records),
            PermissionBroker(settings.permission_timeout),
        )  # fmt: skip
        runner = TurnRunner(
            settings, store, pool, metrics, clock, history, checkpoints, live,
            DiskGuard(settings, live), SpendGuard(settings, store, clock, live), UsageWriter(store, clock), steps,
        )  # fmt: skip
        turns = Turns(settings, store, pool, runs, runner, tasks)
        made.append(turns)
        return turns

    try:
        yield make
    finally:
        for turns in made:
            try:
                await turns.tasks.aclose()  # a retry of a store write may still be under way
            finally:
                await turns.pool.aclose(timeout=CLOSE_BOUND)
                await turns.store.close()
        assert not await drain(str(fake.state_dir)), "agent processes left behind"


async def events_of(run: Run, within: float = TURN_BOUND) -> list[RunEventBody]:
    """Every event of the run, through ``completed``, which must come ``within`` seconds."""
    async with asyncio.timeout(within):
        return [event.body async for event in run.follow()]


async def bounded(ready: asyncio.Future[Run]) -> Run:
    async with asyncio.timeout(TURN_BOUND):
        return await ready


def split(bodies: list[RunEventBody]) -> tuple[RunStarted, str, RunCompleted]:
    """started, the agent's text, completed: checking that the run begins and ends so."""
    started, *middle, completed = bodies
    assert isinstance(started, RunStarted), bodies
    assert isinstance(completed, RunCompleted), bodies
    text = "".join(b.text for b in middle if isinstance(b, TextChunk) and not b.thought)
    return started, text, completed


# ---------------------------------------------------------------- ending normally


async def test_a_turn_completes_is_stored_frees_its_session_and_leaves_its_agent_live_for_the_next(
    make_turns: TurnsFactory,
) -> None:
    turns = await make_turns()
    plan = turns.plan("remember 7")
    run, ready = turns.start(plan)

    assert await bounded(ready) is run
    started, text, completed = split(await events_of(run))
    assert (started.resume, started.resume_method) == (ResumeOutcome.NEW, OpenMethod.NEW)
    assert text == "I remember: 7"
    assert completed == RunCompleted(StopReason.END_TURN, started.provider_session_id, ResumeOutcome.NEW)
    stored = await turns.store.get_run(plan.run_id)
    assert stored is not None
    assert (stored.status, stored.stop_reason) == (RunStatus.COMPLETED, StopReason.END_TURN)
    assert stored.ended_at is not None
    assert turns.live.holder(plan.session_id) is None
    assert turns.pool.is_live(plan.session_id) and turns.pool.live_count() == 1

    record = await turns.store.get_session(plan.session_id)
    assert record is not None and record.provider_session_id == started.provider_session_id
    again = turns.plan("remember 8", record, Action.LIVE)
    run, _ = turns.start(again)
    started, text, completed = split(await events_of(run))
    assert (started.resume, started.provider_session_id) == (ResumeOutcome.LIVE, record.provider_session_id)
    assert text == "I remember: 7, 8", "the same agent, idle between the turns, took the next"
    assert completed.stop_reason is StopReason.END_TURN


# ---------------------------------------------------------------- cancelled


async def test_a_turn_cancelled_while_its_agent_initializes_starts_then_ends_cancelled_and_ends_the_agent(
    make_turns: TurnsFactory, agent_requests: AgentRequests
) -> None:
    turns = await make_turns("--hang", "initialize", initialize_timeout=600)
    plan = turns.plan("hello")
    run, ready = turns.start(plan)
    initialize = await agent_requests.next("initialize")

    assert turns.runner.cancel(plan.run_id) is True
    assert await bounded(ready) is run
    bodies = await events_of(run, within=CLOSE_BOUND)  # at once, not at initialize_timeout

    assert [type(body) for body in bodies] == [RunStarted, RunCompleted]
    started, _, completed = split(bodies)
    assert (started.resume, started.resume_method) == (ResumeOutcome.NOT_OPENED, OpenMethod.NOT_OPENED)
    assert (completed.stop_reason, completed.resume, completed.error) == (
        StopReason.CANCELLED, ResumeOutcome.NOT_OPENED, "",
    )  # fmt: skip
    assert reaped(initialize.pid), "the agent is ended before completed is out"
    stored = await turns.store.get_run(plan.run_id)
    assert stored is not None and (stored.status, stored.stop_reason) == (RunStatus.COMPLETED, StopReason.CANCELLED)
    assert turns.live.holder(plan.session_id) is None and turns.pool.agent_count() == 0


async def test_a_turn_cancelled_during_its_prompt_ends_cancelled(
    make_turns: TurnsFactory, agent_requests: AgentRequests
) -> None:
    turns = await make_turns(cancel_grace=600)
    plan = turns.plan("hang")
    run, ready = turns.start(plan)
    await bounded(ready)
    await agent_requests.next("session/prompt")

    assert turns.runner.cancel(plan.run_id) is True
    _, text, completed = split(await events_of(run, within=CLOSE_BOUND))  # the agent's answer, not a kill

    assert (completed.stop_reason, completed.error, text) == (StopReason.CANCELLED, "", "")
    stored = await turns.store.get_run(plan.run_id)
    assert stored is not None and (stored.status, stored.stop_reason) == (RunStatus.COMPLETED, StopReason.CANCELLED)
    assert turns.live.holder(plan.session_id) is None
    assert turns.runner.cancel(plan.run_id) is False, "a finished turn is no longer running"


async def live_session(turns: Turns) -> SessionRecord:
    """A session whose agent is live and idle, having heard ``remember 7``."""
    first = turns.plan("remember 7")
    run, _ = turns.start(first)
    _, text, _ = split(await events_of(run))
    assert text == "I remember: 7"
    record = await turns.store.get_session(first.session_id)
    assert record is not None
    return record


async def never_heard_and_still_live(turns: Turns, record: SessionRecord) -> None:
    """The session's agent is still live and idle, and never had the cancelled prompt
    (``remember 9``): the next turn is taken at once and recalls 7 and 8 only."""
    run, _ = turns.start(turns.plan("remember 8", record, Action.LIVE))
    started, text, completed = split(await events_of(run))
    assert (started.resume, completed.stop_reason) == (ResumeOutcome.LIVE, StopReason.END_TURN)
    assert text == "I remember: 7, 8"


async def test_a_turn_cancelled_after_its_claim_before_its_task_began_ends_cancelled_never_opened(
    make_turns: TurnsFactory,
) -> None:
    turns = await make_turns(cancel_grace=600)
    record = await live_session(turns)
    plan = turns.plan("remember 9 hang", record, Action.LIVE)
    run, ready = turns.start(plan)

    assert turns.runner.cancel(plan.run_id) is True, "claimed is running: Cancel reaches it"
    assert await bounded(ready) is run
    bodies = await events_of(run, within=CLOSE_BOUND)

    assert [type(body) for body in bodies] == [RunStarted, RunCompleted]
    started, _, completed = split(bodies)
    assert (started.resume, completed.stop_reason, completed.error) == (
        ResumeOutcome.NOT_OPENED, StopReason.CANCELLED, "",
    )  # fmt: skip
    stored = await turns.store.get_run(plan.run_id)
    assert stored is not None and (stored.status, stored.stop_reason) == (RunStatus.COMPLETED, StopReason.CANCELLED)
    await never_heard_and_still_live(turns, record)


async def test_a_live_turn_cancelled_after_its_session_opened_before_its_prompt_went_out_never_sends_it(
    make_turns: TurnsFactory,
) -> None:
    turns = await make_turns(cancel_grace=600)
    record = await live_session(turns)
    plan = turns.plan("remember 9 hang", record, Action.LIVE)
    run, ready = turns.start(plan)
    await asyncio.sleep(0)  # one step of the turn's task: the live agent taken, the prompt's task not yet run
    assert turns.runner.phase(plan.run_id) is Phase.OPENED

    assert turns.runner.cancel(plan.run_id) is True
    assert await bounded(ready) is run
    started, text, completed = split(await events_of(run, within=CLOSE_BOUND))  # at once, not at turn_timeout

    assert (started.resume, completed.stop_reason, completed.error, text) == (
        ResumeOutcome.LIVE, StopReason.CANCELLED, "", "",
    )  # fmt: skip
    stored = await turns.store.get_run(plan.run_id)
    assert stored is not None and (stored.status, stored.stop_reason) == (RunStatus.COMPLETED, StopReason.CANCELLED)
    await never_heard_and_still_live(turns, record)


async def test_a_live_turn_cancelled_while_its_options_are_set_says_its_session_was_open_live(
    make_turns: TurnsFactory,
) -> None:
    turns = await make_turns("--offer", "options", cancel_grace=600)
    record = await live_session(turns)
    plan = turns.plan("remember 9 hang", record, Action.LIVE)
    plan.turn = replace(plan.turn, config_options=(("model", "fake-large"),))  # set before the prompt
    run, ready = turns.start(plan)
    await asyncio.sleep(0)  # one step of the turn's task: the live agent taken, its option still to set
    assert turns.runner.phase(plan.run_id) is Phase.OPENING

    assert turns.runner.cancel(plan.run_id) is True
    assert await bounded(ready) is run
    started, text, completed = split(await events_of(run, within=CLOSE_BOUND))

    # the session was open (the live agent's): not NOT_OPENED, though the prompt never went out
    assert (started.resume, started.resume_method, completed.stop_reason, text) == (
        ResumeOutcome.LIVE, OpenMethod.LIVE, StopReason.CANCELLED, "",
    )  # fmt: skip
    stored = await turns.store.get_run(plan.run_id)
    assert stored is not None and (stored.resume, stored.stop_reason) == (ResumeOutcome.LIVE, StopReason.CANCELLED)


async def test_a_live_turn_cancelled_as_its_stream_opens_asks_the_agent_to_stop_and_ends_cancelled(
    make_turns: TurnsFactory, agent_requests: AgentRequests
) -> None:
    turns = await make_turns(cancel_grace=600)
    record = await live_session(turns)
    plan = turns.plan("hang", record, Action.LIVE)
    run, ready = turns.start(plan)
    await bounded(ready)  # started is out: the prompt went to the agent before the run was stored
    assert turns.runner.phase(plan.run_id) is Phase.PROMPTING

    assert turns.runner.cancel(plan.run_id) is True
    await agent_requests.next("session/cancel")
    started, _, completed = split(await events_of(run, within=CLOSE_BOUND))  # the agent's answer, not a kill

    assert (started.resume, completed.stop_reason, completed.error) == (ResumeOutcome.LIVE, StopReason.CANCELLED, "")
    assert turns.pool.is_live(plan.session_id), "the agent answered the cancel: it serves the next turn"


async def test_a_turn_knows_from_its_claim_the_run_it_follows_in_its_session_live_or_not(
    make_turns: TurnsFactory,
) -> None:
    turns = await make_turns()
    first = turns.plan("hello")
    run, _ = turns.start(first)
    assert turns.runner.follows(first.run_id) == "", "a new session's first turn follows none"
    await events_of(run)

    previous = first
    for _ in range(2):
        live = turns.pool.live_record(first.session_id)  # how a live turn is planned: no store read
        assert live is not None
        plan = turns.plan("hello", live, Action.LIVE)
        run, _ = turns.start(plan)
        assert turns.runner.follows(plan.run_id) == previous.run_id
        await events_of(run)
        previous = plan
    assert turns.runner.follows(plan.run_id) is None, "not running here any more"


# ---------------------------------------------------------------- failing


async def test_a_turn_refused_before_it_started_leaves_no_run_and_no_claim_and_its_new_session_empty(
    tmp_path: Path, make_turns: TurnsFactory
) -> None:
    turns = await make_turns(agent={"command": str(tmp_path / "no-such-agent")})
    plan = turns.plan("hello")
    run, ready = turns.start(plan)

    with pytest.raises(AgentUnavailable, match="no-such-agent"):
        await bounded(ready)
    await turns.tasks.settled()

    with pytest.raises(NotFound):
        turns.runs.get(plan.run_id)
    assert turns.live.holder(plan.session_id) is None
    assert run.last_seq == 0, "nothing was published"
    assert await turns.store.get_run(plan.run_id) is None
    # the new session was stored before its agent was started (its id was told): it stays, unopened
    session = await turns.store.get_session(plan.session_id)
    assert session is not None and (session.provider_session_id, session.last_run_id) == ("", "")
    assert turns.pool.agent_count() == 0


async def test_a_turn_whose_end_cannot_be_stored_ends_as_a_store_error_and_frees_its_session(
    make_turns: TurnsFactory,
) -> None:
    turns = await make_turns()
    plan = turns.plan("sleep 300")
    run, ready = turns.start(plan)
    await bounded(ready)
    # closed at once: the store is marked closed before the agent can even have the prompt
    await turns.store.close()

    _, _, completed = split(await events_of(run))

    assert (completed.stop_reason, completed.error_reason) == (StopReason.ERROR, "STORE_UNAVAILABLE")
    assert "could not record the end of this turn" in completed.error
    assert turns.live.holder(plan.session_id) is None
    assert not turns.pool.is_live(plan.session_id), "the turn is an error: its agent does not serve another"


async def test_a_turn_past_turn_timeout_ends_as_an_agent_timeout_and_ends_its_agent(
    make_turns: TurnsFactory, agent_requests: AgentRequests
) -> None:
    turns = await make_turns(turn_timeout=0.5)
    plan = turns.plan("hang")
    run, _ = turns.start(plan)
    prompt = await agent_requests.next("session/prompt")

    _, _, completed = split(await events_of(run))

    assert (completed.stop_reason, completed.error_reason) == (StopReason.ERROR, "AGENT_TIMEOUT")
    assert "turns.timeout" in completed.error
    stored = await turns.store.get_run(plan.run_id)
    assert stored is not None and (stored.status, stored.stop_reason) == (RunStatus.FAILED, StopReason.ERROR)
    assert turns.live.holder(plan.session_id) is None
    await ended(prompt.pid)
    assert turns.pool.agent_count() == 0

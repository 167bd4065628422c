"""The turn's state machine on its own: every (phase, event) pair, then how a turn ends.

No process, no store, no loop: each test feeds events to ``TurnMachine`` and reads the phase and
the actions it returns (the table is in ``rcoder/session/turns/machine.py``).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from rcoder.domain import RunStatus, StopReason
from rcoder.errors import AgentCrashed, AgentTimeout, Internal, LeaseLost, RunCancelled, ShuttingDown, StoreError
from rcoder.session.turns.machine import TurnMachine, TurnMachineError
from rcoder.session.turns.messages import (
    Abandon,
    AgentEnded,
    AskAgentToStop,
    Begin,
    CancelOpening,
    CancelRequested,
    CheckStartLanded,
    EndRefused,
    Event,
    Failed,
    Finish,
    ForgetAfterPublish,
    LeaseGone,
    OpeningCancelled,
    Outcome,
    Phase,
    PromptSent,
    Propagate,
    RecordStartAnyway,
    Refuse,
    RetryEndLater,
    SessionOpened,
    Started,
    StartRecording,
    StartRefused,
    StopCause,
    Stopping,
    StoreEndAlone,
    TimedOut,
    TooLate,
)

pytestmark = pytest.mark.fast  # starts no process: `make check` (tests/process_guard.py)

RUN = "r1"
BUDGET = StopCause(StopReason.BUDGET_EXCEEDED, "the session's budget is spent", "BUDGET_EXCEEDED")


def machine_in(phase: Phase) -> TurnMachine:
    """A machine brought to ``phase`` the usual way: in PROMPTING its started event is out, and
    in ENDED the agent answered and the turn is finishing."""
    machine = TurnMachine(RUN)
    steps: list[Event] = [Begin(), SessionOpened(), PromptSent(), StartRecording(), Started(), AgentEnded()]
    count = {Phase.CLAIMED: 0, Phase.OPENING: 1, Phase.OPENED: 2, Phase.PROMPTING: 5, Phase.ENDED: 6}[phase]
    for event in steps[:count]:
        machine.handle(event)
    assert machine.phase is phase
    return machine


EVENTS: dict[str, Callable[[], Event]] = {
    "Begin": Begin,
    "SessionOpened": SessionOpened,
    "PromptSent": PromptSent,
    "StartRecording": StartRecording,
    "Started": Started,
    "StartRefused": lambda: StartRefused(StoreError("refused")),
    "CancelRequested": CancelRequested,
    "LeaseGone": lambda: LeaseGone("s1", 2),
    "OpeningCancelled": OpeningCancelled,
    "AgentEnded": AgentEnded,
    "Failed": lambda: Failed(AgentCrashed("the agent exited")),
    "TimedOut": lambda: TimedOut(AgentTimeout("no answer within turn_timeout")),
    "Stopping": Stopping,
    "EndRefused": lambda: EndRefused(StoreError("the store is down")),
}
INVALID = None
ENDINGS = ("AgentEnded", "Failed", "TimedOut", "Stopping")
C, OP, D, P, E = Phase.CLAIMED, Phase.OPENING, Phase.OPENED, Phase.PROMPTING, Phase.ENDED

# (phase, event) -> (the phase after, the kinds of the actions), or INVALID
TABLE: dict[tuple[Phase, str], tuple[Phase, tuple[type, ...]] | None] = {
    (C, "Begin"): (OP, ()),
    (OP, "SessionOpened"): (D, ()),
    (D, "PromptSent"): (P, ()),
    (D, "StartRecording"): (D, ()),
    (P, "StartRecording"): (P, ()),
    (E, "StartRecording"): (E, ()),
    (D, "Started"): (D, ()),
    (P, "Started"): (P, ()),
    (C, "CancelRequested"): (C, ()),
    (OP, "CancelRequested"): (OP, (CancelOpening,)),
    (D, "CancelRequested"): (D, ()),
    (P, "CancelRequested"): (P, (AskAgentToStop,)),
    (E, "CancelRequested"): (E, (TooLate,)),
    (C, "LeaseGone"): (C, ()),
    (OP, "LeaseGone"): (OP, (CancelOpening,)),
    (D, "LeaseGone"): (D, ()),
    (P, "LeaseGone"): (P, ()),
    (E, "LeaseGone"): (E, ()),
    (OP, "OpeningCancelled"): (OP, (Propagate,)),
    **{(phase, name): (E, (Refuse,)) for phase in (C, OP, D) for name in ENDINGS},
    **{(P, name): (E, (Finish,)) for name in ENDINGS},
    (E, "EndRefused"): (E, (StoreEndAlone, RetryEndLater)),
}


@pytest.mark.parametrize("phase", list(Phase), ids=lambda p: p.value)
@pytest.mark.parametrize("name", list(EVENTS))
def test_every_phase_and_event_does_what_the_table_says(phase: Phase, name: str) -> None:
    machine = machine_in(phase)
    expected = TABLE.get((phase, name), INVALID)
    if expected is INVALID:
        with pytest.raises(TurnMachineError, match=name):
            machine.handle(EVENTS[name]())
        assert machine.phase is phase  # a refused event changes nothing
        return
    actions = machine.handle(EVENTS[name]())
    assert (machine.phase, tuple(type(a) for a in actions)) == expected


# ---------------------------------------------------------------- cancels


@pytest.mark.parametrize(("phase", "step"), [(Phase.CLAIMED, Begin()), (Phase.OPENED, PromptSent())])
def test_a_cancel_before_a_step_keeps_the_step_from_starting(phase: Phase, step: Event) -> None:
    machine = machine_in(phase)
    machine.handle(CancelRequested())
    (action,) = machine.handle(step)
    assert isinstance(action, Abandon) and isinstance(action.error, RunCancelled)
    assert machine.phase is phase


def test_asking_twice_is_asking_once_and_the_first_cause_stays() -> None:
    machine = machine_in(Phase.PROMPTING)
    assert machine.handle(CancelRequested(BUDGET)) == (AskAgentToStop(),)
    assert machine.handle(CancelRequested()) == ()
    assert machine.cause == BUDGET


def test_a_second_cancel_after_the_end_is_not_refused() -> None:
    machine = machine_in(Phase.PROMPTING)
    machine.handle(CancelRequested())
    machine.handle(AgentEnded())
    assert machine.handle(CancelRequested()) == ()


def test_an_opening_cancelled_for_a_cancel_is_abandoned_as_cancelled() -> None:
    machine = machine_in(Phase.OPENING)
    machine.handle(CancelRequested())
    (action,) = machine.handle(OpeningCancelled())
    assert isinstance(action, Abandon) and isinstance(action.error, RunCancelled)


def test_an_opening_cancelled_for_a_lost_lease_fails_with_it_once() -> None:
    machine = machine_in(Phase.OPENING)
    assert machine.handle(LeaseGone("s1", 3)) == (CancelOpening(),)
    assert machine.handle(LeaseGone("s1", 3)) == ()
    (action,) = machine.handle(OpeningCancelled())
    assert isinstance(action, Abandon) and isinstance(action.error, LeaseLost)
    assert action.error.metadata["generation"] == "3"


# ---------------------------------------------------------------- how a started turn ends


def finished(*events: Event) -> Outcome:
    machine = machine_in(Phase.PROMPTING)
    actions: tuple[object, ...] = ()
    for event in events:
        actions = machine.handle(event)
    (finish,) = actions
    assert isinstance(finish, Finish)
    return finish.outcome


def test_an_agent_that_answers_ends_the_turn_with_its_stop_reason() -> None:
    assert finished(AgentEnded(StopReason.MAX_TOKENS)) == Outcome(RunStatus.COMPLETED, StopReason.MAX_TOKENS)


def test_a_cancelled_turn_ends_cancelled_even_when_the_agent_says_end_turn() -> None:
    outcome = finished(CancelRequested(), AgentEnded(StopReason.END_TURN))
    assert outcome == Outcome(RunStatus.COMPLETED, StopReason.CANCELLED)


def test_a_turn_rcoder_stopped_ends_as_its_cause_says_and_keeps_its_agent() -> None:
    machine = machine_in(Phase.PROMPTING)
    machine.handle(CancelRequested(BUDGET))
    machine.handle(AgentEnded())
    assert machine.outcome == Outcome(RunStatus.COMPLETED, BUDGET.stop, BUDGET.error, BUDGET.error_reason)
    assert not machine.agent_broken


def test_an_agent_ended_by_its_group_after_a_cancel_is_still_a_cancel() -> None:
    outcome = finished(CancelRequested(), Failed(AgentCrashed("killed")))
    assert outcome == Outcome(RunStatus.COMPLETED, StopReason.CANCELLED, transcript=False)


def test_a_store_error_after_a_cancel_is_an_error() -> None:
    outcome = finished(CancelRequested(), Failed(StoreError("the store is down")))
    assert (outcome.status, outcome.stop) == (RunStatus.FAILED, StopReason.ERROR)
    assert outcome.error_reason == "STORE_UNAVAILABLE"


def test_a_timeout_fails_the_turn_with_the_agents_timeout() -> None:
    outcome = finished(TimedOut(AgentTimeout("no answer")))
    assert (outcome.status, outcome.stop, outcome.error_reason) == (RunStatus.FAILED, StopReason.ERROR, "AGENT_TIMEOUT")
    assert not outcome.transcript


def test_rcoder_stopping_interrupts_a_started_turn() -> None:
    outcome = finished(Stopping())
    assert (outcome.status, outcome.stop, outcome.error_reason) == (
        RunStatus.INTERRUPTED, StopReason.CANCELLED, ShuttingDown.reason,
    )  # fmt: skip


def test_an_error_breaks_the_agent_and_an_answer_does_not() -> None:
    failed = machine_in(Phase.PROMPTING)
    failed.handle(Failed(Internal(ValueError("a bug"))))
    answered = machine_in(Phase.ENDED)
    assert failed.agent_broken and not answered.agent_broken
    assert not TurnMachine(RUN).agent_broken  # nothing decided yet


# ---------------------------------------------------------------- a turn whose start is not out


def test_a_turn_that_fails_before_its_start_is_refused_with_its_error() -> None:
    machine = machine_in(Phase.OPENED)
    error = AgentCrashed("the agent exited")
    assert machine.handle(Failed(error)) == (Refuse(error, heard=False),)


def test_an_agent_that_heard_the_prompt_of_a_refused_turn_is_said_to_have_heard_it() -> None:
    machine = machine_in(Phase.OPENED)
    machine.handle(PromptSent())
    error = StoreError("start refused")
    assert machine.handle(Failed(error)) == (Refuse(error, heard=True),)


def test_work_that_ends_without_a_start_or_an_error_is_refused_as_internal() -> None:
    (refuse,) = machine_in(Phase.CLAIMED).handle(AgentEnded())
    assert isinstance(refuse, Refuse) and isinstance(refuse.error, Internal)


def test_a_turn_cancelled_before_its_start_is_recorded_started_then_finished() -> None:
    machine = machine_in(Phase.OPENING)
    machine.handle(CancelRequested())
    assert machine.handle(Failed(RunCancelled(RUN, "its session was opening"))) == (RecordStartAnyway(),)
    (finish,) = machine.handle(Started())
    assert isinstance(finish, Finish) and finish.outcome.stop is StopReason.CANCELLED
    assert machine.published


def test_a_cancelled_turn_whose_late_start_the_store_refuses_is_refused_with_the_stores_error() -> None:
    machine = machine_in(Phase.OPENED)
    machine.handle(CancelRequested())
    machine.handle(Failed(RunCancelled(RUN, "opened, before prompting")))
    error = StoreError("refused")
    assert machine.handle(StartRefused(error)) == (Refuse(error, heard=False),)


def test_rcoder_stopping_while_the_start_was_written_asks_whether_it_landed() -> None:
    machine = machine_in(Phase.OPENED)
    machine.handle(PromptSent())
    machine.handle(StartRecording())
    assert machine.handle(Stopping()) == (CheckStartLanded(),)
    (refuse,) = machine.handle(StartRefused())
    assert isinstance(refuse, Refuse) and isinstance(refuse.error, ShuttingDown) and refuse.heard


def test_a_start_that_landed_as_rcoder_stopped_is_finished_interrupted() -> None:
    machine = machine_in(Phase.OPENED)
    machine.handle(StartRecording())
    machine.handle(Stopping())
    (finish,) = machine.handle(Started())
    assert isinstance(finish, Finish) and finish.outcome.status is RunStatus.INTERRUPTED


# ---------------------------------------------------------------- an end the store refuses


def test_an_end_refused_for_a_lost_lease_is_not_kept_and_not_retried() -> None:
    machine = machine_in(Phase.ENDED)
    actions = machine.handle(EndRefused(LeaseLost("s1", 4)))
    assert actions == (StoreEndAlone(wait=True), ForgetAfterPublish())
    assert machine.outcome is not None and machine.outcome.error_reason == "LEASE_LOST"
    assert machine.agent_broken


def test_an_end_a_closed_store_refused_is_not_retried() -> None:
    machine = machine_in(Phase.ENDED)
    assert machine.handle(EndRefused(StoreError("closed", closed=True))) == (StoreEndAlone(wait=False),)
    assert machine.outcome is not None and "could not record the end" in machine.outcome.error

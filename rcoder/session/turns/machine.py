"""Where one turn stands and what happens next, as a state machine without any I/O.

The driver (``session.turns.runner``) feeds the machine an event each time something happens to the
turn, and performs the actions that ``TurnMachine.handle`` returns: it opens the session, sends
the prompt, writes to the store and publishes events, while this module only decides. It works
as h11 does under httpcore: the machine never awaits and never touches a process, a socket or
the store, so its tests run in microseconds and can try every (phase, event) pair.

The phase only moves forward: ``CLAIMED`` → ``OPENING`` → ``OPENED`` → ``PROMPTING`` →
``ENDED``. A turn may skip phases on its way to ``ENDED`` (a turn refused while claimed never
opens). Once a turn has ended, how it ended (``Outcome``) is decided, and a cancel is too late.

The table below lists, for each event, what it does in each phase. "invalid" means the driver
never sends that event in that phase; the machine raises ``TurnMachineError`` if it does.
An ending event is one of ``AgentEnded``, ``Failed``, ``TimedOut`` and ``Stopping``.

=================  ==============================  ==============================================
event              phase(s)                        what happens
=================  ==============================  ==============================================
Begin              CLAIMED                         → OPENING; ``Abandon`` if a cancel came first
Begin              any later phase                 invalid
SessionOpened      OPENING                         → OPENED
SessionOpened      any other phase                 invalid
PromptSent         OPENED                          → PROMPTING; ``Abandon`` if a cancel came first
PromptSent         any other phase                 invalid
StartRecording     OPENED, PROMPTING, ENDED        remembered: the store may hold the start now
StartRecording     CLAIMED, OPENING                invalid
Started            OPENED, PROMPTING               remembered: ``started`` is published
Started            ENDED, start being settled      ``Finish`` with the decided outcome
Started            CLAIMED, OPENING, ENDED other   invalid
StartRefused       ENDED, start being settled      ``Refuse`` the turn with the error
StartRefused       any other phase                 invalid (a refused start is told by ``Failed``)
CancelRequested    CLAIMED, OPENED                 remembered: the next step is never taken
CancelRequested    OPENING                         ``CancelOpening``
CancelRequested    PROMPTING                       ``AskAgentToStop``
CancelRequested    ENDED                           ``TooLate`` (unless a cancel came before)
CancelRequested    any, a cancel came before       nothing: asking twice is asking once
LeaseGone          OPENING, no lease lost before   ``CancelOpening``; the open fails ``LeaseLost``
LeaseGone          any other phase                 nothing: the agent, ended with the lease, ends it
OpeningCancelled   OPENING                         ``Abandon`` with the cancel or the lost lease;
                                                   if neither came, ``Propagate`` the cancellation
OpeningCancelled   any other phase                 invalid
AgentEnded         CLAIMED … PROMPTING             → ENDED; see "how a turn ends" below
Failed             CLAIMED … PROMPTING             → ENDED; see "how a turn ends" below
TimedOut           CLAIMED … PROMPTING             → ENDED; as ``Failed`` with the agent's timeout
Stopping           CLAIMED … PROMPTING             → ENDED; see "how a turn ends" below
any ending event   ENDED                           invalid
EndRefused         ENDED, finishing                the outcome becomes an error; see below
EndRefused         any other phase                 invalid
=================  ==============================  ==============================================

How a turn ends. A turn whose ``started`` event is out gets ``Finish`` at once. A turn whose
``started`` event is not out is settled first:

- A cancel came and rcoder is not stopping: ``RecordStartAnyway``. The turn is then recorded
  as started and cancelled (``RESUME_OUTCOME_NOT_OPENED`` when its session never opened), so
  the caller sees it start and end. ``Started`` then leads to ``Finish``; ``StartRefused``
  leads to ``Refuse``.
- The start was handed to the store before the end came (rcoder stopped while it was being
  written): ``CheckStartLanded``. ``Started`` (it landed) leads to ``Finish``;
  ``StartRefused`` (it did not) leads to ``Refuse`` with the error the turn ended with.
- Otherwise: ``Refuse``. The caller gets the error and nothing of the turn is kept.

The outcome of a finished turn:

- a cancel came (``AgentEnded`` after it, or a ``Failed`` from the agent or from an abandoned
  step): ``COMPLETED`` with ``CANCELLED``, or as rcoder's ``StopCause`` says;
- ``AgentEnded`` otherwise: ``COMPLETED`` with the agent's stop reason;
- ``Stopping``: ``INTERRUPTED`` with ``CANCELLED`` ("rcoder stopped while the turn ran");
- ``Failed`` or ``TimedOut``: ``FAILED`` with ``ERROR`` and the error's text and reason.

When the store refuses the end (``EndRefused``), the turn becomes an error and ``completed`` is
stored on its own (``StoreEndAlone``). With ``LeaseLost``, another host serves the session now:
the store refuses whatever this host still writes about it, and the end is not kept for
``Subscribe`` (``ForgetAfterPublish``). With any other store error that write is not waited for,
and storing the end is retried later (``RetryEndLater``) unless the store is closed for good.
"""

from __future__ import annotations

from rcoder.domain import RunStatus, StopReason
from rcoder.errors import AgentError, Internal, LeaseLost, RcoderError, RunCancelled, ShuttingDown, StoreError
from rcoder.session.turns.messages import (
    BEFORE_END,
    Abandon,
    Action,
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


class TurnMachineError(Exception):
    """The driver sent an event that cannot happen in the turn's phase: a bug of ours."""

    def __init__(self, phase: Phase, event: object) -> None:
        super().__init__(f"{type(event).__name__} cannot happen in phase {phase.value}")
        self.phase = phase
        self.event = event


class TurnMachine:
    """One turn's phase and what it has been told so far (see the module docstring)."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self.phase = Phase.CLAIMED
        self.cancel_requested = False
        self.cause: StopCause | None = None  # set when rcoder, not a client, stopped the turn
        self.lost: LeaseLost | None = None  # the session's lease was lost while its agent opened
        self.start_recording = False  # the start was handed to the store (it may have landed)
        self.published = False  # the started event is out
        self.heard = False  # the agent had the prompt when the turn ended
        self.outcome: Outcome | None = None  # decided once the turn is finishing
        self._settling: RcoderError | None = None  # the error of an end whose start is being settled
        self._stopping = False  # the end came because rcoder is stopping

    def handle(self, event: Event) -> tuple[Action, ...]:
        """Move the turn on by ``event`` and return what the driver must do now, in order."""
        match event:
            case Begin():
                return self._step(event, Phase.CLAIMED, Phase.OPENING)
            case SessionOpened():
                self._require(event, Phase.OPENING)
                self.phase = Phase.OPENED
                return ()
            case PromptSent():
                return self._step(event, Phase.OPENED, Phase.PROMPTING)
            case StartRecording():
                self._require(event, Phase.OPENED, Phase.PROMPTING, Phase.ENDED)
                self.start_recording = True
                return ()
            case Started():
                return self._started(event)
            case StartRefused(error=error):
                if self.phase is not Phase.ENDED or self._settling is None:
                    raise TurnMachineError(self.phase, event)
                refusal, self._settling = error or self._settling, None
                return (Refuse(refusal, self.heard),)
            case CancelRequested(cause=cause):
                return self._cancel(cause)
            case LeaseGone(session_id=session_id, generation=generation):
                if self.phase is not Phase.OPENING or self.lost is not None:
                    return ()
                self.lost = LeaseLost(session_id, generation)
                return (CancelOpening(),)
            case OpeningCancelled():
                self._require(event, Phase.OPENING)
                if self.cancel_requested:
                    return (Abandon(RunCancelled(self.run_id, "its session was opening")),)
                if self.lost is not None:
                    return (Abandon(self.lost),)
                return (Propagate(),)
            case AgentEnded() | Failed() | TimedOut() | Stopping():
                return self._end(event)
            case EndRefused(error=error):
                return self._end_refused(event, error)
        raise TurnMachineError(self.phase, event)  # pragma: no cover (every event is matched above)

    # ------------------------------------------------------------ steps and cancels

    def _require(self, event: Event, *phases: Phase) -> None:
        if self.phase not in phases:
            raise TurnMachineError(self.phase, event)

    def _step(self, event: Event, was: Phase, to: Phase) -> tuple[Action, ...]:
        """A step that begins work: a cancel asked before it keeps the work from starting."""
        self._require(event, was)
        if self.cancel_requested:
            return (Abandon(RunCancelled(self.run_id, f"{was.value}, before {to.value}")),)
        self.phase = to
        return ()

    def _cancel(self, cause: StopCause | None) -> tuple[Action, ...]:
        if self.cancel_requested:
            return ()
        if self.phase is Phase.ENDED:
            return (TooLate(),)
        self.cancel_requested, self.cause = True, cause
        if self.phase is Phase.OPENING:
            return (CancelOpening(),)
        if self.phase is Phase.PROMPTING:
            return (AskAgentToStop(),)
        return ()  # claimed or opened: the next step is never taken

    # ------------------------------------------------------------ the end

    def _end(self, event: AgentEnded | Failed | TimedOut | Stopping) -> tuple[Action, ...]:
        if self.phase not in BEFORE_END:
            raise TurnMachineError(self.phase, event)
        self.heard = self.phase is Phase.PROMPTING
        self.phase = Phase.ENDED
        self._stopping = isinstance(event, Stopping)
        self.outcome = self._judge(event)
        if self.published:
            return (Finish(self.outcome),)
        error = _error_of(event)
        if self.cancel_requested and not self._stopping:
            self._settling = error
            self.heard = False  # a start written as cancelled is refused as one nobody heard
            return (RecordStartAnyway(),)
        if self.start_recording:
            self._settling = error
            return (CheckStartLanded(),)
        return (Refuse(error, self.heard),)

    def _started(self, event: Started) -> tuple[Action, ...]:
        if self.phase in (Phase.OPENED, Phase.PROMPTING):
            self.published = True
            return ()
        if self.phase is Phase.ENDED and self._settling is not None and self.outcome is not None:
            self.published, self._settling = True, None
            return (Finish(self.outcome),)
        raise TurnMachineError(self.phase, event)

    def _judge(self, event: AgentEnded | Failed | TimedOut | Stopping) -> Outcome:
        """How a turn ended, from the event that ended it and whether a cancel came first."""
        match event:
            case AgentEnded(stop=stop):
                return self._stopped(True) if self.cancel_requested else Outcome(RunStatus.COMPLETED, stop)
            case Stopping():
                return Outcome(
                    RunStatus.INTERRUPTED, StopReason.CANCELLED, "rcoder stopped while the turn ran",
                    ShuttingDown.reason, transcript=False,
                )  # fmt: skip
            case TimedOut(error=error) | Failed(error=error):
                if self.cancel_requested and isinstance(error, RunCancelled | AgentError):
                    # The agent was ended after the cancel grace, or the session never opened: a cancel all the same.
                    return self._stopped(False)
                return Outcome(RunStatus.FAILED, StopReason.ERROR, str(error), error.reason, transcript=False)
        raise TurnMachineError(self.phase, event)  # pragma: no cover

    def _stopped(self, transcript: bool) -> Outcome:
        """A turn a cancel ended: ``CANCELLED``, or as rcoder's cause for it says."""
        if self.cause is None:
            return Outcome(RunStatus.COMPLETED, StopReason.CANCELLED, transcript=transcript)
        cause = self.cause
        return Outcome(RunStatus.COMPLETED, cause.stop, cause.error, cause.error_reason, transcript)

    def _end_refused(self, event: EndRefused, error: RcoderError) -> tuple[Action, ...]:
        if self.phase is not Phase.ENDED or not self.published or self.outcome is None:
            raise TurnMachineError(self.phase, event)
        if isinstance(error, LeaseLost):  # another host serves the session now: nothing more is written
            self.outcome = Outcome(RunStatus.FAILED, StopReason.ERROR, error.message, error.reason, transcript=False)
            return (StoreEndAlone(wait=True), ForgetAfterPublish())
        message = f"rcoder could not record the end of this turn ({error.message}); the agent's answer is lost"
        self.outcome = Outcome(RunStatus.FAILED, StopReason.ERROR, message, error.reason, self.outcome.transcript)
        closed = isinstance(error, StoreError) and error.closed
        return (StoreEndAlone(wait=False),) if closed else (StoreEndAlone(wait=False), RetryEndLater())

    @property
    def stopping(self) -> bool:
        """Whether the turn ended because rcoder is stopping."""
        return self._stopping

    @property
    def agent_broken(self) -> bool:
        """Whether the session's agent must not serve another turn: an error (a turn rcoder
        stopped for a cause carries its text, but is a cancel to its agent)."""
        outcome = self.outcome
        if outcome is None:
            return False
        if self.cause is not None and outcome.status is RunStatus.COMPLETED:
            return False
        return outcome.status is not RunStatus.COMPLETED or bool(outcome.error)


def _error_of(event: AgentEnded | Failed | TimedOut | Stopping) -> RcoderError:
    """The error a caller gets for a turn that ends before its start is out."""
    match event:
        case Failed(error=error) | TimedOut(error=error):
            return error
        case Stopping():
            return ShuttingDown()
    return Internal(RuntimeError("the turn ended without starting"))

"""What the driver of a turn tells its state machine (events) and what the machine tells back
(actions), with the values both speak of: the turn's phase, why rcoder stopped it, and how it
ended. The machine itself, and the table of what each event does in each phase, are in
``session.turns.machine``."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from rcoder.domain import RunStatus, StopReason
from rcoder.errors import AgentError, RcoderError


class Phase(enum.Enum):
    """Where a turn stands. It only moves forward (see the module docstring)."""

    CLAIMED = "claimed"  # registered, its task not yet begun
    OPENING = "opening"  # its agent starting, its session opening
    OPENED = "opened"  # the session is open, the prompt not yet sent
    PROMPTING = "prompting"  # the prompt is with the agent
    ENDED = "ended"  # how it ended is decided: a cancel from now on is too late


BEFORE_END = (Phase.CLAIMED, Phase.OPENING, Phase.OPENED, Phase.PROMPTING)


@dataclass(frozen=True)
class StopCause:
    """Why rcoder itself stopped a turn (a budget spent, a limit reached), and so how the turn
    ends: with ``stop`` and the error text and reason, as a cancel would (``session/cancel``,
    the group ended after ``cancel_grace``), instead of ``CANCELLED``. The agent is not broken
    by it: it stays live for the next turn, which a guard may still refuse."""

    stop: StopReason
    error: str
    error_reason: str


@dataclass(frozen=True)
class Outcome:
    """How a started turn ended: what the store records and ``completed`` says. ``transcript``
    is False when the agent's answer must not be kept (the turn did not end normally)."""

    status: RunStatus
    stop: StopReason
    error: str = ""
    error_reason: str = ""
    transcript: bool = True


# ---------------------------------------------------------------- events


@dataclass(frozen=True)
class Begin:
    """The claimed turn's task starts opening its session."""


@dataclass(frozen=True)
class SessionOpened:
    """The session is open (a live agent taken, or a new one started and its session opened)."""


@dataclass(frozen=True)
class PromptSent:
    """The prompt is about to go to the agent."""


@dataclass(frozen=True)
class StartRecording:
    """The run's start was handed to the store: from now on the store may hold it."""


@dataclass(frozen=True)
class Started:
    """The store holds the run's start and ``started`` is published."""


@dataclass(frozen=True)
class StartRefused:
    """The store refused the late start, or the start it was writing never landed. ``error``
    None means the error the turn ended with."""

    error: RcoderError | None = None


@dataclass(frozen=True)
class CancelRequested:
    """Someone asked the turn to stop; with ``cause``, rcoder itself did."""

    cause: StopCause | None = None


@dataclass(frozen=True)
class LeaseGone:
    """The session's lease was lost to another host."""

    session_id: str
    generation: int


@dataclass(frozen=True)
class OpeningCancelled:
    """The work of opening the session was cancelled, and the turn's own task was not (a cancel,
    a lost lease, or the pool letting go of the agent as rcoder stops)."""


@dataclass(frozen=True)
class AgentEnded:
    """The turn's work returned: the agent answered the prompt with ``stop``, or a cancel kept
    the prompt back and the work ended without an error."""

    stop: StopReason = StopReason.END_TURN


@dataclass(frozen=True)
class Failed:
    """The turn's work raised ``error`` (an unexpected exception arrives as ``Internal``)."""

    error: RcoderError


@dataclass(frozen=True)
class TimedOut:
    """The agent did not finish the turn within ``turn_timeout``."""

    error: AgentError


@dataclass(frozen=True)
class Stopping:
    """rcoder is stopping: the turn's task was cancelled."""


@dataclass(frozen=True)
class EndRefused:
    """The store refused the end of the run with ``error`` (``LeaseLost`` or ``StoreError``)."""

    error: RcoderError


Event = (
    Begin | SessionOpened | PromptSent | StartRecording | Started | StartRefused | CancelRequested | LeaseGone
    | OpeningCancelled | AgentEnded | Failed | TimedOut | Stopping | EndRefused
)  # fmt: skip

# ---------------------------------------------------------------- actions


@dataclass(frozen=True)
class Abandon:
    """Do not take the step: raise ``error`` in the turn's task."""

    error: RcoderError


@dataclass(frozen=True)
class Propagate:
    """Nobody asked the turn to stop: let the cancellation of the opening go on."""


@dataclass(frozen=True)
class CancelOpening:
    """Cancel the work of opening the session, if it runs in a task (a live agent is taken at once)."""


@dataclass(frozen=True)
class AskAgentToStop:
    """Send ``session/cancel`` now, and end the agent's process group after ``cancel_grace``."""


@dataclass(frozen=True)
class TooLate:
    """The cancel is refused: the turn has already ended."""


@dataclass(frozen=True)
class RecordStartAnyway:
    """Record the run as started (as its session opened, or as never opened), then send ``Started``."""


@dataclass(frozen=True)
class CheckStartLanded:
    """Read the store: ``Started`` if the start being written landed, ``StartRefused`` if not."""


@dataclass(frozen=True)
class Refuse:
    """The turn never started: the caller gets ``error``, and nothing of the turn is kept. An
    agent that ``heard`` the prompt holds a turn the store does not, so it must not be reused."""

    error: RcoderError
    heard: bool


@dataclass(frozen=True)
class Finish:
    """Store the end of the run and publish ``completed`` as ``outcome`` says."""

    outcome: Outcome


@dataclass(frozen=True)
class StoreEndAlone:
    """The end was not stored with the run's history: store ``completed`` on its own, and wait
    for that write only if ``wait`` (a store that just refused is not waited for again)."""

    wait: bool


@dataclass(frozen=True)
class RetryEndLater:
    """Retry, bounded and in the background, storing the end the stream publishes."""


@dataclass(frozen=True)
class ForgetAfterPublish:
    """Do not keep the run for ``Subscribe`` once its end is published: another host ended it."""


Action = (
    Abandon | Propagate | CancelOpening | AskAgentToStop | TooLate | RecordStartAnyway | CheckStartLanded
    | Refuse | Finish | StoreEndAlone | RetryEndLater | ForgetAfterPublish
)  # fmt: skip

"""rcoder's own errors: a small tree grouped by what the caller can do.

Each carries fields, not just a string; ``api/service.py`` maps them to gRPC
codes in one table. ``reason`` becomes the ``google.rpc.ErrorInfo`` reason.
"""

from __future__ import annotations


class RcoderError(Exception):
    """Base of every error rcoder raises on purpose."""

    reason = "RCODER_ERROR"

    def __init__(self, message: str, **metadata: str) -> None:
        super().__init__(message)
        self.message = message
        # string fields for ErrorInfo.metadata (and logs)
        self.metadata = {k: v for k, v in metadata.items() if v}


class ConfigError(RcoderError):
    """The configuration is wrong; ``key`` names the offending key (the first, when ``problems``
    holds several: every one found at once, each a key and what is wrong with it)."""

    reason = "CONFIG_INVALID"

    def __init__(self, key: str, problem: str, more: tuple[tuple[str, str], ...] = ()) -> None:
        self.problems = ((key, problem), *more)
        lines = [f"config key {k!r}: {p}" for k, p in self.problems]
        text = lines[0] if not more else f"{len(lines)} problems in the configuration:\n  " + "\n  ".join(lines)
        super().__init__(text, key=key)
        self.key = key

    @classmethod
    def joined(cls, errors: list[ConfigError]) -> ConfigError:
        """One error holding every problem of ``errors`` (not empty), in order."""
        problems = tuple(problem for error in errors for problem in error.problems)
        return cls(*problems[0], more=problems[1:])


# ---------------------------------------------------------------- caller's fault


class InvalidArgument(RcoderError):
    """A request field is wrong; ``field`` names it."""

    reason = "INVALID_ARGUMENT"

    def __init__(self, field: str, problem: str, reason: str = "INVALID_ARGUMENT") -> None:
        super().__init__(f"{field}: {problem}", field=field)
        self.field = field
        self.reason = reason


class NotFound(RcoderError):
    reason = "NOT_FOUND"

    def __init__(self, kind: str, ident: str, hint: str = "") -> None:
        text = f"{kind} {ident!r} not found" + (f": {hint}" if hint else "")
        super().__init__(text, kind=kind, id=ident)
        self.reason = f"{kind.upper().replace(' ', '_')}_NOT_FOUND"


class PermissionDenied(RcoderError):
    reason = "PERMISSION_DENIED"

    def __init__(self, message: str, reason: str = "PERMISSION_DENIED", **metadata: str) -> None:
        super().__init__(message, **metadata)
        self.reason = reason


class UnsafePath(RcoderError):
    """rcoder refused to act, unconfined, on a path an agent (or whoever wrote the store) controls:
    a link planted where an agent can write, a session's stored cwd that is not its project's
    folder. Trying again changes nothing until the operator removes the cause."""

    reason = "UNSAFE_PATH"

    def __init__(self, message: str, reason: str = "UNSAFE_PATH", **metadata: str) -> None:
        super().__init__(message, **metadata)
        self.reason = reason


class FailedPrecondition(RcoderError):
    """The request is sound but the state of things refuses it (a folder where a file was asked
    for, a project where a turn runs); ``reason`` names which. Trying again helps only once that
    state has changed."""

    def __init__(self, message: str, reason: str, **metadata: str) -> None:
        super().__init__(message, **metadata)
        self.reason = reason


class ProjectBusy(FailedPrecondition):
    """A turn runs in the project, and what was asked needs its files to hold still: a file RPC
    without ``while_busy`` (docs/files.md), ``RewindSession`` (docs/checkpoints.md). ``advice``
    says what the caller can do."""

    def __init__(self, project_id: str, run_id: str, advice: str) -> None:
        super().__init__(
            f"a turn (run {run_id}) runs in project {project_id!r}: its agent may be changing these files. {advice}",
            reason="PROJECT_BUSY",
            project_id=project_id,
            run_id=run_id,
        )


class OtherSessionsWork(FailedPrecondition):
    """A rewind would undo what later runs of other sessions wrote (docs/checkpoints.md#other-sessions-work):
    refused unless the request says to take them too."""

    def __init__(self, run_ids: list[str], session_ids: list[str]) -> None:
        shown = ", ".join(run_ids[:10]) + (f" and {len(run_ids) - 10} more" if len(run_ids) > 10 else "")
        super().__init__(
            f"rewinding would undo files that later runs of other sessions wrote: run(s) {shown} (session(s) "
            f"{', '.join(session_ids)}). Set include_other_sessions to undo them too; those sessions are told",
            reason="OTHER_SESSIONS_WORK",
            run_ids=",".join(run_ids),
            session_ids=",".join(session_ids),
        )


class Sha256Mismatch(RcoderError):
    """A compare-and-swap write (``if_sha256``) found another file than the one it was based on:
    read it again, redo the change, and write with the new SHA-256 (ABORTED, as gRPC's codes ask
    of a failed test-and-set)."""

    reason = "SHA256_MISMATCH"

    def __init__(self, path: str, expected: str, current: str) -> None:
        now = f"its SHA-256 is now {current}" if current else "there is no file there now"
        super().__init__(
            f"{path!r} changed: the write expected {expected}, {now}; read it again and redo the change",
            path=path,
            expected_sha256=expected,
            current_sha256=current or "absent",
        )


class OutOfRange(RcoderError):
    reason = "OUT_OF_RANGE"


class Unimplemented(RcoderError):
    reason = "UNIMPLEMENTED"


class Unauthenticated(RcoderError):
    reason = "UNAUTHENTICATED"


# ---------------------------------------------------------------- try again later


class SessionBusy(RcoderError):
    """A turn is already running on this session."""

    reason = "SESSION_BUSY"

    def __init__(self, session_id: str, run_id: str) -> None:
        super().__init__(
            f"session busy: run {run_id} is still running on session {session_id}; "
            "wait for it to complete, Subscribe to it, or Cancel it",
            session_id=session_id,
            run_id=run_id,
        )


class SessionDeleting(RcoderError):
    """The session is being deleted (``DeleteSession``): no new turn starts on it."""

    reason = "SESSION_DELETING"

    def __init__(self, session_id: str) -> None:
        super().__init__(
            f"session {session_id} is being deleted; once it is, its id is unknown (start a new session)",
            session_id=session_id,
        )


class AgentLimitReached(RcoderError):
    """Every live agent slot is taken by a busy agent."""

    reason = "AGENT_LIMIT_REACHED"

    def __init__(self, limit: int) -> None:
        super().__init__(
            f"all {limit} live agents are busy (agent_processes.max_live = {limit}); retry when a turn finishes",
            limit=str(limit),
        )


class ResourceExhausted(RcoderError):
    """A bound on what rcoder holds was reached (followers of a run, calls at once); ``reason``
    names which, and the message its config key."""

    reason = "RESOURCE_EXHAUSTED"

    def __init__(self, message: str, reason: str, **metadata: str) -> None:
        super().__init__(message, **metadata)
        self.reason = reason


class WorkspaceTooLarge(ResourceExhausted):
    """A project's folder holds more than its profile's ``workspace_max_bytes``: no turn starts in
    it until files are removed (docs/limits.md#disk)."""

    def __init__(self, project_id: str, size: int, limit: int, agent: str) -> None:
        super().__init__(
            f"project {project_id!r} holds {human_bytes(size)} ({size} bytes) in its workspace, past "
            f"agents.{agent}.workspace_max_bytes {human_bytes(limit)} ({limit} bytes); remove files from the "
            "project (build outputs, caches) or raise the limit, then send the turn again",
            reason="WORKSPACE_TOO_LARGE",
            project_id=project_id,
            size_bytes=str(size),
            limit_bytes=str(limit),
        )
        self.project_id, self.size, self.limit = project_id, size, limit


class BudgetExceeded(ResourceExhausted):
    """A budget (docs/budgets.md) is spent: ``spent`` is at or past ``cap`` of the config key
    ``budget``, so no turn that it bounds starts until the budget is raised (or, for a project's
    day, the next UTC day). ``message`` says whose spend and what to do."""

    def __init__(self, message: str, budget: str, cap: str, spent: str, **ids: str) -> None:
        super().__init__(message, reason="BUDGET_EXCEEDED", budget=budget, cap=cap, spent=spent, **ids)
        self.budget, self.cap, self.spent = budget, cap, spent


def human_bytes(count: int) -> str:
    """``count`` bytes as a person reads them: "17 B", "512.0 KiB", "1.2 GiB"."""
    value, units = float(count), ("B", "KiB", "MiB", "GiB", "TiB")
    step = 0
    while value >= 1024 and step < len(units) - 1:
        value, step = value / 1024, step + 1
    return f"{count} B" if step == 0 else f"{value:.1f} {units[step]}"


class ShuttingDown(RcoderError):
    reason = "SHUTTING_DOWN"

    def __init__(self) -> None:
        super().__init__("rcoder is shutting down; retry against another instance or after restart")


class TurnContinuesElsewhere(RcoderError):
    """rcoder is stopping and left a relayed turn running in its relay (docs/relay.md#re-attach):
    the stream that follows it here ends; the next daemon takes the turn up, and a client
    subscribes there from the last seq it saw."""

    reason = "TURN_CONTINUES_ELSEWHERE"

    def __init__(self, run_id: str, last_seq: int) -> None:
        super().__init__(
            f"rcoder is stopping; the turn goes on: Subscribe(run_id={run_id}, after_seq={last_seq}) on the "
            "next daemon (after_seq: the last seq you saw, if lower)",
            run_id=run_id,
            last_seq=str(last_seq),
        )


class StoreError(RcoderError):
    """The store could not do what was asked: unavailable, closed, or it refused the write.
    ``closed``: it is closed for good (rcoder is stopping), so trying again is pointless."""

    reason = "STORE_UNAVAILABLE"

    def __init__(self, message: str, *, closed: bool = False, **metadata: str) -> None:
        super().__init__(message, **metadata)
        self.closed = closed


class LeaseLost(RcoderError):
    """This host no longer holds the session's lease (another host took it over, or it expired
    and was revoked): the write about the session was refused, and nothing more is written."""

    reason = "LEASE_LOST"

    def __init__(self, session_id: str, generation: int) -> None:
        super().__init__(
            f"this host lost the lease of session {session_id} (generation {generation}); another host "
            "serves it now: retry, and the request reaches that host",
            session_id=session_id,
            generation=str(generation),
        )
        self.session_id = session_id
        self.generation = generation


class OwnedElsewhere(RcoderError):
    """Another live host holds the session's (or the run's) lease: the request belongs there. The
    API forwards it; a client sees this only when that host could not be reached in time."""

    reason = "OWNED_BY_ANOTHER_HOST"

    def __init__(self, kind: str, ident: str, host_id: str, address: str, retry_after: float = 1.0) -> None:
        super().__init__(
            f"{kind} {ident} is served by host {host_id!r} ({address or 'address unknown'}), which did not "
            f"answer in time; its lease has not expired yet: retry in {retry_after:g} s",
            **{kind: ident, "owner": host_id, "owner_address": address},
        )
        self.host_id = host_id
        self.address = address
        self.retry_after = retry_after


class RunCancelled(RcoderError):
    """A turn was cancelled (``Cancel``) before its agent was ready."""

    reason = "RUN_CANCELLED"

    def __init__(self, run_id: str, phase: str) -> None:
        super().__init__(f"run {run_id} was cancelled while {phase}", run_id=run_id)


class Internal(RcoderError):
    """Something rcoder did not expect: a bug. Logged with its traceback where it happened."""

    reason = "INTERNAL"

    def __init__(self, exc: BaseException) -> None:
        super().__init__(f"internal error: {type(exc).__name__}: {exc}")


# ---------------------------------------------------------------- agent failures


class AgentError(RcoderError):
    """The agent failed. ``stderr_tail`` holds its last words, when it has any."""

    reason = "AGENT_ERROR"

    def __init__(self, message: str, *, agent: str = "", stderr_tail: str = "", **metadata: str) -> None:
        full = message + (f"\n--- agent stderr (tail) ---\n{stderr_tail}" if stderr_tail else "")
        super().__init__(full, agent=agent, **metadata)
        self.summary = message
        self.agent = agent
        self.stderr_tail = stderr_tail


class AgentUnavailable(AgentError):
    """The agent could not be started (missing command, exited at once, failed initialize)."""

    reason = "AGENT_UNAVAILABLE"


class AgentTimeout(AgentUnavailable):
    """The agent did not answer a start-up step (initialize, session open) in time."""

    reason = "AGENT_TIMEOUT"


class AgentAuthRequired(AgentUnavailable):
    """The agent answered -32000: its model credentials are missing or wrong."""

    reason = "AGENT_AUTH_REQUIRED"


class AgentCrashed(AgentError):
    """The agent process ended while rcoder needed it."""

    reason = "AGENT_CRASHED"


class AgentStoppedAtLimit(AgentCrashed):
    """The kernel stopped the agent at one of its profile's limits (docs/limits.md): its memory_max."""

    reason = "AGENT_MEMORY_LIMIT"

    def __init__(self, message: str, *, agent: str = "", limit: str = "", stderr_tail: str = "") -> None:
        super().__init__(message, agent=agent, stderr_tail=stderr_tail, limit=limit)
        self.limit = limit


class ContainerEngineError(AgentUnavailable):
    """The container engine (Docker's API, or podman's compatible one) refused or failed a call that
    starts or ends a relay's container (docs/relay.md#containers): the agent cannot start there."""

    reason = "CONTAINER_ENGINE_ERROR"

    def __init__(self, call: str, status: int, message: str) -> None:
        said = f"status {status}: " if status else ""
        super().__init__(f"container engine, {call}: {said}{message}", call=call, status=str(status or ""))
        self.call = call
        self.status = status


class AgentClosed(AgentError):
    """rcoder itself ended the agent (a cancel past its grace, idle closing, shutdown): not a fault of the agent."""

    reason = "AGENT_CLOSED"


class AgentProtocolError(AgentError):
    """The agent answered with an error rcoder cannot act on."""

    reason = "AGENT_PROTOCOL_ERROR"

    def __init__(self, message: str, *, code: int = 0, **kwargs: str) -> None:
        super().__init__(message, code=str(code), **kwargs)
        self.code = code


class SessionGone(AgentError):
    """The agent no longer has the conversation asked for (classified, never guessed)."""

    reason = "SESSION_GONE"

    def __init__(self, provider_session_id: str, why: str, *, agent: str = "", stderr_tail: str = "") -> None:
        super().__init__(
            f"agent no longer has session {provider_session_id}: {why}",
            agent=agent,
            stderr_tail=stderr_tail,
            provider_session_id=provider_session_id,
        )
        self.provider_session_id = provider_session_id
        self.why = why


class RelayUnavailable(RcoderError):
    """A relayed project's relay could not be reached, or refused the daemon itself (its secret):
    its files and checkpoints are there and nowhere else (docs/relay.md#files-and-checkpoints)."""

    reason = "RELAY_UNAVAILABLE"


# ---------------------------------------------------------------- checkpoints (docs/checkpoints.md)


class CheckpointError(RcoderError):
    """git could not read or write a project's checkpoint store (``step`` names the git command)."""

    reason = "CHECKPOINT_FAILED"

    def __init__(self, step: str, message: str) -> None:
        super().__init__(message, step=step)
        self.step = step


class NoCheckpoint(RcoderError):
    """The run has no snapshot to serve what was asked (checkpoints off, or the run never took one)."""

    reason = "NO_CHECKPOINT"

    def __init__(self, run_id: str, which: str, why: str, host_id: str = "") -> None:
        # host_id: the host whose checkpoint_root holds the run's snapshots, when it is not this one's
        super().__init__(f"run {run_id} has no {which} snapshot: {why}", run_id=run_id, which=which, host_id=host_id)


# ---------------------------------------------------------------- the daemon's start


class DataDirInUse(RcoderError):
    """Another daemon holds ``data_dir``: this one starts nothing and touches nothing there."""

    reason = "DATA_DIR_IN_USE"

    def __init__(self, data_dir: str, holder: dict[str, object]) -> None:
        pid = holder.get("pid") or "unknown"
        listen = holder.get("listen") or "an address not yet known"
        where = f"listening on {listen}" if holder.get("serving") else f"starting, to listen on {listen}"
        super().__init__(
            f"data_dir {data_dir} is in use by another rcoder daemon (pid {pid}, {where}); "
            "stop it, or give this one a data_dir of its own (RCODER_DATA_DIR, data_dir in the config, "
            "or --data-dir)",
            data_dir=data_dir,
            pid=str(pid),
            listen=str(listen),
        )
        self.holder = holder


class ListenFailed(RcoderError):
    """The daemon could not listen on its address (taken by another program, or not this host's)."""

    reason = "LISTEN_FAILED"

    def __init__(self, address: str, why: str) -> None:
        super().__init__(
            f"cannot listen on {address}: {why}; pick another address with RCODER_LISTEN=host:port, "
            'listen = "host:port" in the config, or --listen host:port',
            address=address,
        )
        self.address = address

"""A live agent: its process, the ACP connection, and one open session.

Every SDK call goes through ``_call``, which bounds it, and translates the
SDK's errors into rcoder's at this edge.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from typing import Any, TypeVar

import pydantic
from acp import RequestError
from acp import schema as acp
from acp.client.connection import ClientSideConnection

from rcoder import tracing
from rcoder.agent.acp.classify import auth_reason, details, gone_reason, gone_reason_from_stderr
from rcoder.agent.acp.client import AcpClientHandler, EventSink, PermissionDecider
from rcoder.agent.acp.convert import AcpContentBlock, AcpMcpServer, mcp_server, stop_reason
from rcoder.agent.acp.listing import ListKey, SessionLists
from rcoder.agent.acp.options import acp_options
from rcoder.agent.acp.start_config import AgentStartConfig
from rcoder.agent.acp.transport import Pace, PipeTransport
from rcoder.agent.processes.process import AgentProcess
from rcoder.agent.processes.relayed import RelayedChild, RelayPlace
from rcoder.agent.profiles.kinds import GENERIC, AgentKind
from rcoder.domain import (
    OPTION_BOOLEAN,
    OPTION_MODE,
    AgentCapabilities,
    AvailableCommands,
    ConfigOption,
    OpenMethod,
    SlashCommand,
    StopReason,
    Usage,
)
from rcoder.errors import (
    AgentAuthRequired,
    AgentClosed,
    AgentCrashed,
    AgentError,
    AgentProtocolError,
    AgentStoppedAtLimit,
    AgentTimeout,
    AgentUnavailable,
    SessionGone,
)
from rcoder.logs import get_logger

log = get_logger(__name__)
T = TypeVar("T")


def capabilities_from_initialize(init: acp.InitializeResponse) -> AgentCapabilities:
    """What the agent advertised in ``initialize``, in our terms."""
    caps = init.agent_capabilities or acp.AgentCapabilities()
    sessions = caps.session_capabilities
    prompt = caps.prompt_capabilities
    mcp = caps.mcp_capabilities
    info = init.agent_info
    return AgentCapabilities(
        load_session=bool(caps.load_session),
        session_resume=sessions is not None and sessions.resume is not None,
        session_close=sessions is not None and sessions.close is not None,
        session_list=sessions is not None and sessions.list is not None,
        session_fork=sessions is not None and sessions.fork is not None,
        prompt_image=bool(prompt and prompt.image),
        prompt_audio=bool(prompt and prompt.audio),
        prompt_embedded_context=bool(prompt and prompt.embedded_context),
        mcp_http=bool(mcp and mcp.http),
        mcp_sse=bool(mcp and mcp.sse),
        agent_name=info.name if info else "",
        agent_version=info.version if info else "",
    )


class TurnFrames:
    """A turn's hold on a relayed agent's frames (docs/relay.md#re-attach): which frame the
    update being handled came in (``current``), and that the relay may let go of the frames whose
    events are stored (``stored``), and no others until ``close``."""

    def __init__(self, child: RelayedChild, pipe: PipeTransport) -> None:
        self._child, self._pipe = child, pipe
        self.base = self.current()  # the frame the agent's output was handled up to as the turn began
        child.hold_acks(self.base)

    def current(self) -> int:
        return self._child.frame_at(self._pipe.position)

    def stored(self, frame: int) -> None:
        self._child.ack_through(frame)

    def close(self) -> None:
        self._child.release_acks()


class AgentConnection:
    """Owns an agent process and its ACP connection. ``aclose()`` is bounded and idempotent."""

    def __init__(
        self,
        process: AgentProcess,
        pipe: PipeTransport,
        conn: ClientSideConnection,
        handler: AcpClientHandler,
        agent: str,
        capabilities: AgentCapabilities,
        stop_grace: float,
        kind: AgentKind = GENERIC,
        lists: SessionLists | None = None,
        key_variable: str = "",
        held_key: Mapping[str, str] | None = None,
        relayed: RelayedChild | None = None,
        provider_session_id: str = "",
    ) -> None:
        self.process = process
        # a warm agent started without its model key: the variables that hold it, handed over at
        # the session's opening once a request claimed it (docs/placement.md#warm-agents-and-keys)
        self.held_key: Mapping[str, str] = held_key or {}
        self._relayed = relayed  # the relay's child, when a relay runs the agent (docs/relay.md#placement)
        self._kind = kind
        self._key_variable = key_variable  # where its model key comes from, named when the agent refuses it
        self._pipe = pipe
        self._conn = conn
        self._handler = handler
        self.agent = agent
        self.capabilities = capabilities
        self.start_seconds = 0.0  # its start, prepared to initialized (``initialized``)
        self._stop_grace = stop_grace
        self.provider_session_id = provider_session_id  # a re-attached agent's session is open already
        # set when the warm pool opened a plain session ahead of any request, for this cwd
        self.primed_cwd = ""
        self._closed = False
        self._close_lock = asyncio.Lock()
        # what the agent reported its last turn cost, however that turn ended (answered or not)
        self.turn_usage: Usage | None = None
        # The launcher's session lists (``agent.acp.listing``), told the provider session id after each
        # turn, under ``list_key`` (its home and cwd), which the launcher gives once the session is
        # open (``listed_under``): the lists are an object below both, held from construction,
        # rather than a callback into the launcher assigned afterwards.
        self._lists = lists
        self.list_key: ListKey | None = None
        # the version of the options and commands the session's record holds (-1: none stored from here)
        self.stored_state_version = -1

    @property
    def relay_place(self) -> RelayPlace | None:
        """Where the relay that runs the agent is (None: a local agent)."""
        return self._relayed.place if self._relayed is not None else None

    def detach(self) -> bool:
        """rcoder stops and leaves a relayed agent running for the next daemon: its stream closed,
        nothing more sent to it (docs/relay.md#re-attach). False for a local agent."""
        if self._relayed is None:
            return False
        self._relayed.detach()
        self.process.detach()
        return True

    def leave_to_relay(self) -> bool:
        """The session's lease was lost: a relayed agent is left running in its relay for the host
        that took the session (docs/relay.md#fencing), sent nothing (no request, no signal, no end
        of stdin), and our end of its stdout closed, so what reads it here (a turn) ends. False
        for a local agent."""
        if self._relayed is None:
            return False
        self._relayed.abandon()
        self.process.detach()
        return True

    def turn_frames(self) -> TurnFrames | None:
        """For a turn whose events are stored from a relayed agent's frames: the frames held
        until stored (None: a local agent, nothing to hold)."""
        return TurnFrames(self._relayed, self._pipe) if self._relayed is not None else None

    def initialized(self, capabilities: AgentCapabilities, start_seconds: float = 0.0) -> None:
        """The agent answered ``initialize``: what it can do (the launcher, before it hands this out),
        and how long its start took, from its preparation to that answer."""
        self.capabilities = capabilities
        self.start_seconds = start_seconds

    def listed_under(self, key: ListKey) -> None:
        """Its session is open: each turn's end marks it active in the session lists under ``key``."""
        self.list_key = key

    def state_stored(self, version: int) -> None:
        """The session's record holds the options and commands of ``version`` (``state_version``)."""
        self.stored_state_version = version

    def usage_so_far(self) -> Usage | None:
        """The running turn's usage as the agent's last ``usage_update`` says (None: none yet)."""
        return self._handler.usage.so_far()

    def turn_cost(self) -> tuple[float | None, str]:
        """The running turn's cost and currency as the agent's last ``usage_update`` says (None: none
        reported yet); ``turn_usage`` once it ended."""
        return self._handler.usage.cost_so_far()

    @property
    def alive(self) -> bool:
        # an agent whose output ended cannot answer, even while its process lingers
        return not self._closed and self.process.is_running() and not self._pipe.ended

    async def replay_over(self, quiet: float, limit: float) -> str:
        """Wait until the replay of the ``session/load`` just answered is over (``agent.acp.replay``)."""
        watch = self._handler.replay.watch
        if watch is None:
            return "none"
        try:
            return await watch.wait(quiet, limit)
        finally:
            self._handler.replay.disarm()

    # ------------------------------------------------------------ opening

    async def open_session(self, config: AgentStartConfig, timeout: float) -> OpenMethod:
        """Open the session ``config`` asks for, by the route it names."""
        servers: list[AcpMcpServer] = [mcp_server(s) for s in config.mcp_servers]
        method = config.resume_method if config.resume_session_id else OpenMethod.NEW
        rid = config.resume_session_id
        self._opening(rid if method in (OpenMethod.RESUME, OpenMethod.LOAD) else "")
        response: Any
        if method is OpenMethod.RESUME:
            response = await self._call(
                self._conn.resume_session(session_id=rid, cwd=config.cwd, mcp_servers=servers, **tracing.agent_meta()),
                timeout, "session/resume", resuming=rid,
            )  # fmt: skip
            session_id = rid
        elif method is OpenMethod.LOAD:
            # The replay is watched from before the request is sent, because an agent that answers
            # first may start replaying at once.
            self._handler.replay.arm(config.replay_end)
            response = await self._call(
                self._conn.load_session(session_id=rid, cwd=config.cwd, mcp_servers=servers, **tracing.agent_meta()),
                timeout, "session/load", resuming=rid,
            )  # fmt: skip
            session_id = rid
        else:
            meta = tracing.with_agent_meta(config.build_meta())  # the trace context's keys are rcoder's
            response = await self._call(
                self._conn.new_session(cwd=config.cwd, mcp_servers=servers, **meta),
                timeout, "session/new", resuming=rid if method is OpenMethod.META else "",
            )  # fmt: skip
            session_id = response.session_id
        self.provider_session_id = session_id
        self._handler.serve(session_id)
        self._handler.state.opened(response)
        return method or OpenMethod.NEW

    def _opening(self, session_id: str) -> None:
        """Before asking for a session: what the agent says of it from now on is its state (and
        of its id, where known: a new session's updates may come before its answer is read)."""
        self._handler.serve(session_id)
        self._handler.state.opening()

    async def list_page(self, cwd: str, cursor: str | None, timeout: float) -> tuple[list[str], str | None]:
        """One page of ``session/list`` for ``cwd``: the session ids and the next cursor (None: the end)."""
        response = await self._call(self._conn.list_sessions(cwd=cwd, cursor=cursor), timeout, "session/list")
        return [info.session_id for info in response.sessions], response.next_cursor or None

    async def fork_session(self, config: AgentStartConfig, timeout: float) -> OpenMethod:
        """Open a new session that branches from ``config.fork_from`` (``session/fork``)."""
        servers: list[AcpMcpServer] = [mcp_server(s) for s in config.mcp_servers]
        self._opening("")
        response = await self._call(
            self._conn.fork_session(
                session_id=config.fork_from, cwd=config.cwd, mcp_servers=servers, **tracing.agent_meta()
            ),
            timeout, "session/fork", resuming=config.fork_from,
        )  # fmt: skip
        self.provider_session_id = response.session_id
        self._handler.serve(response.session_id)
        self._handler.state.opened(response)
        return OpenMethod.FORK

    async def prime(self, cwd: str, timeout: float) -> None:
        """Open a plain new session for ``cwd`` before any request wants it (the warm pool)."""
        await self.open_session(AgentStartConfig(cwd=cwd), timeout)
        self.primed_cwd = cwd

    async def take_primed(self, config: AgentStartConfig) -> bool:
        """Whether the session opened ahead of time is the one ``config`` asks for (then it is
        this request's). If not, it is closed where the agent can (bounded by the stop grace;
        an agent without ``session/close`` keeps it idle until it ends)."""
        cwd, self.primed_cwd = self.primed_cwd, ""
        if not cwd or (config.is_plain() and config.cwd == cwd):
            return bool(cwd)
        primed, self.provider_session_id = self.provider_session_id, ""
        if self.capabilities.session_close and self.alive:
            try:
                await self._call(self._conn.close_session(session_id=primed), self._stop_grace, "session/close")
            except AgentError as exc:  # it stays idle in the agent until the agent ends
                log.info("agent_session_not_closed", agent=self.agent, error=exc.summary)
        return False

    # ------------------------------------------------------------ options

    @property
    def options(self) -> tuple[ConfigOption, ...]:
        """The session's config options as the agent reported them last, current values included."""
        return self._handler.state.options

    @property
    def state_version(self) -> int:
        """Changes with every change of the options or commands."""
        return self._handler.state.version

    @property
    def commands(self) -> tuple[SlashCommand, ...] | None:
        """The session's slash commands as the agent listed them last (None: it never did)."""
        return self._handler.state.commands

    async def set_option(self, option: ConfigOption, value: str, timeout: float) -> None:
        """Set one option the agent offers to one of its values: ``session/set_config_option``,
        or ``session/set_mode`` for its modes (``OPTION_MODE``)."""
        state, sid = self._handler.state, self.provider_session_id
        if option.type == OPTION_MODE:
            await self._call(self._conn.set_session_mode(session_id=sid, mode_id=value), timeout, "session/set_mode")
            state.set_mode(value)
            return
        choice: str | bool = value == "true" if option.type == OPTION_BOOLEAN else value
        response = await self._call(
            self._conn.set_config_option(config_id=option.id, session_id=sid, value=choice),
            timeout, "session/set_config_option",
        )  # fmt: skip
        state.set_config(acp_options(response.config_options))

    # ------------------------------------------------------------ turns

    async def prompt(
        self,
        blocks: list[AcpContentBlock],
        on_event: EventSink,
        on_permission: PermissionDecider,
        timeout: float | None = None,
        pace: Pace | None = None,
        on_sent: Callable[[int], None] | None = None,
    ) -> StopReason:
        """Run one turn; updates go to ``on_event`` as they arrive, and while ``pace`` answers an
        event the agent's output is not read (``PipeTransport.pace_by``). Not answered within
        ``timeout`` (``turn_timeout``), it fails with ``AgentTimeout``. ``on_sent`` is told the
        JSON-RPC id the prompt went out with, as it goes."""
        if on_sent is not None:
            self._pipe.on_prompt_sent(on_sent)
        self._handler.begin_turn(on_event, on_permission)
        self._pipe.pace_by(pace)
        self.turn_usage = None
        untold = self._handler.state.take_untold_commands()
        if untold is not None:  # listed since the last turn (after session/new, say): this turn tells them
            on_event(AvailableCommands(untold))
        try:
            try:
                response = await self._call(
                    self._conn.prompt(session_id=self.provider_session_id, prompt=blocks, **tracing.agent_meta()),
                    timeout, "session/prompt",
                )  # fmt: skip
            except BaseException:
                # Not answered (cancelled, timed out, the agent gone, rcoder stopping): the turn
                # still cost what the agent last reported, and the next turn's cumulative
                # report is counted from there.
                self.turn_usage = self._handler.usage.end_turn(None)
                raise
        except AgentTimeout as exc:
            raise AgentTimeout(
                f"agent {self.agent!r} did not finish the turn within turns.timeout ({timeout:g}s)",
                agent=self.agent, stderr_tail=exc.stderr_tail,
            ) from exc  # fmt: skip
        finally:
            self._pipe.unpace()
            self._handler.end_turn()
            if self._lists is not None and self.list_key is not None:
                self._lists.active(self.list_key, self.provider_session_id)
        self.turn_usage = self._handler.usage.end_turn(response.usage)
        return stop_reason(response.stop_reason)

    async def resume_prompt(
        self,
        prompt_id: int,
        on_event: EventSink,
        on_permission: PermissionDecider,
        timeout: float | None = None,
        pace: Pace | None = None,
    ) -> StopReason:
        """The rest of a turn another daemon prompted (request ``prompt_id``) on this re-attached
        agent (docs/relay.md#re-attach), as ``prompt`` runs one: its updates to ``on_event``, its
        answer's stop reason."""
        self._handler.begin_turn(on_event, on_permission)
        self._pipe.pace_by(pace)
        self.turn_usage = None
        try:
            try:
                answer: dict[str, Any] = await self._call(_awaited(self._pipe.await_response(prompt_id)), timeout,
                                                          "session/prompt")  # fmt: skip
                if "error" in answer:
                    error = answer["error"]
                    raise RequestError(error.get("code", -32603), error.get("message", ""), error.get("data"))
                response = acp.PromptResponse.model_validate(answer.get("result"))
            except RequestError as exc:
                raise _from_request_error(exc, self.process, self.agent, "session/prompt", "", self._kind,
                                          self._key_variable) from exc  # fmt: skip
            except pydantic.ValidationError as exc:
                raise AgentProtocolError(f"agent {self.agent!r} answered session/prompt with a malformed result",
                                         agent=self.agent) from exc  # fmt: skip
            except BaseException:
                self.turn_usage = self._handler.usage.end_turn(None)
                raise
        finally:
            self._pipe.unpace()
            self._handler.end_turn()
        self.turn_usage = self._handler.usage.end_turn(response.usage)
        return stop_reason(response.stop_reason)

    async def cancel(self) -> None:
        """``session/cancel``; pending permission requests are answered ``cancelled``."""
        self._handler.cancel_turn()
        if self.alive and self.provider_session_id:
            try:
                await self._conn.cancel(session_id=self.provider_session_id)
            except (ConnectionError, OSError) as exc:  # it is ending anyway: its group goes after the grace
                log.info("agent_cancel_not_sent", agent=self.agent, error=str(exc))

    # ------------------------------------------------------------ ending

    async def aclose(self) -> None:
        """Close the session where the agent supports it, then end the process group.

        A second caller waits for the first close to finish.
        """
        async with self._close_lock:
            if self._closed:
                return
            self._closed = True
            self._pipe.unpace()
            self._handler.end_turn()
            await self._close()

    async def _close(self) -> None:
        try:
            if self.capabilities.session_close and self.provider_session_id and self.process.is_running():
                try:  # best effort: the group is ended regardless
                    await self._call(
                        self._conn.close_session(session_id=self.provider_session_id), self._stop_grace,
                        "session/close", closing=False,
                    )  # fmt: skip
                except AgentError as exc:
                    log.info("agent_session_not_closed", agent=self.agent, error=exc.summary)
            # the SDK's close cancels its handler tasks and waits for each: bounded, in case one lingers
            try:
                async with asyncio.timeout(self._stop_grace):
                    await self._conn.close()
            except TimeoutError:
                log.warning("agent_connection_close_timed_out", agent=self.agent, grace=self._stop_grace)
        finally:
            await self.process.aclose()

    # ------------------------------------------------------------ the edge

    async def _call(
        self, call: Coroutine[Any, Any, T], timeout: float | None, step: str, resuming: str = "", closing: bool = True
    ) -> T:
        """One SDK call. A connection rcoder itself closed fails with ``AgentClosed``, never
        as if the agent had broken (``closing=False``: the call is part of closing it)."""
        try:
            return await call_agent(
                self.process, self.agent, call, timeout, step, resuming, self._pipe, self._kind, self._key_variable
            )
        except AgentError as exc:
            if closing and self._closed and not isinstance(exc, AgentClosed):
                raise AgentClosed(f"rcoder ended agent {self.agent!r} during {step}", agent=self.agent) from exc
            raise


async def _awaited(future: asyncio.Future[T]) -> T:
    """``future`` as a coroutine (what ``AgentConnection._call`` bounds)."""
    return await future


async def call_agent(
    process: AgentProcess,
    agent: str,
    call: Awaitable[T],
    timeout: float | None,
    step: str,
    resuming: str = "",
    pipe: PipeTransport | None = None,
    kind: AgentKind = GENERIC,
    key_variable: str = "",
) -> T:
    """Await one ACP call, bounded, with every failure as one of our errors."""
    try:
        async with asyncio.timeout(timeout):
            return await call
    except TimeoutError:
        raise AgentTimeout(
            f"agent {agent!r} did not answer {step} within {timeout:g}s",
            agent=agent,
            stderr_tail=process.stderr_tail(),
        ) from None
    except RequestError as exc:
        raise _from_request_error(exc, process, agent, step, resuming, kind, key_variable) from exc
    except ConnectionError as exc:
        if pipe is not None and pipe.fault:
            raise AgentProtocolError(
                f"agent {agent!r} {pipe.fault} during {step}", agent=agent, stderr_tail=process.stderr_tail()
            ) from exc
        raise await _from_exit(process, agent, step, resuming) from exc
    except pydantic.ValidationError as exc:
        raise AgentProtocolError(
            f"agent {agent!r} answered {step} with a malformed result: {exc.errors()[0].get('msg', exc)}",
            agent=agent,
        ) from exc


def _from_request_error(
    exc: RequestError, process: AgentProcess, agent: str, step: str, resuming: str, kind: AgentKind, key_variable: str
) -> AgentError:
    message = str(exc)
    if resuming:
        # "session gone" is decided here only: the rules every agent shares, then its kind's own
        why = gone_reason(exc.code, message, exc.data) or kind.gone_reason(step, exc.code, message, exc.data)
        if why:
            return SessionGone(resuming, f"{step}: {why}", agent=agent)
    detail = details(exc.data)
    text = f"agent {agent!r} answered {step} with error {exc.code} {message!r}" + (f": {detail}" if detail else "")
    tail = process.stderr_tail()
    if auth_reason(exc.code, message, exc.data) or kind.auth_reason(exc.code, message, exc.data):
        # the fix, not the agent's stderr: its tail tells the reader nothing the variable's name does not
        where = (f"set {key_variable} in the daemon's environment or the profile's model_api_key"
                 if key_variable else "check the model provider's key")  # fmt: skip
        log.info("agent_auth_refused", agent=agent, key_variable=key_variable, stderr_tail=tail)
        return AgentAuthRequired(f"{text} ({where})", agent=agent, key_variable=key_variable)
    return AgentProtocolError(text, code=exc.code, agent=agent, stderr_tail=tail)


async def _from_exit(process: AgentProcess, agent: str, step: str, resuming: str) -> AgentError:
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(1.0):
            await process.wait_exit()
    await process.settle_stderr()
    tail = process.stderr_tail()
    code = process.returncode
    status = f"exited with code {code}" if code is not None else "closed its output"
    # the kernel's limit stopped it: said as such (docs/limits.md#what-a-client-sees-when-a-limit-is-hit)
    reached = process.limit_reached()
    if reached:
        return AgentStoppedAtLimit(
            f"{reached} (memory_max of profile {agent!r}, during {step}): give the profile a larger memory_max, "
            "or ask for work that needs less memory at once",
            agent=agent, limit="memory_max", stderr_tail=tail,
        )  # fmt: skip
    if resuming:
        why = gone_reason_from_stderr(tail)
        if why:
            return SessionGone(resuming, f"{step}: {why}", agent=agent, stderr_tail=tail)
    if step in {"initialize", "session/new", "session/load", "session/resume", "session/fork"}:
        return AgentUnavailable(f"agent {agent!r} {status} during {step}", agent=agent, stderr_tail=tail)
    return AgentCrashed(f"agent {agent!r} {status} during {step}", agent=agent, stderr_tail=tail)

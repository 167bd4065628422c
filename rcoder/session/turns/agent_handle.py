"""What a turn needs of its agent, and no more: the seam where an agent that runs elsewhere (a
relay's, ``placement = "relay"``) takes the place of a local process (docs/design/turn.md#the-parts).

``AgentConnection`` (``rcoder.agent.connection``), over a process the pool holds, is the one kind
today; the turn's parts (runner, ender, records) hold its agent as an ``AgentHandle`` only, so a
handle of another kind needs nothing of theirs changed.
"""

from __future__ import annotations

from typing import Protocol

from rcoder.agent.acp.client import EventSink, PermissionDecider
from rcoder.agent.acp.convert import AcpContentBlock
from rcoder.agent.acp.transport import Pace
from rcoder.domain import AgentCapabilities, ConfigOption, SlashCommand, StopReason, Usage


class AgentHandle(Protocol):
    """One agent serving one session, as its turn sees it."""

    @property
    def capabilities(self) -> AgentCapabilities: ...

    @property
    def provider_session_id(self) -> str: ...  # the agent's own id of the session

    @property
    def turn_usage(self) -> Usage | None: ...  # what the agent reported the running turn cost

    @property
    def stored_state_version(self) -> int: ...  # the options' version the session's record holds

    @property
    def options(self) -> tuple[ConfigOption, ...]: ...

    @property
    def state_version(self) -> int: ...

    @property
    def commands(self) -> tuple[SlashCommand, ...] | None: ...

    def state_stored(self, version: int) -> None: ...

    def usage_so_far(self) -> Usage | None: ...

    async def prompt(
        self,
        blocks: list[AcpContentBlock],
        on_event: EventSink,
        on_permission: PermissionDecider,
        timeout: float | None = None,
        pace: Pace | None = None,
    ) -> StopReason: ...

    async def cancel(self) -> None: ...  # session/cancel: the turn is asked to stop

    async def aclose(self) -> None: ...  # the agent ended, its whole process group

"""An async Python client of the rcoder daemon, on grpc.aio.

::

    from rcoder.client import RcoderClient, Text, NotFound

    async with RcoderClient("127.0.0.1:50051", token="...") as client:
        turn = client.chat("demo", "remember 42")
        async for event in turn:
            if isinstance(event, Text) and not event.thought:
                print(event.text, end="")
        done = await turn.completed()           # the Completed event: stop_reason, error, ...
        again = await client.chat("demo", "which number?", session_id=turn.session_id).text()

Modules: ``connection`` (``RcoderClient`` and ``client.sessions``), ``turn`` (a turn's events and
what they add up to), ``events`` (one dataclass per ``ChatStream`` variant), ``resources`` (sessions,
agents), ``requests`` (what a chat may send), ``errors`` (the exceptions, one per status code family).
It uses only the generated stubs of ``rcoder.v1``: what any client of the daemon uses.
"""

from rcoder.client.connection import DEFAULT_TIMEOUT, RcoderClient, Sessions
from rcoder.client.errors import (
    Busy,
    Cancelled,
    ClientClosed,
    DeadlineExceeded,
    FailedPrecondition,
    IncompleteTurn,
    Internal,
    InvalidArgument,
    NotFound,
    OutOfRange,
    PermissionDenied,
    RcoderClientError,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
    Unimplemented,
)
from rcoder.client.events import (
    AgentUpdate,
    AvailableCommands,
    Completed,
    ConfigOption,
    ConfigOptionUpdate,
    ConfigValue,
    Event,
    Heartbeat,
    PermissionOption,
    PermissionRequest,
    Plan,
    PlanEntry,
    ResumeOutcome,
    SlashCommand,
    Started,
    StopReason,
    Text,
    ToolCall,
    ToolCallUpdate,
    ToolDiff,
    UnknownEvent,
    Usage,
)
from rcoder.client.requests import (
    Attachment,
    ImageAttachment,
    McpHttp,
    McpServer,
    McpStdio,
    ModelProvider,
    PermissionMode,
    ResourceAttachment,
    ResourceLinkAttachment,
    TextAttachment,
)
from rcoder.client.resources import (
    AgentCapabilities,
    AgentInfo,
    CancelResult,
    Cost,
    Fork,
    ForkMethod,
    Session,
    SessionOrder,
    SessionPage,
    SessionStatus,
    UsageTotals,
)
from rcoder.client.tools import ToolCalls, ToolState
from rcoder.client.turn import Turn, TurnResult

__all__ = [
    "DEFAULT_TIMEOUT",
    "AgentCapabilities",
    "AgentInfo",
    "AgentUpdate",
    "Attachment",
    "AvailableCommands",
    "Busy",
    "CancelResult",
    "Cancelled",
    "ClientClosed",
    "Completed",
    "ConfigOption",
    "ConfigOptionUpdate",
    "ConfigValue",
    "Cost",
    "DeadlineExceeded",
    "Event",
    "FailedPrecondition",
    "Fork",
    "ForkMethod",
    "Heartbeat",
    "ImageAttachment",
    "IncompleteTurn",
    "Internal",
    "InvalidArgument",
    "McpHttp",
    "McpServer",
    "McpStdio",
    "ModelProvider",
    "NotFound",
    "OutOfRange",
    "PermissionDenied",
    "PermissionMode",
    "PermissionOption",
    "PermissionRequest",
    "Plan",
    "PlanEntry",
    "RcoderClient",
    "RcoderClientError",
    "ResourceAttachment",
    "ResourceExhausted",
    "ResourceLinkAttachment",
    "ResumeOutcome",
    "Session",
    "SessionOrder",
    "SessionPage",
    "SessionStatus",
    "Sessions",
    "SlashCommand",
    "Started",
    "StopReason",
    "Text",
    "TextAttachment",
    "ToolCall",
    "ToolCallUpdate",
    "ToolCalls",
    "ToolDiff",
    "ToolState",
    "Turn",
    "TurnResult",
    "Unauthenticated",
    "Unavailable",
    "Unimplemented",
    "UnknownEvent",
    "Usage",
    "UsageTotals",
]

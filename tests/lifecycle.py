"""Scenes for the lifecycle tests: a session put in a given state of its turns, on a live daemon.

A scene is one session in one state (``STATES``):

- ``idle``: its agent live, no turn;
- ``starting``: a turn whose agent is being spawned (the fake agent hangs at ``initialize``: its
  ``--hang-if-exists`` gate, told on its ``--tell`` socket, so the test knows that start is the one);
- ``running``: a turn streaming nothing, waiting (``hang``: only a cancel ends it);
- ``permission``: a turn waiting on a permission request asked of the client;
- ``queued1``, ``queued2``: a running turn and one or two turns queued behind it.

Each open stream is an ``Open``: what it is, its call, and its run once known. ``end_of`` reads a
stream to its end and says how it ended in one word, as the tables of the tests write it:
``completed:<STOP_REASON>`` (``/<error_reason>`` when it has one), or ``<CODE>:<ErrorInfo reason>``
for a status.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from google.rpc import error_details_pb2, status_pb2

from rcoder.v1 import agent_runner_pb2 as pb
from tests.harness import Client, Daemon
from tests.turns import Call, read_until

STATES = ("idle", "starting", "running", "permission", "queued1", "queued2")
END_BOUND = 30.0  # seconds: the longest a stream may take to end once its end is due
GATE = "hang-start"
TELL = "tell.sock"


@dataclass
class Open:
    """A stream the scene opened: ``role`` is "running" (the turn that runs or starts), "queued"
    or "new" (a turn the call under test sent)."""

    role: str
    call: Call
    run_id: str = ""
    first: pb.ChatStream | None = None  # what was read of it so far (started, queued, a request)
    events: list[pb.ChatStream] = field(default_factory=list)


@dataclass
class Scene:
    daemon: Daemon
    client: Client
    project_id: str
    session_id: str
    state: str
    last_run_id: str  # the session's run before the scene's turns
    streams: list[Open] = field(default_factory=list)
    permission_id: str = ""
    branch: str = ""  # a session forked from it (the call under test)

    def of(self, role: str) -> list[Open]:
        return [s for s in self.streams if s.role == role]

    @property
    def running(self) -> Open | None:
        return next(iter(self.of("running")), None)


class Teller:
    """The unix socket the fake agents say "hanging initialize" on (``--tell``)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lines: asyncio.Queue[str] = asyncio.Queue()
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> Teller:
        self._server = await asyncio.start_unix_server(self._take, str(self.path))
        return self

    async def __aexit__(self, *_: object) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    async def _take(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        line = await reader.readline()
        writer.close()
        await self._lines.put(line.decode().strip())

    async def hanging(self, timeout: float = 30.0) -> None:
        async with asyncio.timeout(timeout):
            line = await self._lines.get()
        assert line == "hanging initialize", line


def chat(client: Client, **fields: object) -> Call:
    return client.stub.Chat(pb.ChatRequest(**fields))  # type: ignore[arg-type]


async def first_of(call: Call, kind: str) -> pb.ChatStream:
    async with asyncio.timeout(END_BOUND):
        event = await call.read()
    assert isinstance(event, pb.ChatStream) and event.WhichOneof("event") == kind, event
    return event


async def make_scene(daemon: Daemon, client: Client, teller: Teller, gate: Path, project_id: str, state: str) -> Scene:
    """A new session of ``project_id`` in ``state`` (see the module docstring)."""
    assert state in STATES, state
    first = await collect(chat(client, project_id=project_id, prompt="remember 1"))
    assert first[-1].completed.stop_reason == pb.STOP_REASON_END_TURN, first[-1:]
    scene = Scene(daemon, client, project_id, first[0].session_id, state, first[0].run_id)
    if state == "idle":
        return scene
    if state == "starting":
        await client.stub.CloseSession(pb.CloseSessionRequest(session_id=scene.session_id), timeout=30)
        await asyncio.to_thread(gate.touch)
        call = chat(client, project_id=project_id, session_id=scene.session_id, prompt="remember 2")
        try:
            await teller.hanging()
        finally:
            await asyncio.to_thread(gate.unlink)
        run_id, session_id = await named(call)  # its ids, in the headers, while its agent starts
        assert session_id == scene.session_id and run_id != scene.last_run_id, (run_id, session_id)
        scene.streams.append(Open("running", call, run_id=run_id))
        return scene
    if state == "permission":
        call = chat(client, project_id=project_id, session_id=scene.session_id, prompt="remember 2 permission",
                    permission_mode=pb.PERMISSION_MODE_ASK)  # fmt: skip
        begin = await first_of(call, "started")
        _, asked = await read_until(call, "permission_request", END_BOUND)
        scene.permission_id = asked.permission_request.permission_id
    else:
        call = chat(client, project_id=project_id, session_id=scene.session_id, prompt="remember 2 hang")
        begin = await first_of(call, "started")
    scene.streams.append(Open("running", call, begin.run_id, begin))
    for n in range(int(state[-1]) if state.startswith("queued") else 0):
        queued = chat(client, project_id=project_id, session_id=scene.session_id, prompt=f"remember q{n}",
                      busy=pb.BUSY_POLICY_QUEUE)  # fmt: skip
        told = await first_of(queued, "queued")
        assert told.queued.position == n + 1, told
        scene.streams.append(Open("queued", queued, told.run_id, told))
    return scene


async def make_scenes(daemon: Daemon, client: Client, teller: Teller, gate: Path, prefix: str) -> list[Scene]:
    """One scene in each of ``STATES`` (projects ``<prefix>-<state>``), in that order: the starting
    one first, alone (its gate is the daemon's only hanging start), then the others at once."""
    starting = await make_scene(daemon, client, teller, gate, f"{prefix}-starting", "starting")
    others = [state for state in STATES if state != "starting"]
    made = await asyncio.gather(*(make_scene(daemon, client, teller, gate, f"{prefix}-{s}", s) for s in others))
    return sorted([starting, *made], key=lambda scene: STATES.index(scene.state))


async def named(call: Call, timeout: float = END_BOUND) -> tuple[str, str]:
    """The run and session a Chat's response headers name (``rcoder-run-id``, ``rcoder-session-id``)."""
    async with asyncio.timeout(timeout):
        headers = dict(await call.initial_metadata() or ())
    run_id, session_id = headers.get("rcoder-run-id", ""), headers.get("rcoder-session-id", "")
    assert isinstance(run_id, str) and run_id and isinstance(session_id, str) and session_id, headers
    return run_id, session_id


async def start_new_session(client: Client, teller: Teller, gate: Path, project_id: str) -> tuple[Call, str, str]:
    """A first turn of a new session of ``project_id`` whose agent hangs as it starts (and stays
    so until ended): its call, and the run and session its headers named meanwhile."""
    await asyncio.to_thread(gate.touch)
    call = chat(client, project_id=project_id, prompt="remember 1")
    try:
        await teller.hanging()
    finally:
        await asyncio.to_thread(gate.unlink)
    run_id, session_id = await named(call)
    return call, run_id, session_id


async def listed(client: Client, project_id: str) -> list[pb.Session]:
    got = await client.stub.ListSessions(pb.ListSessionsRequest(project_id=project_id), timeout=30)
    return list(got.sessions)


async def cancelled_in_its_start(call: Call, run_id: str, session_id: str) -> None:
    """The stream of a turn cancelled as its agent started: ``started`` (never opened) then
    ``completed`` CANCELLED, both of the run and session its headers named."""
    events = await collect(call)
    assert [e.WhichOneof("event") for e in events] == ["started", "completed"], events
    assert {(e.run_id, e.session_id) for e in events} == {(run_id, session_id)}, events
    assert events[0].started.resume == pb.RESUME_OUTCOME_NOT_OPENED, events[0]
    assert events[1].completed.stop_reason == pb.STOP_REASON_CANCELLED, events[1]


async def collect(call: Call, timeout: float = END_BOUND) -> list[pb.ChatStream]:
    events = []
    async with asyncio.timeout(timeout):
        async for event in call:
            events.append(event)
    return events


def reason_of(exc: grpc.aio.AioRpcError) -> str:
    raw = dict(exc.trailing_metadata() or ()).get("grpc-status-details-bin")
    if not raw:
        return ""
    for detail in status_pb2.Status.FromString(raw).details:
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info):
            return str(info.reason)
    return ""


def status_word(exc: grpc.aio.AioRpcError) -> str:
    return f"{exc.code().name}:{reason_of(exc)}"


async def end_of(stream: Open, timeout: float = END_BOUND) -> str:
    """How ``stream`` ends, read to its end within ``timeout`` (a stream that does not end fails)."""
    try:
        async with asyncio.timeout(timeout):
            while (event := await stream.call.read()) is not grpc.aio.EOF:
                stream.events.append(event)
    except TimeoutError:
        stream.call.cancel()
        raise AssertionError(f"the {stream.role} stream {stream.run_id} did not end within {timeout} s") from None
    except grpc.aio.AioRpcError as exc:
        said = status_word(exc)
    else:
        said = ""
    if said:
        assert not said.startswith("UNKNOWN"), said  # a status the call meant, never an accident
        return said
    assert stream.events, f"the {stream.role} stream ended with nothing"
    last = stream.events[-1]
    assert last.WhichOneof("event") == "completed", last
    said = f"completed:{pb.StopReason.Name(last.completed.stop_reason).removeprefix('STOP_REASON_')}"
    return said + (f"/{last.completed.error_reason}" if last.completed.error_reason else "")


async def answer(call: object) -> str:
    """How a unary call answered: "OK", or ``<CODE>:<reason>``."""
    try:
        async with asyncio.timeout(END_BOUND):
            await call  # type: ignore[misc]
    except grpc.aio.AioRpcError as exc:
        return status_word(exc)
    return "OK"


async def release(scene: Scene) -> None:
    """Let the scene's running turn end, if it still runs: its permission answered, or cancelled."""
    running = scene.running
    if running is None or running.call.done():
        return
    stub = scene.client.stub
    if scene.permission_id:
        request = pb.ResolvePermissionRequest(
            run_id=running.run_id, permission_id=scene.permission_id, option_id="allow"
        )
        with contextlib.suppress(grpc.aio.AioRpcError):  # settled meanwhile (the call ended it)
            await stub.ResolvePermission(request, timeout=END_BOUND)
        return
    with contextlib.suppress(grpc.aio.AioRpcError):
        await stub.Cancel(pb.CancelRequest(run_id=running.run_id), timeout=END_BOUND)


async def next_turn_works(scene: Scene, session_id: str = "") -> None:
    """The session's next turn (``session_id``: another one of the project's, a branch) answers."""
    events = await collect(chat(scene.client, project_id=scene.project_id, session_id=session_id or scene.session_id,
                                prompt="remember 9"))  # fmt: skip
    assert events[-1].completed.stop_reason == pb.STOP_REASON_END_TURN, events[-1:]
    assert "9" in "".join(e.agent_message.text for e in events), events


def agent_pids(daemon: Daemon) -> set[int]:
    """Pids of the agents the daemon spawned (its log) that still live (zombies excluded)."""
    alive = set()
    for row in daemon.logs("agent_spawned"):
        pid = int(row["pid"])
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                alive.add(pid)
    return alive

"""What the benchmarks share: their sizes and results, the daemon and direct baselines they
start, a turn through either, and the arithmetic of a line. ``bench.py`` runs the measures; the
``bench_*.py`` beside it hold some of them; all import this, and it imports none of them."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import statistics
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import acp
import grpc
from acp import schema as acp_schema

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from grpc_floor import RawAgent  # noqa: E402

from rcoder.v1 import agent_runner_pb2 as pb  # noqa: E402
from rcoder.v1 import agent_runner_pb2_grpc as pb_grpc  # noqa: E402
from tests.harness import FAKE_AGENT, FAKE_AGENT_READS, Daemon, write_config  # noqa: E402

LINE_LIMIT = 64 * 1024 * 1024
LARGEST = 19 << 20  # max_request_bytes' default: the largest request the unauthenticated floods send
FLOOR_RELAY = Path(__file__).resolve().parent / "grpc_floor.py"
CALL_TIMEOUT = 120.0
# live turns are cheap and the noisiest (tens of ms on a shared 2-core machine): more of them per cold turn
LIVE_PER_COLD = 5


# --------------------------------------------------------------------------- sizes and results


@dataclass(frozen=True)
class Sizes:
    reps: int
    paced_chunks: int
    pace_ms: int
    unpaced_chunks: int
    flood_chunks: int
    claude_reps: int
    levels: tuple[int, ...]
    history_runs: int = 1000  # the runs of the session ListRuns pages through
    unauth_requests: int = 40  # unauth_flood_rss_mb: requests without the token at once, of unauth_bytes each
    unauth_bytes: int = LARGEST - 64
    history_flood_calls: int = 2000  # history_flood_bytes_per_s: tool calls of HISTORY_FLOOD_BYTES each
    workspace_files: int = 100_000  # workspace_size_ms_100k_files: files in the project measured
    read_file_bytes: int = 100 << 20  # read_file_mb_per_s: the file ReadFile sends
    huge_folder_files: int = 300_000  # list_files_page_ms, small_read_under_flood_ms: files in one folder
    checkpoint_files: int = 10_000  # checkpoint_first_snapshot_ms: files of the project snapshotted
    checkpoint_bytes: int = 200 * 1000 * 1000  # and their bytes
    checkpoint_large_files: int = 20_000  # checkpoint_first_turn_wait_ms, checkpoint_turn_end_wait_ms
    checkpoint_large_bytes: int = 500 * 1000 * 1000

    @classmethod
    def full(cls, reps: int) -> Sizes:
        return cls(reps, 500, 2, 500, 20_000, max(3, reps - 2), (50, 100, 200))

    @classmethod
    def smoke(cls) -> Sizes:
        return cls(
            1, 10, 1, 10, 200, 1, (2, 3), history_runs=150, unauth_requests=4, unauth_bytes=1 << 20,
            history_flood_calls=50, workspace_files=200, read_file_bytes=8 << 20, checkpoint_files=200,
            checkpoint_bytes=2_000_000, huge_folder_files=2_000, checkpoint_large_files=400,
            checkpoint_large_bytes=4_000_000,
        )  # fmt: skip


@dataclass
class Result:
    name: str
    what: str
    ratio: float | None  # None: a "report" line
    target: str  # "<= 1.02", ">= 0.9", "report"
    ok: bool | None
    details: dict[str, Any] = field(default_factory=dict)

    def line(self, gate: bool) -> str:
        value = f"{self.ratio:.3f}" if self.ratio is not None else "-"
        verdict = ("PASS" if self.ok else "FAIL") if gate and self.ok is not None else "----"
        extra = " ".join(f"{k}={_short(v)}" for k, v in self.details.items() if not isinstance(v, list | dict))
        return f"{verdict}  {self.name:<34} ratio {value:>7}  target {self.target:<8}  {extra}"


def _short(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def judged(name: str, what: str, ratio: float, target: str, details: dict[str, Any]) -> Result:
    op, bound = target.split()
    ok = ratio <= float(bound) if op == "<=" else ratio >= float(bound)
    return Result(name, what, ratio, target, ok, details)


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def paired_ratio(ours: list[float], theirs: list[float]) -> float:
    """The median of the ratios of each repetition's pair, run back to back.

    The machine's speed drifts over seconds (a shared VM): a ratio taken within
    one pair cancels the drift, where a ratio of two medians would not."""
    return median([o / t for o, t in zip(ours, theirs, strict=True) if t > 0])


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


# --------------------------------------------------------------------------- the direct baseline


class _CountingClient:
    """The ACP client side of the baseline: counts agent text, notes when the first chunk came."""

    def __init__(self) -> None:
        self.text_bytes = 0
        self.first_chunk: float | None = None

    def reset(self) -> None:
        self.text_bytes, self.first_chunk = 0, None

    async def session_update(self, session_id: str, update: Any, **kwargs: Any) -> None:
        if isinstance(update, acp_schema.AgentMessageChunk) and isinstance(update.content, acp_schema.TextContentBlock):
            if self.first_chunk is None:
                self.first_chunk = time.perf_counter()
            self.text_bytes += len(update.content.text.encode())

    async def request_permission(self, *args: Any, **kwargs: Any) -> acp_schema.RequestPermissionResponse:
        return acp_schema.RequestPermissionResponse(outcome=acp_schema.DeniedOutcome(outcome="cancelled"))

    async def ext_method(self, method: str, params: dict[str, Any]) -> dict[str, Any]:
        raise acp.RequestError.method_not_found(method)

    async def ext_notification(self, method: str, params: dict[str, Any]) -> None:
        return None


@dataclass
class DirectAgent:
    """The fake agent driven straight through the SDK, in a process group this script owns."""

    proc: asyncio.subprocess.Process
    conn: acp.ClientSideConnection
    client: _CountingClient
    session_id: str = ""

    @classmethod
    async def start(cls, argv: list[str], cwd: Path) -> DirectAgent:
        proc = await asyncio.create_subprocess_exec(
            *argv, cwd=str(cwd), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL, limit=LINE_LIMIT, start_new_session=True,
        )  # fmt: skip
        try:
            assert proc.stdin is not None and proc.stdout is not None
            client = _CountingClient()
            conn = acp.connect_to_agent(cast(acp.Client, client), proc.stdin, proc.stdout)
            agent = cls(proc, conn, client)
            await conn.initialize(
                protocol_version=acp.PROTOCOL_VERSION, client_capabilities=acp_schema.ClientCapabilities()
            )
            agent.session_id = (await conn.new_session(cwd=str(cwd), mcp_servers=[])).session_id
        except BaseException:
            await _kill_group(proc)
            raise
        return agent

    async def prompt(self, text: str) -> None:
        self.client.reset()
        await self.conn.prompt(session_id=self.session_id, prompt=[acp.text_block(text)])

    async def aclose(self) -> None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.conn.close(), 2)
        await _kill_group(self.proc)


class RawDirect(RawAgent):
    """The fastest direct client: raw JSON-RPC lines over the agent's pipes, its stdout read
    through a buffer, no SDK on our side. What rcoder's start of a turn is held against."""

    async def prompt(self, text: str) -> float | None:
        """One turn; seconds from sending the prompt to its first text chunk."""
        sent = time.perf_counter()
        first_chunk = None
        params = {"sessionId": self.session_id, "prompt": [{"type": "text", "text": text}]}
        async for message in self.replies(self.send("session/prompt", params), "session/prompt"):
            update = message.get("params", {}).get("update", {}) if message.get("method") == "session/update" else {}
            if first_chunk is None and update.get("sessionUpdate") == "agent_message_chunk":
                first_chunk = time.perf_counter()
        return None if first_chunk is None else first_chunk - sent


async def _kill_group(proc: asyncio.subprocess.Process) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(Exception):
        await asyncio.wait_for(proc.wait(), 10)


# --------------------------------------------------------------------------- the daemon side


@dataclass
class Turn:
    total: float  # request sent -> completed received
    first_event: float
    first_chunk: float | None
    text_bytes: int
    session_id: str
    resume: str


class Bench:
    """One scratch directory, one fake-agent command, daemons started on demand."""

    def __init__(self, root: Path, sizes: Sizes) -> None:
        self.root = root
        self.sizes = sizes
        self.agent_argv = [sys.executable, str(FAKE_AGENT), "--state-dir", str(root / "agent-state")]
        self.workspace = root / "workspace"
        (self.workspace / "proj").mkdir(parents=True, exist_ok=True)
        self._configs = 0

    def config(self, profiles: dict[str, dict[str, Any]], **top: Any) -> Path:
        self._configs += 1
        settings = {
            "data_dir": str(self.root / f"data-{self._configs}"),
            "workspace_root": str(self.workspace),
            "default_agent": "fake",
            "initialize_timeout": 60,
            "session_open_timeout": 60,
            "agent_stop_grace": 1,
            **top,
        }
        return write_config(self.root / f"rcoder-{self._configs}.toml", profiles, **settings)

    def fake_profile(self) -> dict[str, Any]:
        # confined like every agent: it reads its script and writes its state outside the project
        return {
            "command": self.agent_argv[0],
            "args": self.agent_argv[1:],
            "read_paths": list(FAKE_AGENT_READS),
            "write_paths": [str(self.root / "agent-state")],
        }

    @contextlib.asynccontextmanager
    async def daemon(self, config: Path) -> AsyncIterator[tuple[Daemon, pb_grpc.AgentRunnerStub]]:
        daemon = Daemon(config)
        try:
            await daemon.start()
            channel = grpc.aio.insecure_channel(daemon.address)
            try:
                yield daemon, daemon.stub(channel)
            finally:
                await channel.close()
        finally:
            try:
                if daemon.proc is not None and daemon.proc.returncode is None:
                    await daemon.stop()
            finally:
                await daemon.kill()

    async def direct(self) -> DirectAgent:
        return await DirectAgent.start(self.agent_argv, self.workspace / "proj")

    async def raw(self) -> RawDirect:
        return await RawDirect.start(self.agent_argv, str(self.workspace / "proj"), own_group=True)

    @contextlib.asynccontextmanager
    async def floor_relay(self) -> AsyncIterator[pb_grpc.AgentRunnerStub]:
        """``grpc_floor.py`` relaying its own fake agent, in a process group ended on every path."""
        argv = [sys.executable, str(FLOOR_RELAY), str(self.workspace / "proj"), *self.agent_argv]
        proc = await asyncio.create_subprocess_exec(
            *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL, start_new_session=True
        )
        try:
            assert proc.stdout is not None
            line = await asyncio.wait_for(proc.stdout.readline(), CALL_TIMEOUT)
            if not line.startswith(b"port "):
                raise RuntimeError(f"the floor relay did not start (exit {await proc.wait()})")
            async with grpc.aio.insecure_channel(f"127.0.0.1:{int(line.split()[1])}") as channel:
                yield pb_grpc.AgentRunnerStub(channel)
        finally:
            await _kill_group(proc)


@contextlib.asynccontextmanager
async def live_pair(bench: Bench) -> AsyncIterator[tuple[pb_grpc.AgentRunnerStub, str, DirectAgent]]:
    """A daemon with a live session and a direct agent with a session, each one turn in (the
    daemon's first turn imports and opens its store; the agents' first turns warm them)."""
    async with bench.daemon(bench.config({"fake": bench.fake_profile()})) as (_, stub):
        sid = (await chat(stub, "stream 1")).session_id
        direct = await bench.direct()
        try:
            await direct.prompt("stream 1")
            yield stub, sid, direct
        finally:
            await direct.aclose()


async def chat(
    stub: pb_grpc.AgentRunnerStub, prompt: str, session_id: str = "", agent: str = "", project: str = "proj"
) -> Turn:
    request = pb.ChatRequest(project_id=project, session_id=session_id, prompt=prompt, agent=agent)
    start = time.perf_counter()
    first_event = first_chunk = None
    text_bytes, sid, resume = 0, session_id, ""
    async with asyncio.timeout(CALL_TIMEOUT):
        async for event in stub.Chat(request):
            now = time.perf_counter()
            first_event = first_event or now
            kind = event.WhichOneof("event")
            if kind == "started":
                sid, resume = event.session_id, pb.ResumeOutcome.Name(event.started.resume)
            elif kind == "agent_message":
                first_chunk = first_chunk or now
                text_bytes += len(event.agent_message.text.encode())
            elif kind == "completed":
                stop = pb.StopReason.Name(event.completed.stop_reason)
                if stop != "STOP_REASON_END_TURN":
                    raise RuntimeError(f"turn ended {stop}: {event.completed}")
                return Turn(
                    now - start, first_event - start, first_chunk and first_chunk - start, text_bytes, sid, resume
                )
    raise RuntimeError("the stream ended without a completed event")


async def close_session(stub: pb_grpc.AgentRunnerStub, session_id: str) -> None:
    await stub.CloseSession(pb.CloseSessionRequest(session_id=session_id), timeout=30)


async def timed(make: Callable[[], Awaitable[None]]) -> float:
    start = time.perf_counter()
    await make()
    return time.perf_counter() - start


# --------------------------------------------------------------------------- turn time and throughput

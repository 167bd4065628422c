"""A real ``rcoder relay`` process and a real gRPC client of it, for tests/relay/.

The relay runs in its own process group and dies with the test process (``die_with_the_test``);
its agents die with it (their death signal). ``AcpOverAttach`` speaks ACP to an agent through an
Attach stream: stdin numbered from 1, every stdout frame acknowledged once kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from rcoder.agent.confinement.sandbox import ETC_LINKS, SYSTEM_READ, python_dirs
from rcoder.relay.v1 import relay_pb2 as pb
from rcoder.relay.v1 import relay_pb2_grpc as pb_grpc
from tests.harness import FAKE_AGENT, FAKE_AGENT_READS, ROOT, die_with_the_test

START_TIMEOUT = 30.0


@dataclass(eq=False)
class Relay:
    """``rcoder relay`` with its state in ``state_dir``; ``serving`` is its start's log line."""

    state_dir: Path
    args: tuple[str, ...] = ()
    pass_fds: tuple[int, ...] = ()
    given_secret: str = ""  # the secret handed over by descriptor, when it was
    proc: asyncio.subprocess.Process | None = None
    serving: dict[str, Any] = field(default_factory=dict)
    log_lines: list[str] = field(default_factory=list)
    _stderr: asyncio.Task[None] | None = None

    async def start(self) -> Relay:
        env = {**os.environ, "RCODER_LOG_FORMAT": "json"}
        self.proc = await asyncio.create_subprocess_exec(
            *die_with_the_test(), sys.executable, "-m", "rcoder", "relay", "--state-dir", str(self.state_dir),
            *self.args, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE, start_new_session=True, env=env, cwd=str(ROOT), pass_fds=self.pass_fds,
        )  # fmt: skip
        ready: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._stderr = asyncio.create_task(self._read_stderr(ready))
        try:
            async with asyncio.timeout(START_TIMEOUT):
                self.serving = await ready
        except BaseException:
            await self.kill()
            raise
        return self

    async def _read_stderr(self, ready: asyncio.Future[dict[str, Any]]) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        while line := await self.proc.stderr.readline():
            text = line.decode(errors="replace").rstrip()
            self.log_lines.append(text)
            if not ready.done() and '"event": "relay_serving"' in text:
                ready.set_result(json.loads(text))
        if not ready.done():
            ready.set_exception(RuntimeError("relay exited before serving:\n" + "\n".join(self.log_lines[-30:])))

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def secret(self) -> str:
        return self.given_secret or (self.state_dir / "secret").read_text().strip()

    @property
    def socket(self) -> Path:
        return Path(self.serving["socket"])

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.secret}"),)

    def channel(self) -> grpc.aio.Channel:
        return grpc.aio.insecure_channel(f"unix:{self.socket}")

    async def stop(self, sig: int = signal.SIGTERM) -> int:
        assert self.proc is not None
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(sig)
            try:
                async with asyncio.timeout(30):
                    await self.proc.wait()
            except TimeoutError:
                await self.kill()
                raise
        await self._drain()
        return self.proc.returncode or 0

    async def kill(self) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        await self.proc.wait()
        await self._drain()

    async def _drain(self) -> None:
        if self._stderr is not None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(5):
                    await self._stderr

    def logs(self, event: str) -> list[dict[str, Any]]:
        rows = []
        for line in self.log_lines:
            with contextlib.suppress(ValueError):
                row = json.loads(line)
                if row.get("event") == event:
                    rows.append(row)
        return rows


def fake_agent_spec(folder: Path, project: Path, *flags: str, confined: bool = True) -> pb.StartSpec:
    """The scripted fake agent (tests/fakes/fake_agent.py) in ``project``, its state in ``folder``;
    confined to read the system, Python and its script, and to write its project and ``folder``."""
    project.mkdir(parents=True, exist_ok=True)
    folder.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, str(FAKE_AGENT), "--state-dir", str(folder / "state"), *flags]
    env = {"PATH": "/usr/bin:/bin", "HOME": str(folder), "PYTHONDONTWRITEBYTECODE": "1"}
    confinement = None
    if confined:
        reads = [*SYSTEM_READ, *ETC_LINKS, *map(str, python_dirs()), *FAKE_AGENT_READS]
        confinement = pb.Confinement(read_paths=reads, write_paths=[str(project), str(folder)])
    return pb.StartSpec(name="fake", command=argv, env=env, cwd=str(project), confinement=confinement)


class AcpOverAttach:
    """ACP (newline-delimited JSON-RPC) to one agent through an Attach stream. ``frames`` holds every
    frame kept, by seq; each is acknowledged once kept (``ack_every`` frames at a time)."""

    def __init__(self, stub: pb_grpc.RelayServiceStub, metadata: Sequence[tuple[str, str]], agent_id: str,
                 generation: int = 1, ack_every: int = 1,
                 on_frame: Callable[[int, bytes], None] = lambda seq, data: None) -> None:  # fmt: skip
        self._stub, self._metadata = stub, tuple(metadata)
        self.agent_id, self.generation, self.ack_every = agent_id, generation, ack_every
        self.frames: dict[int, bytes] = {}
        self.stdin_seq = 0
        self.lagged: list[pb.AttachLagged] = []
        self.exit: pb.AgentExit | None = None
        self.ready: pb.Agent | None = None
        self._call: Any = None
        self._outbox: asyncio.Queue[pb.AttachRequest | None] = asyncio.Queue()
        self._changed = asyncio.Event()
        self._pending: list[bytes] = []  # stdin sent on this stream, kept to send again after a drop
        self._reader: asyncio.Task[None] | None = None
        self.error: grpc.aio.AioRpcError | None = None
        self._on_frame = on_frame  # told of each frame kept, before it is acknowledged
        self._answers: dict[int, tuple[int, dict[str, Any]]] = {}  # request id -> (seq, answer): looked up per wakeup

    @property
    def acked(self) -> int:
        """The last frame kept with every one before it."""
        seq = 0
        while seq + 1 in self.frames:
            seq += 1
        return seq

    async def open(self, from_seq: int | None = None) -> pb.Agent:
        """Attach (again), from the first frame not kept; stdin the relay has not written is sent again."""
        self._outbox = asyncio.Queue()
        start = self.acked + 1 if from_seq is None else from_seq
        self._call = self._stub.Attach(self._requests(self._outbox), metadata=self._metadata)
        try:
            # the open is written once the relay's headers came, as the daemon's client does: a write
            # racing a refusal would turn it into grpc's own INTERNAL (docs/relay.md#attach)
            await self._call.initial_metadata()
            if not self._call.done():
                self._outbox.put_nowait(pb.AttachRequest(open=pb.AttachOpen(agent_id=self.agent_id,
                                                                             generation=self.generation,
                                                                             from_seq=start)))  # fmt: skip
            first: pb.AttachResponse = await self._call.read()
        except BaseException:
            self._outbox.put_nowait(None)  # its requests end: refused, the call is over
            raise
        assert first.WhichOneof("message") == "ready", first
        self.ready = first.ready
        for seq in range(first.ready.stdin_seq + 1, self.stdin_seq + 1):  # what the relay never wrote
            data = self._pending[seq - 1]
            self._outbox.put_nowait(pb.AttachRequest(stdin=pb.StdinFrame(seq=seq, data=data)))
        self._reader = asyncio.create_task(self._read(self._call))
        ready: pb.Agent = first.ready
        return ready

    @staticmethod
    async def _requests(outbox: asyncio.Queue[pb.AttachRequest | None]) -> AsyncIterator[pb.AttachRequest]:
        while (request := await outbox.get()) is not None:
            yield request

    async def _read(self, call: Any) -> None:
        # read(), as the first message was: a call is read one way only
        try:
            while (response := await call.read()) is not grpc.aio.EOF:
                kind = response.WhichOneof("message")
                if kind == "frame":
                    assert response.frame.seq not in self.frames, f"frame {response.frame.seq} came twice"
                    self.frames[response.frame.seq] = response.frame.data
                    self._note_answer(response.frame.seq, response.frame.data)
                    self._on_frame(response.frame.seq, response.frame.data)
                    if response.frame.seq % self.ack_every == 0:
                        self._outbox.put_nowait(pb.AttachRequest(ack=response.frame.seq))
                elif kind == "lagged":
                    self.lagged.append(response.lagged)
                elif kind == "exit":
                    self.exit = response.exit
                    self._outbox.put_nowait(None)  # our half closed after the last ack: the relay ends the stream
                self._changed.set()
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                self.error = exc
            self._changed.set()

    def drop(self) -> None:
        """Cut the stream (as a network would); frames received and not acknowledged are not kept.
        The reader is cancelled first: once this returns, no frame of the old stream is taken."""
        if self._reader is not None:
            self._reader.cancel()
        acked = max((seq for seq in self.frames if seq % self.ack_every == 0), default=0)
        for seq in [s for s in self.frames if s > acked]:
            del self.frames[seq]
        self._outbox.put_nowait(None)  # its requests end first: a cancelled call closes them
        if self._call is not None:
            self._call.cancel()

    async def close(self) -> None:
        self._outbox.put_nowait(None)
        if self._call is not None:
            self._call.cancel()
        if self._reader is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader

    def close_stdin(self) -> None:
        self._outbox.put_nowait(pb.AttachRequest(close_stdin=True))

    def send(self, message: dict[str, Any]) -> None:
        data = (json.dumps(message) + "\n").encode()
        self.stdin_seq += 1
        self._pending.append(data)
        self._outbox.put_nowait(pb.AttachRequest(stdin=pb.StdinFrame(seq=self.stdin_seq, data=data)))

    def messages(self) -> list[dict[str, Any]]:
        """The JSON-RPC messages of the frames kept, in order (a frame is a whole line here)."""
        return [json.loads(self.frames[seq]) for seq in sorted(self.frames)]

    async def until(self, check: Any, timeout: float = 30.0) -> None:
        """Until ``check()`` holds, woken by each message of the stream (bounded)."""
        async with asyncio.timeout(timeout):
            while not check():
                if self.error is not None:
                    raise self.error
                self._changed.clear()
                await self._changed.wait()

    def keep(self, frames: dict[int, bytes]) -> None:
        """Frames kept before this client (by another, as a daemon's store holds them)."""
        self.frames.update(frames)
        for seq, data in frames.items():
            self._note_answer(seq, data)

    def _note_answer(self, seq: int, data: bytes) -> None:
        with contextlib.suppress(ValueError):
            message = json.loads(data)
            if isinstance(message, dict) and "id" in message and "method" not in message:
                self._answers[message["id"]] = (seq, message)

    def response(self, request_id: int) -> dict[str, Any] | None:
        """The agent's answer to ``request_id``, once kept."""
        seq, answer = self._answers.get(request_id, (0, None))
        return answer if seq in self.frames else None

    async def call(self, request_id: int, method: str, params: dict[str, Any], timeout: float = 30.0) -> dict[str, Any]:
        self.send({"jsonrpc": "2.0", "id": request_id, "method": method, "params": params})
        await self.until(lambda: self.response(request_id) is not None, timeout)
        answer = self.response(request_id)
        assert answer is not None and "error" not in answer, answer
        return dict(answer["result"])


def initialize(request_id: int = 1) -> tuple[int, str, dict[str, Any]]:
    return request_id, "initialize", {"protocolVersion": 1, "clientCapabilities": {}}


def chunks(messages: Sequence[dict[str, Any]]) -> list[str]:
    """The text of every agent_message_chunk, in order."""
    found = []
    for message in messages:
        update = message.get("params", {}).get("update", {}) if message.get("method") == "session/update" else {}
        if update.get("sessionUpdate") == "agent_message_chunk":
            found.append(update["content"]["text"])
    return found

"""The floor under any Python gRPC relay: the least a grpc.aio server can do to relay an ACP agent.

    python scripts/grpc_floor.py CWD AGENT_COMMAND [ARG...]

Serves ``AgentRunner.Chat`` alone, on a loopback port it prints (``port N``) once serving. Each
call writes the prompt to one raw ACP agent (started here, in this process's group), yields
``started`` at once, each text chunk as its line is read and ``completed`` with the turn's result.
No store, no validation, no sessions, no ACP SDK: ``make bench`` measures it beside rcoder and the
direct client, so a ratio tells rcoder's own cost from what grpcio's asyncio server and client
cost on the machine at hand. Not a daemon: one caller at a time, for the benchmark only.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Self

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rcoder.v1 import agent_runner_pb2 as pb

LINE_LIMIT = 64 * 1024 * 1024
PROTOCOL_VERSION = 1
SERVICE = pb.DESCRIPTOR.services_by_name["AgentRunner"].full_name


class RawAgent:
    """One ACP agent over its pipes, JSON lines written and read by hand (its stdout read through
    a buffer, ``StreamReader.readline``). The bench's direct client is one too (``RawDirect``)."""

    def __init__(self, proc: asyncio.subprocess.Process, own_group: bool) -> None:
        assert proc.stdin is not None and proc.stdout is not None
        self.proc = proc
        self._own_group = own_group
        self._stdin, self._stdout = proc.stdin, proc.stdout
        self._ids = itertools.count(1)
        self.session_id = ""

    @classmethod
    async def start(cls, argv: list[str], cwd: str, own_group: bool = False) -> Self:
        """The agent started, initialized and with a session open (``own_group``: in a process
        group of its own, which ``aclose`` ends)."""
        proc = await asyncio.create_subprocess_exec(
            *argv, cwd=cwd, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL, limit=LINE_LIMIT, start_new_session=own_group,
        )  # fmt: skip
        agent = cls(proc, own_group)
        try:
            init = {"protocolVersion": PROTOCOL_VERSION, "clientCapabilities": {}}
            async for _ in agent.replies(agent.send("initialize", init), "initialize"):
                pass
            new = {"cwd": cwd, "mcpServers": []}
            async for message in agent.replies(agent.send("session/new", new), "session/new"):
                agent.session_id = message["result"]["sessionId"]
        except BaseException:
            await agent.aclose()
            raise
        return agent

    async def aclose(self) -> None:
        """SIGKILL the agent (its whole group when it has one of its own) and reap it, bounded."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if self._own_group:
                os.killpg(self.proc.pid, signal.SIGKILL)
            else:
                self.proc.kill()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.proc.wait(), 10)

    def send(self, method: str, params: dict[str, Any]) -> int:
        """Write a request (the pipe takes it at once); its id."""
        ident = next(self._ids)
        self._stdin.write(json.dumps({"jsonrpc": "2.0", "id": ident, "method": method, "params": params}).encode())
        self._stdin.write(b"\n")
        return ident

    async def replies(self, ident: int, method: str) -> AsyncIterator[dict[str, Any]]:
        """Every line the agent writes until its answer to ``ident``, that one last."""
        while line := await self._stdout.readline():
            message = json.loads(line)
            yield message
            if message.get("id") == ident and "method" not in message:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return
        raise RuntimeError(f"the agent closed its output during {method}")


class FloorRelay:
    """``AgentRunner.Chat``, and nothing else of the service."""

    def __init__(self, agent: RawAgent) -> None:
        self._agent = agent
        self._runs = itertools.count(1)

    async def Chat(
        self, request: pb.ChatRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[pb.ChatStream]:
        run_id, sid = f"floor-{next(self._runs)}", self._agent.session_id
        seq = itertools.count(1)
        prompt = {"sessionId": sid, "prompt": [{"type": "text", "text": request.prompt}]}
        # the prompt goes before started, as rcoder sends it
        turn = self._agent.replies(self._agent.send("session/prompt", prompt), "session/prompt")
        yield pb.ChatStream(run_id=run_id, session_id=sid, seq=next(seq), started=pb.RunStarted())
        async for message in turn:
            update = message.get("params", {}).get("update", {})
            if update.get("sessionUpdate") == "agent_message_chunk":
                text = pb.TextChunk(text=update.get("content", {}).get("text", ""))
                yield pb.ChatStream(run_id=run_id, session_id=sid, seq=next(seq), agent_message=text)
            elif "result" in message:
                done = pb.RunCompleted(stop_reason=pb.STOP_REASON_END_TURN)
                yield pb.ChatStream(run_id=run_id, session_id=sid, seq=next(seq), completed=done)


async def serve(cwd: str, argv: list[str]) -> None:
    agent = await RawAgent.start(argv, cwd)
    server = grpc.aio.server()
    chat = grpc.unary_stream_rpc_method_handler(
        FloorRelay(agent).Chat,
        request_deserializer=pb.ChatRequest.FromString,
        response_serializer=pb.ChatStream.SerializeToString,
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {"Chat": chat}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(f"port {port}", flush=True)
    await server.wait_for_termination()  # until the bench ends this process group


if __name__ == "__main__":
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    asyncio.run(serve(sys.argv[1], sys.argv[2:]))

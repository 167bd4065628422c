"""A client of a relay in a process of its own, for a test to SIGKILL mid-turn (tests/relay/test_relay.py).

    python -m tests.relay.attach_client SOCKET SECRET_FILE AGENT_ID CWD PROMPT

It attaches to the agent, opens an ACP session in CWD and prompts PROMPT; it prints each frame it
keeps as a JSON line {"seq": N, "data": "..."} before it acknowledges it, and waits for the end.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import grpc

from rcoder.relay.v1 import relay_pb2_grpc as pb_grpc
from tests.relay.relay_kit import AcpOverAttach, initialize


def kept(seq: int, data: bytes) -> None:
    print(json.dumps({"seq": seq, "data": data.decode()}), flush=True)


async def main(socket: str, secret: str, agent_id: str, cwd: str, prompt: str) -> None:
    metadata = (("authorization", f"Bearer {secret}"),)
    async with grpc.aio.insecure_channel(f"unix:{socket}") as channel:
        acp = AcpOverAttach(pb_grpc.RelayServiceStub(channel), metadata, agent_id, on_frame=kept)
        await acp.open()
        await acp.call(*initialize())
        opened = await acp.call(2, "session/new", {"cwd": cwd, "mcpServers": []})
        params = {"sessionId": opened["sessionId"], "prompt": [{"type": "text", "text": prompt}]}
        await acp.call(3, "session/prompt", params, timeout=120)


if __name__ == "__main__":
    socket, secret_file, agent_id, cwd, prompt = sys.argv[1:6]
    asyncio.run(main(socket, Path(secret_file).read_text().strip(), agent_id, cwd, prompt))

"""Helpers for tests that watch a turn while it runs."""

from __future__ import annotations

import asyncio
from typing import Any, TypeAlias

import grpc

from rcoder.v1 import agent_runner_pb2 as pb
from tests.harness import Client

# grpc ships no types (pyproject: ignore_missing_imports), so this names the call for readers
Call: TypeAlias = "grpc.aio.UnaryStreamCall[pb.ChatRequest, pb.ChatStream]"


async def start_turn(client: Client, **fields: Any) -> tuple[Call, pb.ChatStream]:
    """Begin a Chat and read its ``started`` event; the call keeps streaming."""
    fields.setdefault("project_id", "proj")
    call = client.stub.Chat(pb.ChatRequest(**fields))
    async with asyncio.timeout(30):
        first = await call.read()
    assert first.WhichOneof("event") == "started", first
    return call, first


async def read_until(call: Call, kind: str, timeout: float = 30) -> tuple[list[pb.ChatStream], pb.ChatStream]:
    """Events read until (and including) the first of ``kind``."""
    seen = []
    async with asyncio.timeout(timeout):
        while (event := await call.read()) is not grpc.aio.EOF:
            seen.append(event)
            if event.WhichOneof("event") == kind:
                return seen, event
    raise AssertionError(f"the stream ended without {kind}: {[e.WhichOneof('event') for e in seen]}")


async def rest_of(call: Call, timeout: float = 30) -> list[pb.ChatStream]:
    events = []
    async with asyncio.timeout(timeout):
        while (event := await call.read()) is not grpc.aio.EOF:
            events.append(event)
    return events

"""The end of a replay that comes after the load answer: recognised from rcoder's own record."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from rcoder.agent.acp.replay import ReplayWatch

pytestmark = pytest.mark.fast  # starts no process: `make check` (tests/process_guard.py)


def update(kind: str, text: str) -> dict[str, Any]:
    return {"sessionId": "s", "update": {"sessionUpdate": kind, "content": {"type": "text", "text": text}}}


async def test_the_replay_is_over_once_the_last_recorded_turn_was_replayed_however_long_it_pauses() -> None:
    watch = ReplayWatch(("remember 7", "I remember: 42, 7"))
    waiting = asyncio.ensure_future(watch.wait(quiet=0.01, limit=30))
    for params in (
        update("user_message_chunk", "remember 42"),
        update("agent_message_chunk", "I remember: 42"),
        update("user_message_chunk", "remember 7"),
    ):
        watch(params)
    done, _ = await asyncio.wait({waiting}, timeout=0.2)  # twenty quiet windows pass: still waiting
    assert not done
    watch(update("agent_message_chunk", "I remember: 42, 7"))
    async with asyncio.timeout(5):
        assert await waiting == "recognised"
    assert watch.updates == 4


def test_an_earlier_turn_with_the_same_answer_but_another_prompt_does_not_end_it() -> None:
    watch = ReplayWatch(("again", "ok"))
    watch(update("user_message_chunk", "first"))
    watch(update("agent_message_chunk", "ok"))
    assert not watch.over.is_set()
    watch(update("user_message_chunk", "[rcoder: summary]\nagain"))  # a re-seeded prompt ends with it
    watch(update("agent_message_chunk", "ok"))
    assert watch.over.is_set()


async def test_with_nothing_recorded_it_waits_until_the_agent_is_quiet() -> None:
    watch = ReplayWatch(None)
    assert not watch.recognisable
    watch(update("agent_message_chunk", "history"))
    async with asyncio.timeout(5):
        assert await watch.wait(quiet=0.05, limit=30) == "quiet"


async def test_the_wait_is_bounded_when_the_end_never_comes() -> None:
    watch = ReplayWatch(("p", "a"))
    async with asyncio.timeout(5):
        assert await watch.wait(quiet=0.01, limit=0.05) == "limit"

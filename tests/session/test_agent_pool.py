"""AgentPool with real fake-agent processes: checkouts, the live limit, the warm pool, closing.

No gRPC and no daemon: the pool is built from settings, a real ``AgentLauncher`` and
``Metrics``. What the agents receive is read as it arrives from their request log, a FIFO
(see ``AgentRequests``), so a test waits for "the agent got initialize" as an event.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from rcoder.agent.acp.start_config import AgentStartConfig
from rcoder.agent.launcher import AgentLauncher, Launched
from rcoder.agent.pool import AgentPool
from rcoder.agent.processes.tree import Trees
from rcoder.config import AgentProfile, load_settings
from rcoder.domain import ModelProvider
from rcoder.errors import AgentLimitReached, ShuttingDown
from rcoder.metrics import Metrics
from tests.conftest import base_settings
from tests.harness import FakeAgentSetup, write_config
from tests.processes import CLOSE_BOUND, START_BOUND, drain, ended, reaped
from tests.session.conftest import AgentRequests

PLAIN = ModelProvider()

PoolFactory = Callable[..., tuple[AgentPool, AgentProfile]]


@pytest.fixture
async def make_pool(tmp_path: Path, fake: FakeAgentSetup, agent_requests: AgentRequests) -> AsyncIterator[PoolFactory]:
    """Pools over the fake agent (``flags`` for it, ``warm_pool`` for its profile, top-level
    keys as settings); on teardown each is closed and no agent process may be left."""
    pools: list[AgentPool] = []

    def make(*flags: str, warm_pool: int = 0, **top: Any) -> tuple[AgentPool, AgentProfile]:
        config = write_config(
            tmp_path / f"rcoder-{len(pools)}.toml",
            {"fake": fake.profile(*flags, warm_pool=warm_pool)},
            **{**base_settings(tmp_path), **top},
        )
        settings = load_settings(config, environ={})
        pool = AgentPool(settings, AgentLauncher(settings, Trees()), Metrics())
        pools.append(pool)
        profile = settings.profile("fake")
        assert profile is not None
        return pool, profile

    try:
        yield make
    finally:
        for pool in pools:
            await pool.aclose(timeout=CLOSE_BOUND)
        assert not await drain(str(fake.state_dir)), "agent processes left behind"


def project(root: Path, name: str) -> str:
    """A project directory, as the kernel names it (``/proc/<pid>/cwd``)."""
    path = root / "workspace" / name
    path.mkdir(parents=True, exist_ok=True)
    return str(path.resolve())


def cwd_of(pid: int) -> str:
    return os.readlink(f"/proc/{pid}/cwd")


async def live_agent(pool: AgentPool, profile: AgentProfile, cwd: str, session_id: str) -> Launched:
    """An agent started through a checkout and handed over to ``session_id`` (busy)."""
    async with asyncio.timeout(START_BOUND), pool.checkout(profile, cwd, PLAIN, plain=True) as checkout:
        launched = await checkout.launch(AgentStartConfig(cwd=cwd))
        checkout.hand_over(session_id)
    return launched


async def warm_ups_done(profile: str) -> None:
    """Wait (bounded) until the warm-ups under way for ``profile`` are over: the pool's
    ``warm-<profile>`` tasks, which end exactly when their agent turns warm (or fails).
    One that ended already needs no wait: the caller checks ``warm_count`` after."""
    tasks = {task for task in asyncio.all_tasks() if task.get_name() == f"warm-{profile}"}
    if tasks:
        async with asyncio.timeout(START_BOUND):
            await asyncio.wait(tasks)


# ---------------------------------------------------------------- checkouts


async def test_a_handed_over_agent_stays_live_until_its_session_is_closed(
    tmp_path: Path, make_pool: PoolFactory
) -> None:
    pool, profile = make_pool()
    launched = await live_agent(pool, profile, project(tmp_path, "p"), "s1")
    pid = launched.connection.process.pid

    assert pool.live_count() == 1 and pool.is_live("s1") and pool.agent_count() == 1
    pool.release("s1")
    assert pool.is_live("s1"), "a released agent idles, still live"
    assert not reaped(pid)

    async with asyncio.timeout(CLOSE_BOUND):
        assert await pool.close("s1") is True
    assert reaped(pid), "close returns once the agent's process is gone"
    assert not pool.is_live("s1") and pool.live_count() == 0 and pool.agent_count() == 0
    assert await pool.close("s1") is False


@pytest.mark.parametrize("how", ["returns", "raises"])
async def test_an_agent_not_handed_over_is_closed_when_the_checkout_is_left(
    tmp_path: Path, make_pool: PoolFactory, how: str
) -> None:
    class Abandoned(Exception):
        pass

    pool, profile = make_pool()
    cwd = project(tmp_path, "p")
    pids: list[int] = []
    with pytest.raises(Abandoned) if how == "raises" else contextlib.nullcontext():
        async with asyncio.timeout(START_BOUND), pool.checkout(profile, cwd, PLAIN, plain=True) as checkout:
            launched = await checkout.launch(AgentStartConfig(cwd=cwd))
            pids.append(launched.connection.process.pid)
            assert pool.agent_count() == 1
            if how == "raises":
                raise Abandoned

    assert pool.agent_count() == 0 and pool.live_count() == 0
    await ended(pids[0])


async def test_cancelling_a_checkout_while_its_agent_starts_ends_that_agent(
    tmp_path: Path, make_pool: PoolFactory, agent_requests: AgentRequests
) -> None:
    pool, profile = make_pool("--hang", "initialize")
    cwd = project(tmp_path, "p")

    async def take() -> None:
        async with pool.checkout(profile, cwd, PLAIN, plain=True) as checkout:
            await checkout.launch(AgentStartConfig(cwd=cwd))
            raise AssertionError("initialize hangs: the launch cannot return")

    task = asyncio.create_task(take())
    initialize = await agent_requests.next("initialize")
    assert pool.agent_count() == 1
    task.cancel()
    async with asyncio.timeout(CLOSE_BOUND):
        with pytest.raises(asyncio.CancelledError):
            await task

    assert pool.agent_count() == 0
    assert reaped(initialize.pid), "the cancelled launch ends its agent before it returns"


async def test_closing_the_pool_while_a_checkouts_agent_starts_ends_that_agent_before_it_returns(
    tmp_path: Path, make_pool: PoolFactory, agent_requests: AgentRequests
) -> None:
    # a checkout runs in its caller's task (a ForkSession handler), not one the pool owns
    pool, profile = make_pool("--hang", "initialize")
    cwd = project(tmp_path, "p")

    async def take() -> None:
        async with pool.checkout(profile, cwd, PLAIN, plain=True) as checkout:
            await checkout.launch(AgentStartConfig(cwd=cwd))
            raise AssertionError("initialize hangs: the launch cannot return")

    task = asyncio.create_task(take())
    initialize = await agent_requests.next("initialize")
    async with asyncio.timeout(CLOSE_BOUND):
        await pool.aclose(timeout=CLOSE_BOUND)
    assert reaped(initialize.pid), "the pool closed with an agent of its still running"
    async with asyncio.timeout(CLOSE_BOUND):
        with pytest.raises(ShuttingDown):
            await task
    assert pool.agent_count() == 0


# ---------------------------------------------------------------- the limit


async def test_at_the_limit_a_checkout_is_refused_while_all_are_busy_and_else_evicts_the_least_recently_used(
    tmp_path: Path, make_pool: PoolFactory
) -> None:
    pool, profile = make_pool(max_live_agents=2)
    cwd = project(tmp_path, "p")
    first, second = await asyncio.gather(live_agent(pool, profile, cwd, "s1"), live_agent(pool, profile, cwd, "s2"))

    with pytest.raises(AgentLimitReached):
        async with pool.checkout(profile, cwd, PLAIN, plain=True):
            pytest.fail("both live agents are busy: no slot to give")
    assert pool.is_live("s1") and pool.is_live("s2")

    pool.release("s2")  # idle first: the least recently used
    pool.release("s1")
    async with pool.checkout(profile, cwd, PLAIN, plain=True):
        assert not pool.is_live("s2") and pool.is_live("s1")
        assert pool.agent_count() == 2
    await ended(second.connection.process.pid)
    assert not reaped(first.connection.process.pid)


# ---------------------------------------------------------------- the warm pool


async def test_warm_agents_start_in_the_last_requested_project_and_serve_only_that_project(
    tmp_path: Path, make_pool: PoolFactory, agent_requests: AgentRequests
) -> None:
    pool, profile = make_pool(warm_pool=1)
    p, q = project(tmp_path, "p"), project(tmp_path, "q")

    pool.fill()
    assert pool.agent_count() == 0, "no project asked for yet: nothing to warm"

    async with pool.checkout(profile, p, PLAIN, plain=True) as checkout:
        assert not checkout.warm
    await warm_ups_done("fake")
    assert pool.warm_count() == 1 and pool.agent_count() == 1
    warm = (await agent_requests.next("initialize")).pid
    assert cwd_of(warm) == p

    async with asyncio.timeout(START_BOUND), pool.checkout(profile, p, PLAIN, plain=True) as checkout:
        assert checkout.warm
        launched = await checkout.launch(AgentStartConfig(cwd=p))
        checkout.hand_over("s1")
    assert launched.connection.process.pid == warm
    assert launched.primed, "a plain session in the warm agent's project is the one it opened ahead"

    await warm_ups_done("fake")  # taking the warm agent started the next one, in p again
    assert pool.warm_count() == 1
    refill = (await agent_requests.next("initialize")).pid
    assert refill != warm and cwd_of(refill) == p

    async with pool.checkout(profile, q, PLAIN, plain=True) as checkout:
        assert not checkout.warm, "a warm agent serves its own project only"
    await ended(refill)  # q is asked for now: p's warm agent makes way for one in q
    await warm_ups_done("fake")
    assert pool.warm_count() == 1
    in_q = (await agent_requests.next("initialize")).pid
    assert cwd_of(in_q) == q
    assert pool.live_count() == 1


# ---------------------------------------------------------------- counts and closing


async def test_counts_are_a_new_mapping_after_each_change_and_never_change_in_place(
    tmp_path: Path, make_pool: PoolFactory
) -> None:
    pool, profile = make_pool()
    cwd = project(tmp_path, "p")
    seen = [pool.counts]
    copies = [dict(pool.counts)]

    def note() -> None:
        assert pool.counts is not seen[-1], "the pool changed: the metrics thread must see a new mapping"
        seen.append(pool.counts)
        copies.append(dict(pool.counts))

    async with asyncio.timeout(START_BOUND), pool.checkout(profile, cwd, PLAIN, plain=True) as checkout:
        launched = await checkout.launch(AgentStartConfig(cwd=cwd))
        checkout.hand_over("s1")
        note()
    pool.release("s1")
    async with asyncio.timeout(CLOSE_BOUND):
        await pool.close("s1")
    note()

    assert [dict(counts) for counts in seen] == copies
    assert (copies[0].get("fake"), copies[1]["fake"], copies[2]["fake"]) == (None, (1, 0), (0, 0))
    assert reaped(launched.connection.process.pid)


async def test_closing_the_pool_twice_ends_every_agent_and_refuses_checkouts(
    tmp_path: Path, make_pool: PoolFactory
) -> None:
    pool, profile = make_pool(warm_pool=1)
    cwd = project(tmp_path, "p")
    launched = await live_agent(pool, profile, cwd, "s1")  # and a warm agent starting in p

    async with asyncio.timeout(2 * CLOSE_BOUND):
        await pool.aclose(timeout=CLOSE_BOUND)
        await pool.aclose(timeout=CLOSE_BOUND)

    assert pool.agent_count() == 0 and pool.live_count() == 0 and pool.warm_count() == 0
    assert reaped(launched.connection.process.pid)
    with pytest.raises(ShuttingDown):
        async with pool.checkout(profile, cwd, PLAIN, plain=True):
            pytest.fail("a closed pool gives no agents")

"""``rcoder relay --unattached-end S`` (docs/relay.md#running-a-relay): an agent no stream has been
attached to for ``S`` seconds is ended by its relay as on its stop, never one attached, and an
attach starts the wait again; its relay's idle exit follows. A daemon's relays get ``[relays]
unattached_end``: the agents a killed daemon left are ended although no daemon comes back, and
the session's next turn, on a daemon started later, falls back as after any agent's end. A real
relay (tests/relay/relay_kit.py) and the scripted fake agent through it; real daemons for the last."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from rcoder.relay.v1 import relay_pb2_grpc as pb_grpc
from rcoder.v1 import agent_runner_pb2 as pb
from tests.conftest import DaemonFactory
from tests.harness import FakeAgentSetup, completed, eventually, started, text_of
from tests.relay.conftest import RelayFactory
from tests.relay.relay_kit import AcpOverAttach, Relay, fake_agent_spec
from tests.relay.test_placement_relay import argv_of, profiles, relay_pid
from tests.relay.test_relay import alive, spawn

UNATTACHED = 3.0  # the relay's --unattached-end, in seconds
LEASE_TTL = 1.5  # the daemons' [hosts] lease_ttl: unattached_end must be at least twice it


def ended_ids(relay: Relay) -> list[str]:
    return [row["agent_id"] for row in relay.logs("relay_agent_unattached_ended")]


async def test_an_agent_no_stream_attached_to_for_its_time_is_ended_and_the_relay_then_exits(
    make_relay: RelayFactory, tmp_path: Path
) -> None:
    relay = await make_relay("--unattached-end", str(UNATTACHED), "--idle-exit", "1")
    assert relay.serving["unattached_end"] == UNATTACHED
    async with relay.channel() as channel:
        stub = pb_grpc.RelayServiceStub(channel)
        agent = await spawn(stub, relay.metadata, fake_agent_spec(tmp_path / "agent", tmp_path / "project"))
        acp = AcpOverAttach(stub, relay.metadata, agent.agent_id)
        await acp.open()
        loop = asyncio.get_running_loop()
        detached = loop.time()  # before the relay sees the stream go
        await acp.close()  # its daemon goes away and never comes back
        await eventually(lambda: ended_ids(relay) == [agent.agent_id], timeout=UNATTACHED + 30)
        took = loop.time() - detached
    assert took >= UNATTACHED, f"ended {took:.1f} s after its stream went: before its --unattached-end"
    (ended,) = relay.logs("relay_agent_unattached_ended")
    assert ended["seconds"] >= UNATTACHED and ended["session_id"] == "s1" and ended["pid"] == agent.pid
    # ended as on the relay's stop: its group, stdin closed first (the fake agent exits 0 on its end)
    await eventually(lambda: [row["agent_id"] for row in relay.logs("relay_agent_exited")] == [agent.agent_id])
    assert not alive(agent.pid)
    # with no agent left, its idle exit follows
    assert relay.proc is not None
    async with asyncio.timeout(30):
        assert await relay.proc.wait() == 0
    assert relay.logs("relay_idle_exit") and relay.logs("relay_stopped")


async def test_an_attached_agent_lives_and_an_attach_starts_the_wait_again(
    make_relay: RelayFactory, tmp_path: Path
) -> None:
    relay = await make_relay("--unattached-end", str(UNATTACHED))
    loop = asyncio.get_running_loop()
    async with relay.channel() as channel:
        stub = pb_grpc.RelayServiceStub(channel)
        kept = await spawn(stub, relay.metadata, fake_agent_spec(tmp_path / "kept", tmp_path / "project"))
        owner = AcpOverAttach(stub, relay.metadata, kept.agent_id)
        await owner.open()
        await owner.close()
        await owner.open()  # attached again before its time: it lives on while attached
        # an agent spawned after that detach and never attached: once it is ended, the first has
        # had a stream for longer than the wait, since a detach older than the wait
        left = await spawn(stub, relay.metadata, fake_agent_spec(tmp_path / "left", tmp_path / "project"),
                           session_id="s2")  # fmt: skip
        await eventually(lambda: ended_ids(relay) == [left.agent_id], timeout=UNATTACHED + 30)
        assert alive(kept.pid), "an attached agent was ended"
        await eventually(lambda: not alive(left.pid))
        # an owner that attaches late reads its exit, which says why it ended
        late = AcpOverAttach(stub, relay.metadata, left.agent_id)
        await late.open()
        await late.until(lambda: late.exit is not None)
        assert late.exit is not None
        assert "ended this agent: no daemon attached to it for 3 s (--unattached-end 3)" in late.exit.stderr_tail
        await late.close()

        # its stream goes now: the wait starts from this detach, not from the one before
        detached = loop.time()
        await owner.close()
        await eventually(lambda: kept.agent_id in ended_ids(relay), timeout=UNATTACHED + 30)
        took = loop.time() - detached
        assert took >= UNATTACHED, f"ended {took:.1f} s after its last detach: the attach did not start the wait again"
        await eventually(lambda: not alive(kept.pid))
    assert relay.proc is not None and relay.proc.returncode is None, "no --idle-exit: the relay serves on"


async def test_a_relay_refuses_an_unattached_end_that_is_not_seconds(make_relay: RelayFactory) -> None:
    with pytest.raises(RuntimeError, match=r"'unattached-end': -1.0: seconds, 0 \(never\) or more"):
        await make_relay("--unattached-end", "-1")


async def test_a_killed_daemons_idle_agent_is_ended_by_its_relay_and_the_next_turn_resumes(
    make_daemon: DaemonFactory, fake: FakeAgentSetup, tmp_path: Path, relays_ended: list[int]
) -> None:
    # the daemon is SIGKILLed with its session's agent idle in the relay, and no daemon comes back
    # for a while: the relay ends the agent after [relays] unattached_end, then exits (idle_exit);
    # a daemon started later resumes the session, as after any agent's end
    data_dir = tmp_path / "data"
    settings = {"relays_unattached_end": 2 * LEASE_TTL, "lease_ttl": LEASE_TTL, "relays_idle_exit": 3}
    daemon, client = await make_daemon(profiles(fake), **settings)
    first = await client.chat(prompt="remember 7", agent="relayed")
    session_id = first[0].session_id
    relay = relay_pid(data_dir)
    assert relay is not None
    relays_ended.append(relay)
    argv = argv_of(relay)
    assert float(argv[argv.index(b"--unattached-end") + 1]) == 2 * LEASE_TTL
    agent = next(row for row in daemon.logs("agent_spawned") if row.get("placement") == "relay")
    await daemon.kill()

    await eventually(lambda: not alive(agent["pid"]), timeout=2 * LEASE_TTL + 30)
    await eventually(lambda: not alive(relay), timeout=30)
    log = (data_dir / "relays" / "proj" / "relay.log").read_text()
    assert '"relay_agent_unattached_ended"' in log and agent["agent_id"] in log
    assert '"relay_idle_exit"' in log

    _, client = await make_daemon(profiles(fake), **settings)
    again = await client.chat(prompt="what number?", session_id=session_id)
    assert completed(again).stop_reason == pb.STOP_REASON_END_TURN
    assert started(again).resume == pb.RESUME_OUTCOME_RESUMED
    assert text_of(again) == "I remember: 7"
    new_relay = relay_pid(data_dir)
    assert new_relay is not None and new_relay != relay
    relays_ended.append(new_relay)


async def test_a_turn_whose_agent_its_relay_ended_unattached_ends_as_after_an_agents_crash_and_the_next_resumes(
    make_daemon: DaemonFactory, fake: FakeAgentSetup, tmp_path: Path, relays_ended: list[int]
) -> None:
    # the daemon is SIGKILLed mid-turn and comes back only after [relays] unattached_end: the relay
    # (no idle_exit) has ended the turn's agent, and the next daemon meets it ended: the turn, taken
    # up, ends as one whose agent died under it (AGENT_CRASHED), and the session's next turn resumes
    data_dir = tmp_path / "data"
    settings = {"relays_unattached_end": 2 * LEASE_TTL, "lease_ttl": LEASE_TTL, "relays_idle_exit": 0}
    daemon, client = await make_daemon(profiles(fake), **settings)
    session_id = (await client.chat(prompt="remember 7", agent="relayed"))[0].session_id
    relay = relay_pid(data_dir)
    assert relay is not None
    relays_ended.append(relay)
    agent = next(row for row in daemon.logs("agent_spawned") if row.get("placement") == "relay")
    call = client.stub.Chat(pb.ChatRequest(project_id="proj", session_id=session_id,
                                           prompt="stream 10 hold 3 gate never"))  # fmt: skip
    seen: list[pb.ChatStream] = []
    async with asyncio.timeout(20):
        while "c2 " not in text_of(seen):
            event = await call.read()
            assert event is not grpc.aio.EOF
            seen.append(event)
    call.cancel()
    await daemon.kill()  # mid-turn, the agent held at its gate

    await eventually(lambda: not alive(agent["pid"]), timeout=2 * LEASE_TTL + 30)
    assert alive(relay)
    log = (data_dir / "relays" / "proj" / "relay.log").read_text()
    assert '"relay_agent_unattached_ended"' in log

    second, client = await make_daemon(profiles(fake), **settings)
    run_id = seen[0].run_id
    rest = [e async for e in client.stub.Subscribe(pb.SubscribeRequest(run_id=run_id, after_seq=seen[-1].seq))]
    # taken up as any relayed turn, and ended as a turn whose agent died under it
    assert [row["run_id"] for row in second.logs("relayed_turn_reattached")] == [run_id]
    assert completed(rest).stop_reason == pb.STOP_REASON_ERROR
    assert completed(rest).error_reason == "AGENT_CRASHED"
    assert "exited" in completed(rest).error
    # with the agent's last words, as a live turn's error has them: here the relay's own line
    assert "[rcoder relay] ended this agent: no daemon attached to it" in completed(rest).error
    again = await client.chat(prompt="what number?", session_id=session_id)
    assert completed(again).stop_reason == pb.STOP_REASON_END_TURN
    assert started(again).resume == pb.RESUME_OUTCOME_RESUMED
    assert text_of(again) == "I remember: 7"

"""``rcoder relay --idle-exit S`` (docs/relay.md#running-a-relay): a relay with no agent, running or
attached, and no call for ``S`` seconds stops itself as on SIGTERM, and not while an agent runs,
attached or not; a daemon's relay so ended is started again at the project's next turn
(``[relays] idle_exit``). A real relay (tests/relay/relay_kit.py) and the scripted fake agent
through it; a real daemon for the last."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

from rcoder.relay.v1 import relay_pb2 as relay_pb
from rcoder.relay.v1 import relay_pb2_grpc as pb_grpc
from rcoder.v1 import agent_runner_pb2 as pb
from tests.conftest import DaemonFactory
from tests.harness import FakeAgentSetup, completed, eventually, started, text_of
from tests.relay.conftest import RelayFactory
from tests.relay.relay_kit import AcpOverAttach, fake_agent_spec
from tests.relay.test_placement_relay import argv_of, relay_pid
from tests.relay.test_relay import alive, open_session, prompt, spawn

IDLE = 3.0  # the relay's --idle-exit, in seconds
BUSY = 2 * IDLE + 1  # what the agent's own work lasts, detached: past the idle time twice over


async def test_a_relay_stops_itself_once_it_has_had_no_agent_for_its_idle_exit_time(
    make_relay: RelayFactory, tmp_path: Path
) -> None:
    # an agent works unattached (its stream closed) for longer than the idle time: the relay waits;
    # once the agent has ended, the relay stops itself after the idle time, as on SIGTERM
    relay = await make_relay("--idle-exit", str(IDLE))
    assert relay.serving["idle_exit"] == IDLE
    project, done = tmp_path / "project", tmp_path / "project" / "done"
    async with relay.channel() as channel:
        stub = pb_grpc.RelayServiceStub(channel)
        agent = await spawn(stub, relay.metadata, fake_agent_spec(tmp_path / "agent", project))
        acp = AcpOverAttach(stub, relay.metadata, agent.agent_id)
        await acp.open()
        session_id = await open_session(acp, project)
        acp.send({"jsonrpc": "2.0", "id": 3, "method": "session/prompt",
                  "params": prompt(session_id, f"shell sleep {BUSY}; touch {done}")})  # fmt: skip

        async def written() -> bool:
            status = await stub.Status(relay_pb.StatusRequest(agent_id=agent.agent_id), metadata=relay.metadata)
            return bool(status.agent.stdin_seq == acp.stdin_seq)

        await eventually(written)
        await acp.close()  # detached: nothing calls the relay while the agent works
        await eventually(done.exists, timeout=BUSY + 30)
        assert relay.proc is not None and relay.proc.returncode is None, "it stopped while an agent ran"
        assert relay.logs("relay_idle_exit") == []

        await stub.Signal(relay_pb.SignalRequest(agent_id=agent.agent_id, generation=1, signal=signal.SIGKILL),
                          metadata=relay.metadata)  # fmt: skip
        loop = asyncio.get_running_loop()
        ended = loop.time()
        async with asyncio.timeout(IDLE + 30):
            code = await relay.proc.wait()
        took = loop.time() - ended
    assert code == 0
    assert took >= IDLE, f"stopped {took:.1f} s after its last agent ended: before its idle time"
    (idle,) = relay.logs("relay_idle_exit")
    assert idle["seconds"] == IDLE
    assert relay.logs("relay_stopped")
    assert not alive(agent.pid)
    assert not relay.socket.exists()


async def test_a_daemons_relay_stops_itself_once_its_last_agent_ended_and_the_next_turn_starts_another(
    make_daemon: DaemonFactory, fake: FakeAgentSetup, tmp_path: Path, relays_ended: list[int]
) -> None:
    # [relays] idle_exit: the relay the daemon started stops itself once the session's agent has
    # ended (its session closed) and the idle time passed; the project's next turn starts a new one
    profiles = {"fake": fake.profile(), "relayed": fake.profile(placement="relay")}
    daemon, client = await make_daemon(profiles, relays_idle_exit=IDLE)
    first = await client.chat(prompt="remember 7", agent="relayed")
    pid = relay_pid(tmp_path / "data")
    assert pid is not None
    relays_ended.append(pid)
    argv = argv_of(pid)
    assert float(argv[argv.index(b"--idle-exit") + 1]) == IDLE
    closing = pb.CloseSessionRequest(session_id=first[0].session_id)
    assert (await client.stub.CloseSession(closing)).agent_stopped
    await eventually(lambda: not alive(pid), timeout=IDLE + 30)
    assert '"relay_idle_exit"' in (tmp_path / "data" / "relays" / "proj" / "relay.log").read_text()

    again = await client.chat(prompt="what number?", session_id=first[0].session_id)
    assert completed(again).stop_reason == pb.STOP_REASON_END_TURN
    assert started(again).resume == pb.RESUME_OUTCOME_RESUMED
    assert text_of(again) == "I remember: 7"
    new_relay = relay_pid(tmp_path / "data")
    assert new_relay is not None and new_relay != pid
    relays_ended.append(new_relay)
    assert len(daemon.logs("relay_started")) == 2

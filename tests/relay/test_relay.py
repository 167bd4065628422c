"""``rcoder relay`` as a process: agents spawned through it, ACP through Attach, re-attach, fencing.

A real relay (tests/relay/relay_kit.py), a real gRPC client on its unix socket, the scripted fake
agent (tests/fakes/fake_agent.py) spawned confined through it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import stat
import sys
from pathlib import Path

import grpc
import pytest

from rcoder.relay.v1 import relay_pb2 as pb
from rcoder.relay.v1 import relay_pb2_grpc as pb_grpc
from tests.harness import ROOT, die_with_the_test, error_info, eventually, processes_mentioning
from tests.relay.conftest import RelayFactory
from tests.relay.relay_kit import AcpOverAttach, Relay, chunks, fake_agent_spec, initialize
from tests.test_access import make_certificate


async def spawn(stub: pb_grpc.RelayServiceStub, metadata: tuple[tuple[str, str], ...], spec: pb.StartSpec,
                session_id: str = "s1", generation: int = 1) -> pb.Agent:  # fmt: skip
    request = pb.SpawnRequest(session_id=session_id, generation=generation, spec=spec)
    answer: pb.SpawnResponse = await stub.Spawn(request, metadata=metadata)
    return answer.agent


async def open_session(acp: AcpOverAttach, cwd: Path) -> str:
    await acp.call(*initialize())
    opened = await acp.call(2, "session/new", {"cwd": str(cwd), "mcpServers": []})
    return str(opened["sessionId"])


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def held_by(pid: int, target: str) -> bool:
    """Whether process ``pid`` holds a descriptor naming ``target`` (``pipe:[inode]``)."""
    folder = Path(f"/proc/{pid}/fd")
    return any(os.readlink(fd) == target for fd in folder.iterdir())


def prompt(session_id: str, text: str) -> dict[str, object]:
    return {"sessionId": session_id, "prompt": [{"type": "text", "text": text}]}


async def test_an_acp_turn_goes_through_attach(make_relay: RelayFactory, tmp_path: Path) -> None:
    relay = await make_relay()
    async with relay.channel() as channel:
        stub = pb_grpc.RelayServiceStub(channel)
        agent = await spawn(stub, relay.metadata, fake_agent_spec(tmp_path / "agent", tmp_path / "project"))
        assert agent.pid > 0 and agent.last_seq == 0
        acp = AcpOverAttach(stub, relay.metadata, agent.agent_id)
        await acp.open()
        session_id = await open_session(acp, tmp_path / "project")
        done = await acp.call(3, "session/prompt", prompt(session_id, "stream 5"))
        assert done["stopReason"] == "end_turn"
        assert chunks(acp.messages()) == [*(f"c{i} " for i in range(5)), "I remember nothing."]
        assert sorted(acp.frames) == list(range(1, len(acp.frames) + 1))  # numbered from 1, no gap
        status = (await stub.Status(pb.StatusRequest(agent_id=agent.agent_id), metadata=relay.metadata)).agent
        assert status.last_seq == len(acp.frames) and status.stdin_seq == 3 and status.attached
        acp.send({"jsonrpc": "2.0", "method": "never/mind"})  # stdin 4, then its end: the agent exits
        acp._outbox.put_nowait(pb.AttachRequest(close_stdin=True))
        await acp.until(lambda: acp.exit is not None)
        assert acp.exit is not None and acp.exit.last_seq == len(acp.frames)
        await acp.close()
        listed = (await stub.ListAgents(pb.ListAgentsRequest(), metadata=relay.metadata)).agents
        assert [a.agent_id for a in listed] == [agent.agent_id] and listed[0].exited


def assert_whole_turn(frames: dict[int, bytes], count: int) -> None:
    """Frames 1..n, each once, with the turn's ``count`` chunks in order and its answer."""
    assert sorted(frames) == list(range(1, len(frames) + 1))
    messages = [json.loads(frames[seq]) for seq in sorted(frames)]
    assert chunks(messages)[:count] == [f"c{i} " for i in range(count)]
    answers = [m for m in messages if m.get("id") == 3 and "method" not in m]
    assert [a.get("result", {}).get("stopReason") for a in answers] == ["end_turn"]  # one prompt, one answer


async def test_a_dropped_stream_attached_again_gets_every_frame_once_in_order(
    make_relay: RelayFactory, tmp_path: Path
) -> None:
    relay = await make_relay()
    async with relay.channel() as channel:
        stub = pb_grpc.RelayServiceStub(channel)
        agent = await spawn(stub, relay.metadata, fake_agent_spec(tmp_path / "agent", tmp_path / "project"))
        acp = AcpOverAttach(stub, relay.metadata, agent.agent_id, ack_every=4)
        await acp.open()
        session_id = await open_session(acp, tmp_path / "project")
        acp.send(
            {"jsonrpc": "2.0", "id": 3, "method": "session/prompt", "params": prompt(session_id, "stream 40 pace 25")}
        )
        await acp.until(lambda: len(chunks(acp.messages())) >= 10)
        acp.drop()  # mid-turn; what was read and not acknowledged is not kept
        kept = acp.acked
        await acp.close()
        ready = await acp.open()  # from the first frame not kept
        assert ready.acked_seq == kept and ready.stdin_seq == 3
        # a client unsure of what reached the agent sends its stdin again: what was written is skipped
        for seq, data in enumerate(acp._pending, start=1):
            acp._outbox.put_nowait(pb.AttachRequest(stdin=pb.StdinFrame(seq=seq, data=data)))
        await acp.until(lambda: acp.response(3) is not None)
        assert_whole_turn(acp.frames, 40)
        assert acp.lagged == []
        await acp.close()


async def test_a_killed_client_leaves_the_rest_of_the_turn_to_the_next(
    make_relay: RelayFactory, tmp_path: Path
) -> None:
    relay = await make_relay()
    project = tmp_path / "project"
    async with relay.channel() as channel:
        stub = pb_grpc.RelayServiceStub(channel)
        agent = await spawn(stub, relay.metadata, fake_agent_spec(tmp_path / "agent", project))
        client = await asyncio.create_subprocess_exec(
            *die_with_the_test(), sys.executable, "-m", "tests.relay.attach_client", str(relay.socket),
            str(relay.state_dir / "secret"), agent.agent_id, str(project), "stream 60 pace 25",
            stdout=asyncio.subprocess.PIPE, start_new_session=True, cwd=str(ROOT),
        )  # fmt: skip
        printed: dict[int, bytes] = {}
        try:
            assert client.stdout is not None
            async with asyncio.timeout(60):
                while len(chunks([json.loads(d) for d in printed.values()])) < 10:
                    line = await client.stdout.readline()
                    assert line, "the client ended before the turn was under way"
                    row = json.loads(line)
                    printed[row["seq"]] = row["data"].encode()
        finally:
            os.killpg(client.pid, signal.SIGKILL)
            await client.wait()
        assert client.returncode == -signal.SIGKILL
        # what it printed it kept; the relay may not have its last acks: the next owner attaches from
        # the first frame it does not have, as a daemon does from what it stored
        acp = AcpOverAttach(stub, relay.metadata, agent.agent_id)
        acp.keep(printed)
        acp.stdin_seq = 3
        ready = await acp.open()
        assert ready.stdin_seq == 3 and not ready.exited
        await acp.until(lambda: acp.response(3) is not None)
        assert_whole_turn(acp.frames, 60)
        acp.close_stdin()
        await acp.until(lambda: acp.exit is not None)
        assert acp.exit is not None and acp.exit.exit_code == 0 and acp.exit.last_seq == max(acp.frames)
        await acp.close()


async def test_an_older_generation_is_refused_once_a_newer_one_attached(
    make_relay: RelayFactory, tmp_path: Path
) -> None:
    relay = await make_relay()
    async with relay.channel() as channel:
        stub = pb_grpc.RelayServiceStub(channel)
        spec = fake_agent_spec(tmp_path / "agent", tmp_path / "project")
        agent = await spawn(stub, relay.metadata, spec, generation=2)
        first = AcpOverAttach(stub, relay.metadata, agent.agent_id, generation=2)
        await first.open()
        # the same owner attaching again (its first stream not yet seen to drop) takes the agent
        old = AcpOverAttach(stub, relay.metadata, agent.agent_id, generation=2)
        await old.open()
        await first.until(lambda: first.error is not None)
        assert first.error is not None and first.error.code() == grpc.StatusCode.ABORTED
        assert error_info(first.error).reason == "ATTACH_TAKEN_OVER"
        await first.close()
        new = AcpOverAttach(stub, relay.metadata, agent.agent_id, generation=3)
        await new.open()
        # the old owner's stream is ended: nothing it sends reaches the agent any more
        await old.until(lambda: old.error is not None)
        assert old.error is not None and old.error.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert error_info(old.error).reason == "STALE_GENERATION"
        await new.call(*initialize())  # the new owner's does
        await old.close()
        with pytest.raises(grpc.aio.AioRpcError) as attach:
            await AcpOverAttach(stub, relay.metadata, agent.agent_id, generation=2).open()
        with pytest.raises(grpc.aio.AioRpcError) as signalled:
            await stub.Signal(pb.SignalRequest(agent_id=agent.agent_id, generation=2, signal=signal.SIGTERM),
                              metadata=relay.metadata)  # fmt: skip
        with pytest.raises(grpc.aio.AioRpcError) as spawned:
            await spawn(stub, relay.metadata, spec, generation=1)
        for refused in (attach.value, signalled.value, spawned.value):
            assert refused.code() == grpc.StatusCode.FAILED_PRECONDITION, refused
            info = error_info(refused)
            assert info.reason == "STALE_GENERATION"
            assert info.metadata["newest_generation"] == "3"
            assert "no longer owns" in (refused.details() or "") or "older than" in (refused.details() or "")
        status = (await stub.Status(pb.StatusRequest(agent_id=agent.agent_id), metadata=relay.metadata)).agent
        assert status.generation == 3 and not status.exited and status.stdin_seq == 1
        # another session's generations are its own
        await spawn(stub, relay.metadata, spec, session_id="s2", generation=1)
        # a newer generation's Signal fences too: the stream generation 3 holds ends
        resumed = pb.SignalRequest(agent_id=agent.agent_id, generation=4, signal=signal.SIGCONT)
        await stub.Signal(resumed, metadata=relay.metadata)
        await new.until(lambda: new.error is not None)
        assert new.error is not None and new.error.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert error_info(new.error).metadata["newest_generation"] == "4"
        await new.close()


async def test_stdin_after_a_gap_is_refused(make_relay: RelayFactory, tmp_path: Path) -> None:
    relay = await make_relay()
    async with relay.channel() as channel:
        stub = pb_grpc.RelayServiceStub(channel)
        agent = await spawn(stub, relay.metadata, fake_agent_spec(tmp_path / "agent", tmp_path / "project"))
        acp = AcpOverAttach(stub, relay.metadata, agent.agent_id)
        await acp.open()
        acp._outbox.put_nowait(pb.AttachRequest(stdin=pb.StdinFrame(seq=2, data=b"{}\n")))  # frame 1 never sent
        await acp.until(lambda: acp.error is not None)
        assert acp.error is not None and acp.error.code() == grpc.StatusCode.OUT_OF_RANGE
        assert "frames 1..1 were never sent" in (acp.error.details() or "")
        await acp.close()
        status = (await stub.Status(pb.StatusRequest(agent_id=agent.agent_id), metadata=relay.metadata)).agent
        assert status.stdin_seq == 0 and not status.attached


async def test_a_call_without_the_secret_is_refused(make_relay: RelayFactory, tmp_path: Path) -> None:
    relay = await make_relay()
    async with relay.channel() as channel:
        stub = pb_grpc.RelayServiceStub(channel)
        for metadata in ((), (("authorization", "Bearer not-the-secret"),), (("authorization", relay.secret),)):
            with pytest.raises(grpc.aio.AioRpcError) as listed:
                await stub.ListAgents(pb.ListAgentsRequest(), metadata=metadata)
            assert listed.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert error_info(listed.value).reason == "UNAUTHENTICATED"
            with pytest.raises(grpc.aio.AioRpcError) as attached:
                await AcpOverAttach(stub, metadata, "agent-x").open()
            assert attached.value.code() == grpc.StatusCode.UNAUTHENTICATED
        spec = fake_agent_spec(tmp_path / "agent", tmp_path / "project")
        with pytest.raises(grpc.aio.AioRpcError) as spawned:
            await stub.Spawn(pb.SpawnRequest(session_id="s1", generation=1, spec=spec))
        assert spawned.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert (await stub.ListAgents(pb.ListAgentsRequest(), metadata=relay.metadata)).agents == []
    assert stat.S_IMODE(relay.socket.stat().st_mode) == 0o600
    assert stat.S_IMODE(relay.state_dir.stat().st_mode) == 0o700
    assert stat.S_IMODE((relay.state_dir / "secret").stat().st_mode) == 0o600


async def test_no_agent_can_read_the_secret(make_relay: RelayFactory, tmp_path: Path) -> None:
    relay = await make_relay(state_dir=tmp_path / "relay")
    secret_file = relay.state_dir / "secret"
    environ = Path(f"/proc/{relay.pid}/environ")
    leak = tmp_path / "project" / "leak.txt"
    (tmp_path / "other").mkdir()
    granted = tmp_path / "other" / "granted.txt"  # beside the relay's folder, in the grant around it
    async with relay.channel() as channel:
        stub = pb_grpc.RelayServiceStub(channel)
        spec = fake_agent_spec(tmp_path / "agent", tmp_path / "project")
        # grants that hold the relay's folder: it is granted around
        spec.confinement.read_paths.append(str(tmp_path))
        spec.confinement.write_paths.append(str(tmp_path))
        agent = await spawn(stub, relay.metadata, spec)
        acp = AcpOverAttach(stub, relay.metadata, agent.agent_id)
        await acp.open()
        session_id = await open_session(acp, tmp_path / "project")
        text = f"readfile {secret_file} readfile {environ} writefile {granted}\n"
        text += f"shell cat {secret_file} > {leak}"
        done = await acp.call(3, "session/prompt", prompt(session_id, text))
        assert done["stopReason"] == "end_turn"
        answer = "".join(chunks(acp.messages()))
        assert f"readfile[{secret_file}]=EACCES" in answer
        assert f"readfile[{environ}]=EACCES" in answer
        assert f"writefile[{granted}]=ok" in answer  # the rest of the grant holds
        assert "shell=exit 1" in answer
        assert leak.read_text() == ""
        await acp.close()


async def test_tcp_is_served_with_tls(make_relay: RelayFactory, tmp_path: Path) -> None:
    cert, key = make_certificate(tmp_path)
    relay = await make_relay("--listen", "127.0.0.1:0", "--tls-cert", str(cert), "--tls-key", str(key))
    address = relay.serving["address"]
    assert address.startswith("127.0.0.1:") and not address.endswith(":0")
    # the port bound, in its folder for its starter to store (docs/relay.md#placement)
    assert (relay.state_dir / "address").read_text() == address + "\n"
    credentials = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
    async with grpc.aio.secure_channel(address, credentials) as channel:
        stub = pb_grpc.RelayServiceStub(channel)
        agent = await spawn(stub, relay.metadata, fake_agent_spec(tmp_path / "agent", tmp_path / "project"))
        acp = AcpOverAttach(stub, relay.metadata, agent.agent_id)
        await acp.open()
        await acp.call(*initialize())
        await acp.close()
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.ListAgents(pb.ListAgentsRequest())
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    async with grpc.aio.insecure_channel(address) as plain:
        with pytest.raises(grpc.aio.AioRpcError) as plaintext:
            await pb_grpc.RelayServiceStub(plain).ListAgents(
                pb.ListAgentsRequest(), metadata=relay.metadata, timeout=10
            )
        assert plaintext.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_tcp_without_tls_is_refused_at_start(tmp_path: Path) -> None:
    started = await asyncio.create_subprocess_exec(
        *die_with_the_test(), sys.executable, "-m", "rcoder", "relay", "--state-dir", str(tmp_path / "relay"),
        "--listen", "127.0.0.1:0", stderr=asyncio.subprocess.PIPE, start_new_session=True, cwd=str(ROOT),
    )  # fmt: skip
    async with asyncio.timeout(60):
        _, stderr = await started.communicate()
    assert started.returncode == 2
    assert b"only with TLS" in stderr


async def test_a_client_behind_the_buffer_is_told_how_many_frames_it_lost(
    make_relay: RelayFactory, tmp_path: Path
) -> None:
    bound = 4096
    relay = await make_relay("--buffer-bytes", str(bound))
    async with relay.channel() as channel:
        stub = pb_grpc.RelayServiceStub(channel)
        agent = await spawn(stub, relay.metadata, fake_agent_spec(tmp_path / "agent", tmp_path / "project"))
        first = AcpOverAttach(stub, relay.metadata, agent.agent_id, ack_every=1 << 30)  # it acknowledges nothing
        await first.open()
        session_id = await open_session(first, tmp_path / "project")
        first.send({"jsonrpc": "2.0", "id": 3, "method": "session/prompt", "params": prompt(session_id, "stream 300")})

        async def prompted() -> bool:
            answer: pb.StatusResponse = await stub.Status(pb.StatusRequest(agent_id=agent.agent_id),
                                                          metadata=relay.metadata)  # fmt: skip
            return answer.agent.stdin_seq == 3

        await eventually(prompted)
        first.drop()
        await first.close()
        kept = first.acked
        assert kept == 0

        # the turn's end: the answers to initialize and session/new, 300 chunks, the answer's chunk and
        # the prompt's answer, all written while nobody acknowledged any
        async def turn_written() -> bool:
            answer: pb.StatusResponse = await stub.Status(pb.StatusRequest(agent_id=agent.agent_id),
                                                          metadata=relay.metadata)  # fmt: skip
            return answer.agent.last_seq >= 2 + 300 + 2

        await eventually(turn_written)
        behind = AcpOverAttach(stub, relay.metadata, agent.agent_id)
        behind.keep(first.frames)
        ready = await behind.open()
        await behind.until(lambda: behind.response(3) is not None)
        assert ready.dropped_frames > 0
        assert len(behind.lagged) == 1
        lag = behind.lagged[0]
        assert lag.next_seq == ready.first_buffered_seq and lag.dropped_frames == lag.next_seq - (kept + 1)
        held = [behind.frames[seq] for seq in range(lag.next_seq, ready.last_seq + 1)]
        assert 0 < sum(map(len, held)) <= bound  # what the relay held when attached: within the bound
        after = sorted(s for s in behind.frames if s >= lag.next_seq)
        assert after == list(range(lag.next_seq, max(behind.frames) + 1))  # no gap after the lag
        await behind.close()


async def test_sigterm_ends_every_agent_and_what_it_started(make_relay: RelayFactory, tmp_path: Path) -> None:
    relay = await make_relay()
    marker = f"{3000 + os.getpid() % 1000}.{int.from_bytes(os.urandom(2), 'big')}"
    async with relay.channel() as channel:
        stub = pb_grpc.RelayServiceStub(channel)
        agent = await spawn(stub, relay.metadata, fake_agent_spec(tmp_path / "agent", tmp_path / "project"))
        acp = AcpOverAttach(stub, relay.metadata, agent.agent_id)
        await acp.open()
        session_id = await open_session(acp, tmp_path / "project")
        # a process of the agent's outside its group, as a daemon it starts would be
        await acp.call(3, "session/prompt", prompt(session_id, f"shell setsid sleep {marker} &"))
        await eventually(lambda: bool(processes_mentioning(f"sleep {marker}")))
        await acp.close()
    assert await relay.stop() == 0
    assert not alive(agent.pid)
    assert processes_mentioning(f"sleep {marker}") == []
    assert not relay.socket.exists()
    assert relay.logs("relay_stopped")


async def test_a_relay_outlives_the_process_that_started_it(tmp_path: Path) -> None:
    state = tmp_path / "relay"
    # the starter runs the relay in its own process group, as a daemon would run a child; then it is killed
    starter = await asyncio.create_subprocess_exec(
        *die_with_the_test(), sys.executable, "-c",
        "import subprocess as s, sys; relay = s.Popen(sys.argv[1:], stdout=s.DEVNULL, stderr=s.DEVNULL); "
        "print(relay.pid, flush=True); relay.wait()",
        sys.executable, "-m", "rcoder", "relay", "--state-dir", str(state),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL, start_new_session=True, cwd=str(ROOT),
    )  # fmt: skip
    assert starter.stdout is not None
    relay_pid = int(await asyncio.wait_for(starter.stdout.readline(), 30))
    try:
        await eventually(lambda: (state / "relay.sock").exists())
        assert os.getsid(relay_pid) == relay_pid  # a session of its own
        os.killpg(starter.pid, signal.SIGKILL)
        await starter.wait()
        secret = (state / "secret").read_text().strip()
        async with grpc.aio.insecure_channel(f"unix:{state / 'relay.sock'}") as channel:
            listed = await pb_grpc.RelayServiceStub(channel).ListAgents(
                pb.ListAgentsRequest(),
                metadata=(("authorization", f"Bearer {secret}"),),
                timeout=10,
                wait_for_ready=True,  # its socket is made when it binds, a moment before it serves
            )
        assert listed.agents == []
        assert alive(relay_pid)
    finally:
        # its group, and itself should it have stayed in the starter's (then killpg finds no group)
        for end in (os.killpg, os.kill):
            with contextlib.suppress(ProcessLookupError):
                end(relay_pid, signal.SIGKILL)
        await eventually(lambda: not alive(relay_pid))


async def test_a_spec_the_relay_cannot_run_is_refused_with_what_to_fix(
    make_relay: RelayFactory, tmp_path: Path
) -> None:
    relay = await make_relay()
    good = fake_agent_spec(tmp_path / "agent", tmp_path / "project")
    cases: list[tuple[pb.StartSpec, grpc.StatusCode, str]] = []
    for change, code, said in (
        ({"command": ["python3"]}, grpc.StatusCode.INVALID_ARGUMENT, "spec.command"),
        ({"command": []}, grpc.StatusCode.INVALID_ARGUMENT, "spec.command"),
        ({"cwd": str(tmp_path / "missing")}, grpc.StatusCode.INVALID_ARGUMENT, "spec.cwd"),
        ({"image": "rcoder:latest"}, grpc.StatusCode.UNIMPLEMENTED, "container placement"),
        ({"limits": pb.Limits(memory_max=1 << 30)}, grpc.StatusCode.INVALID_ARGUMENT, "pids_max"),
        ({"confinement": pb.Confinement(read_paths=["usr"])}, grpc.StatusCode.INVALID_ARGUMENT, "absolute"),
    ):
        spec = pb.StartSpec()
        spec.CopyFrom(good)
        for name, value in change.items():
            spec.ClearField(name)  # type: ignore[arg-type]
            if isinstance(value, list):
                getattr(spec, name).extend(value)
            elif isinstance(value, str):
                setattr(spec, name, value)
            else:
                getattr(spec, name).CopyFrom(value)
        cases.append((spec, code, said))
    async with relay.channel() as channel:
        stub = pb_grpc.RelayServiceStub(channel)
        for spec, code, said in cases:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await spawn(stub, relay.metadata, spec)
            assert refused.value.code() == code, (spec, refused.value)
            assert said in (refused.value.details() or "")
        with pytest.raises(grpc.aio.AioRpcError) as unnamed:
            await spawn(stub, relay.metadata, good, session_id="")
        assert unnamed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.aio.AioRpcError) as unknown:
            await stub.Status(pb.StatusRequest(agent_id="agent-none"), metadata=relay.metadata)
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
        assert (await stub.ListAgents(pb.ListAgentsRequest(), metadata=relay.metadata)).agents == []


async def test_an_agent_runs_within_its_limits_and_a_signal_ends_its_group(
    make_relay: RelayFactory, tmp_path: Path
) -> None:
    relay = await make_relay()
    if relay.serving["limits"] == "none":
        pytest.skip("this host gives the relay no cgroups")
    spec = fake_agent_spec(tmp_path / "agent", tmp_path / "project")
    spec.limits.CopyFrom(pb.Limits(memory_max=1 << 30, pids_max=24))
    async with relay.channel() as channel:
        stub = pb_grpc.RelayServiceStub(channel)
        agent = await spawn(stub, relay.metadata, spec)
        acp = AcpOverAttach(stub, relay.metadata, agent.agent_id)
        await acp.open()
        session_id = await open_session(acp, tmp_path / "project")
        await acp.call(3, "session/prompt", prompt(session_id, "forks 64"))
        answer = "".join(chunks(acp.messages()))
        assert "refused=EAGAIN" in answer, answer
        signalled = await stub.Signal(pb.SignalRequest(agent_id=agent.agent_id, generation=1, signal=signal.SIGKILL),
                                      metadata=relay.metadata)  # fmt: skip
        assert signalled.agent.agent_id == agent.agent_id
        await acp.until(lambda: acp.exit is not None)
        assert acp.exit is not None and acp.exit.exit_code == -signal.SIGKILL
        await acp.close()
        with pytest.raises(grpc.aio.AioRpcError) as bad:
            await stub.Signal(pb.SignalRequest(agent_id=agent.agent_id, generation=1, signal=999),
                              metadata=relay.metadata)  # fmt: skip
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_the_oldest_exited_agents_are_forgotten_past_keep_exited(
    make_relay: RelayFactory, tmp_path: Path
) -> None:
    relay = await make_relay("--keep-exited", "1")
    async with relay.channel() as channel:
        stub = pb_grpc.RelayServiceStub(channel)
        spec = fake_agent_spec(tmp_path / "agent", tmp_path / "project")
        first, second, running = [await spawn(stub, relay.metadata, spec, session_id=f"s{i}") for i in range(3)]
        for agent in (first, second):
            acp = AcpOverAttach(stub, relay.metadata, agent.agent_id)
            await acp.open()
            acp.close_stdin()
            await acp.until(lambda acp=acp: acp.exit is not None)
            await acp.close()

        async def listed() -> list[str]:
            answer: pb.ListAgentsResponse = await stub.ListAgents(pb.ListAgentsRequest(), metadata=relay.metadata)
            return sorted(a.agent_id for a in answer.agents)

        await eventually(lambda: relay.logs("relay_agent_forgotten") != [])
        assert await listed() == sorted([second.agent_id, running.agent_id])
        with pytest.raises(grpc.aio.AioRpcError) as gone:
            await stub.Status(pb.StatusRequest(agent_id=first.agent_id), metadata=relay.metadata)
        assert gone.value.code() == grpc.StatusCode.NOT_FOUND
        one = await stub.ListAgents(pb.ListAgentsRequest(session_id="s2"), metadata=relay.metadata)
        assert [a.agent_id for a in one.agents] == [running.agent_id]


async def test_a_secret_handed_over_by_descriptor_is_the_one_asked(tmp_path: Path) -> None:
    secret = "handed-over-" + os.urandom(16).hex()
    read, write = os.pipe()
    pipe = f"pipe:[{os.fstat(read).st_ino}]"
    os.write(write, secret.encode())
    os.close(write)
    relay = Relay(tmp_path / "relay", ("--secret-fd", str(read)), pass_fds=(read,), given_secret=secret)
    try:
        await relay.start()
        os.close(read)
        assert not (relay.state_dir / "secret").exists()  # nothing written where it could be read
        assert not held_by(relay.pid, pipe)  # read once, then closed: no agent inherits it
        async with relay.channel() as channel:
            stub = pb_grpc.RelayServiceStub(channel)
            assert (await stub.ListAgents(pb.ListAgentsRequest(), metadata=relay.metadata)).agents == []
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.ListAgents(pb.ListAgentsRequest(), metadata=(("authorization", "Bearer handed-over-"),))
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        await relay.kill()


async def test_a_secret_its_starter_wrote_is_the_one_asked_and_one_others_may_read_is_refused(tmp_path: Path) -> None:
    # --secret-file (a relay's container serving TCP: its starter derives the secret and writes it
    # in the state folder): the relay asks that one, and leaves the file as it was; a file of a
    # wider mode than 0600 is refused at the start, saying what to do
    folder = tmp_path / "relay"
    folder.mkdir(mode=0o700)
    secret = "written-" + os.urandom(16).hex()
    fd = os.open(folder / "secret", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, secret.encode() + b"\n")
    os.close(fd)
    relay = Relay(folder, ("--secret-file", str(folder / "secret")), given_secret=secret)
    try:
        await relay.start()
        assert (folder / "secret").read_text() == secret + "\n", "read, not replaced by a secret of its own"
        async with relay.channel() as channel:
            stub = pb_grpc.RelayServiceStub(channel)
            assert (await stub.ListAgents(pb.ListAgentsRequest(), metadata=relay.metadata)).agents == []
    finally:
        await relay.kill()

    wide = tmp_path / "wide"
    wide.mkdir(mode=0o700)
    (wide / "secret").write_text(secret)
    os.chmod(wide / "secret", 0o644)
    started = await asyncio.create_subprocess_exec(
        *die_with_the_test(), sys.executable, "-m", "rcoder", "relay", "--state-dir", str(wide),
        "--secret-file", str(wide / "secret"), stderr=asyncio.subprocess.PIPE, start_new_session=True, cwd=str(ROOT),
    )  # fmt: skip
    async with asyncio.timeout(60):
        _, stderr = await started.communicate()
    assert started.returncode == 2
    assert b"give it mode 0600" in stderr, stderr


async def test_a_second_relay_on_the_same_state_folder_stops_at_once(make_relay: RelayFactory, tmp_path: Path) -> None:
    relay = await make_relay(state_dir=tmp_path / "relay")
    secret = relay.secret
    second = await asyncio.create_subprocess_exec(
        *die_with_the_test(), sys.executable, "-m", "rcoder", "relay", "--state-dir", str(relay.state_dir),
        stderr=asyncio.subprocess.PIPE, start_new_session=True, cwd=str(ROOT),
    )  # fmt: skip
    async with asyncio.timeout(60):
        _, stderr = await second.communicate()
    assert second.returncode == 2
    assert f"in use by another relay (pid {relay.pid})" in stderr.decode()
    assert relay.secret == secret and relay.socket.exists()  # the first one's, untouched
    async with relay.channel() as channel:
        stub = pb_grpc.RelayServiceStub(channel)
        assert (await stub.ListAgents(pb.ListAgentsRequest(), metadata=relay.metadata)).agents == []


async def test_an_agent_run_as_root_holds_no_capability(make_relay: RelayFactory, tmp_path: Path) -> None:
    relay = await make_relay()
    spec = fake_agent_spec(tmp_path / "agent", tmp_path / "project")
    spec.confinement.read_paths.append("/proc")  # to read its own status; nothing else of /proc matters here
    check = (
        "shell test $(id -u) = 0 && grep -Eq '^CapEff:\\s+0+$' /proc/self/status"
        " && grep -Eq '^CapBnd:\\s+0+$' /proc/self/status && grep -Eq '^NoNewPrivs:\\s+1$' /proc/self/status"
    )
    async with relay.channel() as channel:
        stub = pb_grpc.RelayServiceStub(channel)
        agent = await spawn(stub, relay.metadata, spec)
        acp = AcpOverAttach(stub, relay.metadata, agent.agent_id)
        await acp.open()
        session_id = await open_session(acp, tmp_path / "project")
        await acp.call(3, "session/prompt", prompt(session_id, check))
        assert "shell=exit 0" in "".join(chunks(acp.messages()))
        await acp.close()


async def test_drops_at_any_point_of_a_burst_lose_and_repeat_nothing(make_relay: RelayFactory, tmp_path: Path) -> None:
    relay = await make_relay()
    async with relay.channel() as channel:
        stub = pb_grpc.RelayServiceStub(channel)
        agent = await spawn(stub, relay.metadata, fake_agent_spec(tmp_path / "agent", tmp_path / "project"))
        acp = AcpOverAttach(stub, relay.metadata, agent.agent_id, ack_every=3)
        await acp.open()
        session_id = await open_session(acp, tmp_path / "project")
        acp.send({"jsonrpc": "2.0", "id": 3, "method": "session/prompt", "params": prompt(session_id, "stream 400")})
        drops = 0
        for step in (1, 7, 2, 13, 5, 31, 3, 17, 11, 23, 1, 9):  # frames read before each cut, varied
            if acp.response(3) is not None:
                break
            target = len(acp.frames) + step
            await acp.until(lambda target=target: len(acp.frames) >= target or acp.response(3) is not None)
            acp.drop()
            await acp.close()
            await acp.open()
            drops += 1
        await acp.until(lambda: acp.response(3) is not None)
        assert drops >= 3  # the turn was cut several times while it streamed
        assert_whole_turn(acp.frames, 400)
        await acp.close()


async def test_a_killed_relay_takes_its_agents_with_it(make_relay: RelayFactory, tmp_path: Path) -> None:
    relay = await make_relay()
    async with relay.channel() as channel:
        stub = pb_grpc.RelayServiceStub(channel)
        confined = await spawn(stub, relay.metadata, fake_agent_spec(tmp_path / "a", tmp_path / "project"))
        unconfined = await spawn(stub, relay.metadata, fake_agent_spec(tmp_path / "b", tmp_path / "project",
                                                                          confined=False))  # fmt: skip
    assert alive(confined.pid) and alive(unconfined.pid)
    os.kill(relay.pid, signal.SIGKILL)  # the relay alone, not its group: its agents' death signal ends them
    await eventually(lambda: not alive(confined.pid) and not alive(unconfined.pid))
    await relay.kill()


async def test_what_a_killed_relays_agents_left_is_ended_at_its_next_start(
    make_relay: RelayFactory, tmp_path: Path
) -> None:
    relay = await make_relay(state_dir=tmp_path / "relay")
    marker = f"{4000 + os.getpid() % 1000}.{int.from_bytes(os.urandom(2), 'big')}"
    try:
        async with relay.channel() as channel:
            stub = pb_grpc.RelayServiceStub(channel)
            agent = await spawn(stub, relay.metadata, fake_agent_spec(tmp_path / "agent", tmp_path / "project"))
            acp = AcpOverAttach(stub, relay.metadata, agent.agent_id)
            await acp.open()
            session_id = await open_session(acp, tmp_path / "project")
            await acp.call(3, "session/prompt", prompt(session_id, f"shell setsid sleep {marker} &"))
            await eventually(lambda: bool(processes_mentioning(f"sleep {marker}")))
            await acp.close()
        os.kill(relay.pid, signal.SIGKILL)
        await eventually(lambda: not alive(agent.pid))
        assert processes_mentioning(f"sleep {marker}")  # outside the agent's group: the death signal missed it
        await relay.kill()
        again = await make_relay(state_dir=relay.state_dir)
        await eventually(lambda: processes_mentioning(f"sleep {marker}") == [])
        assert again.logs("relay_leftovers_swept")
    finally:
        for pid in processes_mentioning(f"sleep {marker}"):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


async def test_an_agent_whose_stdout_outlives_it_still_ends_with_its_exit(
    make_relay: RelayFactory, tmp_path: Path
) -> None:
    relay = await make_relay("--stop-grace", "0.5")
    marker = f"{5000 + os.getpid() % 1000}.{int.from_bytes(os.urandom(2), 'big')}"
    # a child that holds the agent's stdout, with no mark in its environment (env -i), stays in its group
    script = f"env -i /bin/sleep {marker} & echo started; exit 3"
    spec = pb.StartSpec(name="sh", command=["/bin/sh", "-c", script], env={"PATH": "/usr/bin:/bin"}, cwd=str(tmp_path))
    try:
        async with relay.channel() as channel:
            stub = pb_grpc.RelayServiceStub(channel)
            agent = await spawn(stub, relay.metadata, spec)
            acp = AcpOverAttach(stub, relay.metadata, agent.agent_id)
            await acp.open()
            await acp.until(lambda: acp.exit is not None)
            assert acp.exit is not None and acp.exit.exit_code == 3
            assert acp.frames == {1: b"started\n"}
            await acp.close()
        await eventually(lambda: processes_mentioning(f"sleep {marker}") == [])  # its group was ended
    finally:
        for pid in processes_mentioning(f"sleep {marker}"):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

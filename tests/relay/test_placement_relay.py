"""A profile's ``placement = "relay"`` (docs/relay.md#placement): a real daemon starts a real
``rcoder relay`` for the project, and the scripted fake agent runs under it, its ACP over Attach.

Every relay a test's daemon leaves running (its SIGKILL) is ended by the test, its whole process
group, on every path (``relays_ended``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path

import grpc
import pytest

from rcoder.agent.processes.relayed import RelayedChild, RelayedStart
from rcoder.relay.host import _LIST_FOUND, RELAY_ENV, STOP_TIMEOUT, HostRelays
from rcoder.relay.relay_key import relay_secret
from rcoder.relay.v1 import relay_pb2 as relay_pb
from rcoder.relay.v1 import relay_pb2_grpc as relay_grpc
from rcoder.v1 import agent_runner_pb2 as pb
from tests.conftest import DaemonFactory
from tests.harness import FAKE_AGENT_READS, FakeAgentSetup, completed, eventually, started, text_of
from tests.relay.conftest import RelayFactory


def argv_of(pid: int) -> list[bytes]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")


def relay_pid(data_dir: Path, project: str = "proj") -> int | None:
    """The pid the project's relay wrote in its lock (None when the file has none)."""
    with contextlib.suppress(OSError, ValueError):
        pid = json.loads((data_dir / "relays" / project / "daemon.lock").read_text()).get("pid")
        return pid if isinstance(pid, int) else None
    return None


def parent_of(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("PPid:")).split()[1])


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def profiles(fake: FakeAgentSetup) -> dict[str, dict[str, object]]:
    return {"fake": fake.profile(), "relayed": fake.profile(placement="relay")}


def shape(events: list[pb.ChatStream]) -> list[str]:
    """What a client sees of a turn, without ids and times: the kinds of its events in order, a run
    of text chunks as one (how many chunks one event joins depends on when they arrived, whatever
    the placement)."""
    kinds: list[str] = []
    for event in events:
        kind = str(event.WhichOneof("event"))
        if not (kinds and kind == kinds[-1] == "agent_message"):
            kinds.append(kind)
    return kinds


async def test_a_relayed_turn_ends_as_a_local_one_and_the_next_resumes_live(
    make_daemon: DaemonFactory, fake: FakeAgentSetup, tmp_path: Path, relays_ended: list[int]
) -> None:
    daemon, client = await make_daemon(profiles(fake))
    local = await client.chat(prompt="remember 42 stream 3", agent="fake", project_id="local")
    relayed = await client.chat(prompt="remember 42 stream 3", agent="relayed")
    pid = relay_pid(tmp_path / "data")
    assert pid is not None
    relays_ended.append(pid)

    assert completed(relayed).stop_reason == pb.STOP_REASON_END_TURN
    assert shape(relayed) == shape(local)
    assert text_of(relayed) == text_of(local) == "c0 c1 c2 I remember: 42"
    second = await client.chat(prompt="what number?", session_id=relayed[0].session_id)
    assert started(second).resume == pb.RESUME_OUTCOME_LIVE
    assert text_of(second) == "I remember: 42"

    spawned = daemon.logs("agent_spawned")
    relayed_spawn = next(row for row in spawned if row.get("placement") == "relay")
    agent = relayed_spawn["pid"]
    assert relayed_spawn["relay_pid"] == pid
    assert parent_of(agent) == pid, "the relayed agent is the relay's child, not the daemon's"
    assert agent in fake.pids()
    assert relayed_spawn["state_dir"] == str(tmp_path / "data" / "relays" / "proj")
    argv = argv_of(pid)  # its log kept within a bound, by the relay itself
    assert argv[argv.index(b"--log-file") + 1] == str(tmp_path / "data" / "relays" / "proj" / "relay.log").encode()
    assert int(argv[argv.index(b"--log-max-bytes") + 1]) == 16 << 20
    listed = {a.name: a for a in (await client.stub.ListAgents(pb.ListAgentsRequest())).agents}
    assert (listed["relayed"].placement, listed["relayed"].relay_root) == ("relay", str(tmp_path / "data" / "relays"))
    assert (listed["fake"].placement, listed["fake"].relay_root) == ("local", "")

    # the daemon's stop closes the agent through the relay, then stops the relay
    await daemon.stop()
    await eventually(lambda: not alive(agent) and not alive(pid))


async def test_a_relayed_agents_crash_is_told_as_a_local_agents(
    make_daemon: DaemonFactory, fake: FakeAgentSetup, tmp_path: Path, relays_ended: list[int]
) -> None:
    _, client = await make_daemon(profiles(fake))
    local = completed(await client.chat(prompt="crash", agent="fake", project_id="local"))
    relayed = completed(await client.chat(prompt="crash", agent="relayed"))
    pid = relay_pid(tmp_path / "data")
    assert pid is not None
    relays_ended.append(pid)

    assert relayed.stop_reason == local.stop_reason == pb.STOP_REASON_ERROR
    assert relayed.error_reason == local.error_reason
    # its exit code and the end of its stderr, from the relay's exit message
    assert "fake agent crashing" in relayed.error and "fake agent crashing" in local.error
    assert relayed.error.replace("relayed", "fake") == local.error, (relayed.error, local.error)


def environ_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(entry.decode().partition("=")[::2] for entry in raw.split(b"\0") if entry)


async def test_a_relay_starts_with_the_daemons_path_and_locale_and_never_its_model_key(
    make_daemon: DaemonFactory, fake: FakeAgentSetup, tmp_path: Path, relays_ended: list[int]
) -> None:
    env = {"ANTHROPIC_API_KEY": "sk-ant-daemons-own", "RCODER_TEST_SECRET": "s3cret", "LC_MESSAGES": "C"}
    _, client = await make_daemon(profiles(fake), env=env)
    assert completed(await client.chat(prompt="remember 5", agent="relayed")).stop_reason == pb.STOP_REASON_END_TURN
    pid = relay_pid(tmp_path / "data")
    assert pid is not None
    relays_ended.append(pid)

    environ = environ_of(pid)
    assert "ANTHROPIC_API_KEY" not in environ and "RCODER_TEST_SECRET" not in environ, sorted(environ)
    assert "RCODER_LOG_FORMAT" not in environ, "the relay is given its own log format"
    assert environ["LC_MESSAGES"] == "C" and environ["PATH"] == os.environ["PATH"]
    assert set(environ) <= RELAY_ENV | {"LC_MESSAGES"}, sorted(environ)


async def test_a_relay_on_tcp_has_a_derived_secret_and_no_agent_reads_its_key_or_the_hosts_key(
    make_daemon: DaemonFactory, fake: FakeAgentSetup, tmp_path: Path, relays_ended: list[int]
) -> None:
    # [relays] listen_host: the relay serves TCP with a certificate the daemon made, its secret
    # derived from its id and the hosts' key (docs/relay.md#security); the key file is hidden from
    # agents even inside a folder their profile grants whole, as the relay's TLS key is
    keys = tmp_path / "keys"
    keys.mkdir()
    key_file = keys / "relay.key"
    key_file.write_bytes(os.urandom(32))
    key_file.chmod(0o600)
    granted = fake.profile(placement="relay", read_paths=[*FAKE_AGENT_READS, str(keys)])
    _, client = await make_daemon({"fake": granted}, relays_listen_host="127.0.0.1", relays_key_file=str(key_file))
    folder = tmp_path / "data" / "relays" / "proj"
    prompt = f"remember 5\nshell cat {key_file} > /dev/null\n"
    events = await client.chat(prompt=prompt)
    pid = relay_pid(tmp_path / "data")
    assert pid is not None
    relays_ended.append(pid)
    assert completed(events).stop_reason == pb.STOP_REASON_END_TURN
    assert "shell=exit 1" in text_of(events), "the agent read the hosts' key"
    again = await client.chat(prompt=f"shell cat {folder / 'tls.key'} > /dev/null", session_id=events[0].session_id)
    assert "shell=exit 1" in text_of(again), "the agent read the relay's TLS key"

    relay_id = (folder / "relay_id").read_text().strip()
    assert (folder / "secret").read_text().strip() == relay_secret(key_file.read_bytes(), relay_id)
    for name in ("secret", "relay_id", "tls.key", "tls.crt"):
        assert (folder / name).stat().st_mode & 0o777 == 0o600, name
    address = (folder / "address").read_text().strip()
    credentials = grpc.ssl_channel_credentials(root_certificates=(folder / "tls.crt").read_bytes())

    def bearer(key: bytes) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {relay_secret(key, relay_id)}"),)

    async with grpc.aio.secure_channel(address, credentials) as channel:
        stub = relay_grpc.RelayServiceStub(channel)
        listed = await stub.ListAgents(relay_pb.ListAgentsRequest(), metadata=bearer(key_file.read_bytes()), timeout=10)
        assert len(listed.agents) == 1
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.ListAgents(relay_pb.ListAgentsRequest(), metadata=bearer(b"x" * 32), timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_a_relay_found_alive_in_the_projects_folder_is_used_as_it_is(
    make_daemon: DaemonFactory, make_relay: RelayFactory, fake: FakeAgentSetup, tmp_path: Path
) -> None:
    daemon, client = await make_daemon(profiles(fake))
    relay = await make_relay(state_dir=tmp_path / "data" / "relays" / "proj")  # after the daemon's start

    events = await client.chat(prompt="remember 5", agent="relayed")
    assert completed(events).stop_reason == pb.STOP_REASON_END_TURN
    assert [row["pid"] for row in daemon.logs("relay_reused")] == [relay.pid]
    assert not daemon.logs("relay_started")
    agent = next(row["pid"] for row in daemon.logs("agent_spawned") if row.get("placement") == "relay")
    assert parent_of(agent) == relay.pid


async def test_a_relay_killed_mid_turn_ends_the_turn_as_a_crash_and_the_next_turn_resumes_on_a_new_one(
    make_daemon: DaemonFactory, fake: FakeAgentSetup, tmp_path: Path, relays_ended: list[int]
) -> None:
    daemon, client = await make_daemon(profiles(fake))
    opened = await client.chat(prompt="remember 9", agent="relayed")
    pid = relay_pid(tmp_path / "data")
    assert pid is not None
    relays_ended.append(pid)
    turn = asyncio.create_task(client.chat(prompt="stream 400 pace 25", session_id=opened[0].session_id))
    await eventually(lambda: len(fake.requests("session/prompt")) == 2)
    os.killpg(pid, signal.SIGKILL)  # the relay leads its own group; its agent dies with it (death signal)

    async with asyncio.timeout(8):  # well before REATTACH_FOR: the relay's death is seen, not waited out
        events = await turn
    assert completed(events).stop_reason == pb.STOP_REASON_ERROR
    assert completed(events).error_reason == "AGENT_CRASHED"
    assert daemon.logs("relayed_agent_lost")
    again = await client.chat(prompt="what number?", session_id=opened[0].session_id)
    assert completed(again).stop_reason == pb.STOP_REASON_END_TURN
    assert started(again).resume == pb.RESUME_OUTCOME_RESUMED
    assert text_of(again) == "I remember: 9"
    new_relay = relay_pid(tmp_path / "data")
    assert new_relay is not None and new_relay != pid
    relays_ended.append(new_relay)


async def test_a_killed_daemon_leaves_its_relay_and_agent_running_and_the_next_daemon_stops_them(
    make_daemon: DaemonFactory, fake: FakeAgentSetup, tmp_path: Path, relays_ended: list[int]
) -> None:
    daemon, client = await make_daemon(profiles(fake))
    first = await client.chat(prompt="remember 7", agent="relayed")
    pid = relay_pid(tmp_path / "data")
    assert pid is not None
    relays_ended.append(pid)
    agent = next(row["pid"] for row in daemon.logs("agent_spawned") if row.get("placement") == "relay")

    await daemon.kill()  # SIGKILL to the daemon's group: the relay leads a session of its own
    assert alive(pid) and alive(agent), "the relay and its agent outlive the daemon"
    assert parent_of(agent) == pid

    # the next daemon on the same data_dir stops what it finds before it serves: no agent is left
    # that no session holds (re-attaching it is the session owner's, not built yet)
    second, client = await make_daemon(profiles(fake))
    found = second.logs("relay_found_stopped")
    assert [row["pid"] for row in found] == [pid]
    await eventually(lambda: not alive(agent) and not alive(pid))
    again = await client.chat(prompt="what number?", session_id=first[0].session_id)
    assert completed(again).stop_reason == pb.STOP_REASON_END_TURN
    assert started(again).resume == pb.RESUME_OUTCOME_RESUMED
    assert text_of(again) == "I remember: 7"
    new_relay = relay_pid(tmp_path / "data")
    assert new_relay is not None and new_relay != pid
    relays_ended.append(new_relay)


async def test_a_relay_found_at_the_start_that_never_answers_holds_the_start_no_longer_than_its_look_and_is_stopped(
    make_daemon: DaemonFactory, fake: FakeAgentSetup, tmp_path: Path, relays_ended: list[int]
) -> None:
    # a relay left by a killed daemon, stopped (SIGSTOP): it holds its lock, and its socket takes
    # connections, but it answers nothing. The next start gives its look _LIST_FOUND (it waited 30 s
    # for the connect, then 30 more for the list), then stops it, as it stops any relay it could not
    # list: continued so that it acts on its SIGTERM, and ending its agent
    daemon, client = await make_daemon(profiles(fake))
    await client.chat(prompt="remember 7", agent="relayed")
    pid = relay_pid(tmp_path / "data")
    assert pid is not None
    relays_ended.append(pid)  # SIGKILLed after the test whatever happens: stopped or not
    agent = next(row["pid"] for row in daemon.logs("agent_spawned") if row.get("placement") == "relay")
    await daemon.kill()
    os.kill(pid, signal.SIGSTOP)

    began = time.monotonic()
    second, client = await make_daemon(profiles(fake))
    took = time.monotonic() - began
    folder = str(tmp_path / "data" / "relays" / "proj")
    (unlisted,) = second.logs("relayed_agents_not_listed")
    assert (unlisted["state_dir"], unlisted["pid"]) == (folder, pid), unlisted
    assert unlisted["error"] == f"no answer within {_LIST_FOUND:g} s", unlisted
    (stopped,) = second.logs("relay_found_stopped")
    assert (stopped["pid"], stopped["why"]) == (
        pid,
        f"a relay a daemon left, that did not list its agents within {_LIST_FOUND:g} s",
    )
    assert [row["pid"] for row in second.logs("relay_stopped")] == [pid]  # on its SIGTERM, never SIGKILLed
    assert not second.logs("relay_not_stopped")
    assert not alive(pid) and not alive(agent)
    # the look and the stop, and the start around them (a second or two, more on a loaded machine),
    # well inside the stop's own bound: the 30 s connect alone would have taken longer
    assert took < _LIST_FOUND + STOP_TIMEOUT, took
    again = await client.chat(prompt="what number?", agent="relayed")
    assert completed(again).stop_reason == pb.STOP_REASON_END_TURN
    new_relay = relay_pid(tmp_path / "data")
    assert new_relay is not None and new_relay != pid
    relays_ended.append(new_relay)


async def test_a_dropped_attach_is_attached_again_and_the_turn_loses_and_repeats_nothing(
    make_daemon: DaemonFactory, fake: FakeAgentSetup, tmp_path: Path, relays_ended: list[int]
) -> None:
    daemon, client = await make_daemon(profiles(fake))
    opened = await client.chat(prompt="hello", agent="relayed")
    pid = relay_pid(tmp_path / "data")
    assert pid is not None
    relays_ended.append(pid)
    spawned = next(row for row in daemon.logs("agent_spawned") if row.get("placement") == "relay")
    agent_id, generation = spawned["agent_id"], spawned["generation"]  # the session's lease's
    folder = tmp_path / "data" / "relays" / "proj"
    secret = (folder / "secret").read_text().strip()

    turn = asyncio.create_task(
        client.chat(prompt="stream 40 pace 25", session_id=opened[0].session_id, agent="relayed")
    )
    # Another stream of the same generation takes the agent from the daemon's mid-turn (the relay
    # ends the daemon's stream ABORTED), reads a few frames without acknowledging them, and drops.
    async with grpc.aio.insecure_channel(f"unix:{folder / 'relay.sock'}") as channel:
        stub = relay_grpc.RelayServiceStub(channel)
        metadata = (("authorization", f"Bearer {secret}"),)
        # the turn's prompt reached the agent: it streams for a second from now
        await eventually(lambda: len(fake.requests("session/prompt")) == 2)
        status = await stub.Status(relay_pb.StatusRequest(agent_id=agent_id), metadata=metadata)
        before = status.agent.last_seq
        assert not turn.done()
        call = stub.Attach(metadata=metadata)
        await call.write(relay_pb.AttachRequest(open=relay_pb.AttachOpen(agent_id=agent_id, generation=generation,
                                                                          from_seq=before + 1)))  # fmt: skip
        ready = await call.read()
        assert ready.WhichOneof("message") == "ready"
        taken = 0
        with contextlib.suppress(grpc.aio.AioRpcError):  # ABORTED: the daemon took the agent back already
            while taken < 3 and (message := await call.read()) is not grpc.aio.EOF:
                taken += message.WhichOneof("message") == "frame"
        call.cancel()
    events = await turn

    assert completed(events).stop_reason == pb.STOP_REASON_END_TURN
    assert text_of(events) == "".join(f"c{i} " for i in range(40)) + "I remember nothing."
    assert daemon.logs("relayed_agent_reattaching"), "the daemon's stream was taken and attached again"
    assert not daemon.logs("relayed_agent_lost")


def fake_start(fake: FakeAgentSetup, tmp_path: Path) -> RelayedStart:
    """The fake agent, unconfined, to spawn on the relay of project ``p`` under ``tmp_path``."""
    project = tmp_path / "workspace" / "p"
    project.mkdir(parents=True)
    args = fake.profile()["args"]
    assert isinstance(args, list)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(fake.folder)}
    return RelayedStart(name="fake", project="p", session_id="s", argv=(sys.executable, *args), env=env,
                        cwd=str(project), confinement=None, limits=None, user=None)  # fmt: skip


async def answer_of(child: RelayedChild) -> dict[str, object]:
    """The next line the agent wrote on stdout (the reader holds at most one read: read() it, as
    the transport does)."""
    output = b""
    async with asyncio.timeout(20):
        while b"\n" not in output:
            output += await child.stdout.read(1 << 16)
    answer = json.loads(output)
    assert isinstance(answer, dict)
    return answer


async def test_stdin_written_while_another_stream_holds_the_agent_reaches_it_once(
    fake: FakeAgentSetup, tmp_path: Path, relays_ended: list[int]
) -> None:
    """The daemon's side alone (``HostRelays``, ``AttachedAgent``) on a real relay: a stdin frame
    written while its stream is taken is sent again after the re-attach, and arrives once."""
    relays = HostRelays(tmp_path / "relays", stop_grace=1.0)
    try:
        child = await relays.spawn(fake_start(fake, tmp_path), 1.0)
        relays_ended.append(child.place.relay_pid)
        secret = (tmp_path / "relays" / "p" / "secret").read_text().strip()
        async with grpc.aio.insecure_channel(child.place.socket) as channel:
            stub = relay_grpc.RelayServiceStub(channel)
            call = stub.Attach(metadata=(("authorization", f"Bearer {secret}"),))
            opening = relay_pb.AttachOpen(agent_id=child.place.agent_id, generation=1, from_seq=1)
            await call.write(relay_pb.AttachRequest(open=opening))
            assert (await call.read()).WhichOneof("message") == "ready"  # the child's stream was ended
            request = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {"protocolVersion": 1}}
            child.stdin.write(json.dumps(request).encode() + b"\n")
            await child.stdin.drain()
            call.cancel()
        answer = await answer_of(child)
        assert answer["id"] == 1 and "result" in answer
        assert len(fake.requests("initialize")) == 1
        child.stdin.close()  # the end of stdin through the stream: the fake agent exits 0
        async with asyncio.timeout(20):
            await child.exited
            assert await child.stdout.read() == b""  # its end, after the exit
        assert child.returncode == 0
    finally:
        await relays.aclose()


async def test_a_long_stdin_write_waits_for_a_stopped_relay_and_is_sent_again_after_a_drop_once(
    fake: FakeAgentSetup, tmp_path: Path, relays_ended: list[int]
) -> None:
    """The daemon's stdin of a relayed agent has no pipe (docs/relay.md#placement), and does what
    one did: a write is numbered into frames of at most 1 MiB with no gap; a writer's drain waits
    while the relay does not take them (here it is stopped: a daemon's memory is not the relay's
    buffer), and what it wrote goes even when it gives up waiting; a request written while
    another stream holds the agent is sent again after the re-attach; each reaches the agent once."""
    relays = HostRelays(tmp_path / "relays", stop_grace=1.0)
    try:
        child = await relays.spawn(fake_start(fake, tmp_path), 1.0)
        relays_ended.append(child.place.relay_pid)

        def request(id_: int, pad: int) -> bytes:
            params = {"protocolVersion": 1, "pad": "x" * pad}  # the fake agent reads past what it knows
            return json.dumps({"jsonrpc": "2.0", "id": id_, "method": "initialize", "params": params}).encode() + b"\n"

        secret = (tmp_path / "relays" / "p" / "secret").read_text().strip()
        metadata = (("authorization", f"Bearer {secret}"),)
        async with grpc.aio.insecure_channel(child.place.socket) as channel:
            stub = relay_grpc.RelayServiceStub(channel)
            status = relay_pb.StatusRequest(agent_id=child.place.agent_id)

            # the child's stream open: the write below is under way on it when its writer gives up
            async def attached() -> bool:
                return bool((await stub.Status(status, metadata=metadata)).agent.attached)

            await eventually(attached)
        os.kill(child.place.relay_pid, signal.SIGSTOP)
        try:
            child.stdin.write(request(1, (4 << 20) + 10))  # 5 frames: past what the stream's windows hold
            draining = asyncio.create_task(child.stdin.drain())
            done, _ = await asyncio.wait({draining}, timeout=1.0)
            assert not done, "the writer waits for the relay to take what it wrote"
            draining.cancel()  # a writer given up on (its caller's timeout): what it wrote still goes
        finally:
            os.kill(child.place.relay_pid, signal.SIGCONT)
        assert (await answer_of(child))["id"] == 1

        async with grpc.aio.insecure_channel(child.place.socket) as channel:
            stub = relay_grpc.RelayServiceStub(channel)
            call = stub.Attach(metadata=metadata)
            opening = relay_pb.AttachOpen(agent_id=child.place.agent_id, generation=1, from_seq=1)
            await call.write(relay_pb.AttachRequest(open=opening))
            assert (await call.read()).WhichOneof("message") == "ready"  # the child's stream was ended
            child.stdin.write(request(2, 300 << 10))  # past a pipe's 64 KiB, one frame
            await asyncio.wait_for(child.stdin.drain(), 20)
            call.cancel()
            assert (await answer_of(child))["id"] == 2
            status = await stub.Status(relay_pb.StatusRequest(agent_id=child.place.agent_id), metadata=metadata)
        assert status.agent.stdin_seq == 6, "one frame a MiB of a write, numbered from 1, no gap"
        assert [r["id"] for r in fake.requests("initialize")] == [1, 2]
        child.stdin.close()
        async with asyncio.timeout(20):
            await child.exited
        assert child.returncode == 0
    finally:
        await relays.aclose()


async def test_a_relay_whose_socket_path_is_past_what_a_socket_address_holds_is_reached(
    make_daemon: DaemonFactory, fake: FakeAgentSetup, tmp_path: Path, relays_ended: list[int]
) -> None:
    """A deep data_dir makes the relay's socket path longer than the kernel's 108 bytes (a fresh
    clone's pytest folders did it to the container placement): the relay binds, and the daemon
    connects, through a descriptor of the folder, and the turn ends as any other."""
    data_dir = tmp_path / ("d" * 60) / ("e" * 40)
    socket = data_dir / "relays" / "proj" / "relay.sock"
    assert len(os.fsencode(str(socket))) > 107
    _daemon, client = await make_daemon(profiles(fake), data_dir=str(data_dir))
    events = await client.chat(prompt="remember 5", agent="relayed", timeout=40)
    pid = relay_pid(data_dir)
    assert pid is not None
    relays_ended.append(pid)
    assert completed(events).stop_reason == pb.STOP_REASON_END_TURN, completed(events).error
    assert text_of(events) == "I remember: 5"
    assert socket.is_socket(), "the socket is in the relay's folder, whatever the path's length"

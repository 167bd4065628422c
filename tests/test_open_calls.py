"""What callers without a token can make the daemon hold (rcoder.api.open_calls, rcoder.api.health):
health's Check and Watch and reflection, flooded with the largest requests and with many streams, as
the security probe did (40 Watch streams naming an 18 MiB service took the daemon from 148 to
3,305 MiB, and it stayed there; 20,000 small Watch streams +300 MB).

Health reads no request of a caller without a token, so its floods cost only grpc's windows;
reflection reads one request at a time, whose copies are its floor. The daemon's memory is read
from outside, as an operator would (tests/test_gate.py's helpers)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2

from rcoder.api.open_calls import OPEN_CALLS, OPEN_REQUEST_BYTES, OPEN_WATCHES
from rcoder.config import load_settings
from rcoder.v1 import agent_runner_pb2 as pb
from tests.conftest import DaemonFactory
from tests.harness import Daemon, eventually, toml_value
from tests.test_gate import memory_mib, reset_peak

MIB = 1 << 20
TOKEN = "tok-open-calls"
LARGEST = 18 * MIB  # under max_request_bytes' 19 MiB: grpc itself would refuse a larger one unread
CHECK, WATCH = "/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch"
REFLECT = f"/{reflection.SERVICE_NAME}/ServerReflectionInfo"
# reflection: one message being read at a time, ~4 times its size in grpc's buffers and copies
# (66-87 MiB measured): what the flood may cost at its peak, whatever the number of streams (the
# old daemon grew by 370 MiB for 10 Checks, by gigabytes for 40 Watch streams)
PEAK_MIB = 6 * LARGEST / MIB
# health without a token: nothing read, each stream at most grpc's 64 KiB window (a few MiB
# measured for 24 requests of 18 MiB at once; reading them cost 65-87 MiB, one at a time)
HEALTH_PEAK_MIB = 8.0
# and what may stay once it is over: glibc and grpc keep some of what they freed (10-32 MiB seen),
# the same after a second flood (the old daemon kept ~80 MiB a request)
SETTLED_MIB = 40.0
SERVING = health_pb2.HealthCheckResponse.SERVING
WAVE = 12  # requests of 18 MiB at once, per method (the old daemon: ~80 MiB each, kept)
STREAMS = 1000  # the probe used 20,000: the same path, in a time a test can afford


def bare_channel(daemon: Daemon) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(daemon.address)


async def settled(pid: int, idle: float) -> None:
    """The RSS back within ``SETTLED_MIB`` of ``idle`` (bounded wait), or the test fails saying where it stayed."""
    try:
        await eventually(lambda: memory_mib(pid, "VmRSS") - idle < SETTLED_MIB, timeout=30)
    except TimeoutError:
        raise AssertionError(f"the daemon stayed {memory_mib(pid, 'VmRSS') - idle:.0f} MiB above idle") from None


async def unauthenticated(address: str, method: str, payload: bytes, timeout: float = 60) -> str:
    """One call of ``method`` whose request is ``payload`` (its own channel); its status's name,
    or a health answer's status ("SERVING"; a Watch's first)."""
    options = [("grpc.max_send_message_length", len(payload) + MIB)]
    async with grpc.aio.insecure_channel(address, options=options) as channel:
        try:
            if method == CHECK:
                answer = await channel.unary_unary(method)(payload, timeout=timeout)
                return str(
                    health_pb2.HealthCheckResponse.ServingStatus.Name(
                        health_pb2.HealthCheckResponse.FromString(answer).status
                    )
                )
            async for raw in channel.unary_stream(method)(payload, timeout=timeout):
                if method == WATCH:
                    return str(
                        health_pb2.HealthCheckResponse.ServingStatus.Name(
                            health_pb2.HealthCheckResponse.FromString(raw).status
                        )
                    )
                return "ANSWERED"  # reflection answered a request over the bound: it did not hold
        except grpc.aio.AioRpcError as exc:
            return str(exc.code().name)
    return "OK"


async def test_a_flood_of_the_largest_reflection_requests_costs_one_read_at_a_time(
    make_daemon: DaemonFactory,
) -> None:
    daemon, client = await make_daemon(auth_token=TOKEN)
    health = health_pb2_grpc.HealthStub(client.channel)
    assert (await health.Check(health_pb2.HealthCheckRequest(), timeout=10)).status == SERVING
    idle = memory_mib(daemon.pid, "VmRSS")
    reset_peak(daemon.pid)

    symbol = reflection_pb2.ServerReflectionRequest(file_containing_symbol="x" * LARGEST).SerializeToString()
    for flood in range(2):  # twice: what stays after one is not added to by the next
        # a wave: the client's own memory holds each request it sends (WAVE x 18 MiB), the daemon's one at a time
        wave = [asyncio.create_task(unauthenticated(daemon.address, REFLECT, symbol)) for _ in range(WAVE)]
        assert (await client.stub.ListAgents(pb.ListAgentsRequest(), timeout=60)).agents  # another answers
        codes = await asyncio.gather(*wave)

        assert set(codes) == {"RESOURCE_EXHAUSTED"}, codes
        grown = memory_mib(daemon.pid, "VmHWM") - idle
        print(f"flood {flood}: idle {idle:.0f} MiB, peak +{grown:.0f} MiB")
        assert grown < PEAK_MIB, f"the daemon grew {grown:.0f} MiB refusing {len(codes)} requests of 18 MiB"
        await settled(daemon.pid, idle)
    assert (await health.Check(health_pb2.HealthCheckRequest(), timeout=10)).status == SERVING


async def test_reflections_floor_follows_max_request_bytes(make_daemon: DaemonFactory) -> None:
    """The one reflection message read is at most ``max_request_bytes``: a daemon that lowers it to
    1 MiB holds a few MiB for a flood (grpc refuses a larger message from its 5-byte prefix)."""
    daemon, client = await make_daemon(auth_token=TOKEN, max_request_bytes=MIB)
    idle = memory_mib(daemon.pid, "VmRSS")
    reset_peak(daemon.pid)

    for size in (LARGEST, MIB - 64):  # over the limit: refused by grpc; under it: read, one at a time
        symbol = reflection_pb2.ServerReflectionRequest(file_containing_symbol="x" * size).SerializeToString()
        wave = [asyncio.create_task(unauthenticated(daemon.address, REFLECT, symbol)) for _ in range(WAVE)]
        assert set(await asyncio.gather(*wave)) == {"RESOURCE_EXHAUSTED"}

    grown = memory_mib(daemon.pid, "VmHWM") - idle
    print(f"idle {idle:.0f} MiB, peak +{grown:.0f} MiB")
    # the message read (1 MiB) in three copies, and the windows of the streams (5-6 MiB measured)
    assert grown < 10, f"the daemon grew {grown:.0f} MiB with max_request_bytes at 1 MiB"
    assert (await client.stub.ListAgents(pb.ListAgentsRequest(), timeout=60)).agents


async def test_a_flood_of_the_largest_health_requests_without_a_token_reads_none_of_them(
    make_daemon: DaemonFactory,
) -> None:
    daemon, client = await make_daemon(auth_token=TOKEN)
    health = health_pb2_grpc.HealthStub(client.channel)
    assert (await health.Check(health_pb2.HealthCheckRequest(), timeout=10)).status == SERVING
    idle = memory_mib(daemon.pid, "VmRSS")
    reset_peak(daemon.pid)

    name = health_pb2.HealthCheckRequest(service="x" * LARGEST).SerializeToString()
    for flood in range(2):
        # a Watch's client cannot read its answer while its own request waits on the window the
        # daemon never opens (its send comes first): it ends at its deadline, its stream unread
        wave = [asyncio.create_task(unauthenticated(daemon.address, WATCH, name, timeout=3)) for _ in range(WAVE)]
        wave += [asyncio.create_task(unauthenticated(daemon.address, CHECK, name)) for _ in range(WAVE)]
        assert (await client.stub.ListAgents(pb.ListAgentsRequest(), timeout=60)).agents  # another answers
        codes = await asyncio.gather(*wave)

        grown = memory_mib(daemon.pid, "VmHWM") - idle
        print(f"flood {flood}: idle {idle:.0f} MiB, peak +{grown:.0f} MiB")
        assert grown < HEALTH_PEAK_MIB, f"the daemon grew {grown:.0f} MiB for {len(codes)} health requests of 18 MiB"
        # a Check is answered about the daemon, its name unread (a probe's answer, whatever it sent)
        assert codes[WAVE:] == ["SERVING"] * WAVE, codes
        assert set(codes[:WAVE]) <= {"SERVING", "DEADLINE_EXCEEDED"}, codes
    await settled(daemon.pid, idle)


async def test_with_open_reflection_false_no_stranger_makes_the_daemon_read_a_message(
    make_daemon: DaemonFactory,
) -> None:
    daemon, client = await make_daemon(auth_token=TOKEN, open_reflection=False)
    idle = memory_mib(daemon.pid, "VmRSS")
    reset_peak(daemon.pid)

    name = health_pb2.HealthCheckRequest(service="x" * LARGEST).SerializeToString()
    symbol = reflection_pb2.ServerReflectionRequest(file_containing_symbol="x" * LARGEST).SerializeToString()
    wave = [asyncio.create_task(unauthenticated(daemon.address, REFLECT, symbol)) for _ in range(WAVE)]
    wave += [asyncio.create_task(unauthenticated(daemon.address, CHECK, name)) for _ in range(WAVE)]
    wave += [asyncio.create_task(unauthenticated(daemon.address, WATCH, name, timeout=3)) for _ in range(WAVE)]
    codes = await asyncio.gather(*wave)

    grown = memory_mib(daemon.pid, "VmHWM") - idle
    print(f"idle {idle:.0f} MiB, peak +{grown:.0f} MiB")
    assert grown < HEALTH_PEAK_MIB, f"the daemon grew {grown:.0f} MiB for {len(codes)} requests of 18 MiB"
    assert codes[:WAVE] == ["UNAUTHENTICATED"] * WAVE and codes[WAVE : 2 * WAVE] == ["SERVING"] * WAVE, codes
    # reflection asks the token as every RPC but health, saying how to send it; with it, it answers
    small = reflection_pb2.ServerReflectionRequest(list_services="")
    async with grpc.aio.insecure_channel(daemon.address) as bare:
        info = bare.unary_stream(
            REFLECT,
            request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
            response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
        )
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await info(small, timeout=10).read()
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "authorization: Bearer" in (caught.value.details() or "")
        answer = await info(small, metadata=(("authorization", f"Bearer {TOKEN}"),), timeout=10).read()
        assert {s.name for s in answer.list_services_response.service} >= {"rcoder.v1.AgentRunner"}
    assert (await client.stub.ListAgents(pb.ListAgentsRequest(), timeout=60)).agents


async def test_health_reads_the_service_name_of_a_token_holder_only(make_daemon: DaemonFactory) -> None:
    daemon, client = await make_daemon(auth_token=TOKEN)
    holder = health_pb2_grpc.HealthStub(client.channel)
    async with grpc.aio.insecure_channel(daemon.address) as bare:
        stranger = health_pb2_grpc.HealthStub(bare)
        wrong = (("authorization", "Bearer nope"),)
        for name in ("", "rcoder.v1.AgentRunner", "nope", "x" * (4 * OPEN_REQUEST_BYTES)):
            request = health_pb2.HealthCheckRequest(service=name)
            assert (await stranger.Check(request, timeout=10)).status == SERVING, name[:10]
            assert (await stranger.Check(request, metadata=wrong, timeout=10)).status == SERVING, "open to all"
            if name in ("", "rcoder.v1.AgentRunner"):
                assert (await holder.Check(request, timeout=10)).status == SERVING
                continue
            # the holder's request is read, whatever its size: the protocol's answer for a name not served
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await holder.Check(request, timeout=10)
            assert caught.value.code() == grpc.StatusCode.NOT_FOUND, caught.value
            watch = holder.Watch(request, timeout=10)
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
            watch.cancel()


async def test_a_daemon_that_asks_no_token_reads_every_health_request_one_at_a_time(
    make_daemon: DaemonFactory,
) -> None:
    daemon, _ = await make_daemon(channel=bare_channel, open_to_agents=True)
    async with grpc.aio.insecure_channel(daemon.address) as bare:
        health = health_pb2_grpc.HealthStub(bare)
        assert (await health.Check(health_pb2.HealthCheckRequest(service="rcoder.v1.AgentRunner"))).status == SERVING
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await health.Check(health_pb2.HealthCheckRequest(service="nope"), timeout=10)
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND  # read: every caller is trusted here
        with pytest.raises(grpc.aio.AioRpcError) as caught:  # and bounded as a stranger's read
            await health.Check(health_pb2.HealthCheckRequest(service="x" * OPEN_REQUEST_BYTES), timeout=10)
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


async def test_probes_are_answered_while_strangers_hold_every_reflection_stream(make_daemon: DaemonFactory) -> None:
    """Reflection streams without a token that send nothing hold every slot for such streams and
    the read turn (1 s each, in turn); a probe's Check and Watch, also without a token, are
    answered at once (before, they shared both and were refused: a liveness probe failed by a
    stranger)."""
    daemon, _ = await make_daemon(auth_token=TOKEN)
    extra = 8
    async with grpc.aio.insecure_channel(daemon.address) as bare:
        silent = [bare.stream_stream(REFLECT)() for _ in range(OPEN_CALLS + extra)]
        # the ones past the bound are refused at once, the others hold their slots a second or more
        ends = [asyncio.create_task(call.code()) for call in silent]
        refused = 0
        async with asyncio.timeout(10):
            for ended in asyncio.as_completed(ends):
                refused += await ended == grpc.StatusCode.RESOURCE_EXHAUSTED
                if refused == extra:
                    break
        probe = health_pb2_grpc.HealthStub(bare)
        for _ in range(5):
            assert (await probe.Check(health_pb2.HealthCheckRequest(), timeout=2)).status == SERVING
        watch = probe.Watch(health_pb2.HealthCheckRequest(), timeout=2)
        assert (await watch.read()).status == SERVING
        watch.cancel()
        for call in silent:
            call.cancel()
        await asyncio.gather(*ends, return_exceptions=True)


async def watch(stub: health_pb2_grpc.HealthStub, answered: asyncio.Event, ended: asyncio.Event) -> str:
    """A Watch held open until ``ended``: "SERVING" once answered, else the status it was refused with."""
    call = stub.Watch(health_pb2.HealthCheckRequest(service=pb.DESCRIPTOR.services_by_name["AgentRunner"].full_name))
    try:
        first = await call.read()
    except grpc.aio.AioRpcError as exc:
        return str(exc.code().name)
    answered.set()
    await ended.wait()
    call.cancel()
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(first.status))


async def test_thousands_of_watch_streams_hold_a_bounded_few_and_the_rest_are_refused_but_not_a_token_holder(
    make_daemon: DaemonFactory,
) -> None:
    daemon, client = await make_daemon(auth_token=TOKEN)
    channels = [grpc.aio.insecure_channel(daemon.address) for _ in range(10)]
    stubs = [health_pb2_grpc.HealthStub(channel) for channel in channels]
    await stubs[0].Check(health_pb2.HealthCheckRequest(), timeout=10)
    idle = memory_mib(daemon.pid, "VmRSS")
    reset_peak(daemon.pid)

    ended = asyncio.Event()
    events = [asyncio.Event() for _ in range(STREAMS)]
    streams = [asyncio.create_task(watch(stubs[n % len(stubs)], events[n], ended)) for n in range(STREAMS)]
    # every stream either answered (and held) or ended
    await eventually(lambda: sum(t.done() for t in streams) + sum(e.is_set() for e in events) >= len(streams), 90)
    held = sum(e.is_set() for e in events)
    grown = memory_mib(daemon.pid, "VmHWM") - idle
    # a token holder is not counted among them: answered while strangers hold every slot
    mine = health_pb2_grpc.HealthStub(client.channel).Watch(health_pb2.HealthCheckRequest(), timeout=10)
    assert (await mine.read()).status == SERVING
    mine.cancel()
    ended.set()
    codes = await asyncio.gather(*streams)
    for channel in channels:
        await channel.close()

    assert held == OPEN_WATCHES and codes.count("RESOURCE_EXHAUSTED") == STREAMS - OPEN_WATCHES, codes[:3]
    assert codes.count("SERVING") == OPEN_WATCHES
    print(f"idle {idle:.0f} MiB, peak +{grown:.0f} MiB")
    assert grown < 24, f"the daemon grew {grown:.0f} MiB for {STREAMS} Watch streams"
    await settled(daemon.pid, idle)
    # the bound is given back: a Watch is answered again
    again = [asyncio.Event(), asyncio.Event()]
    one = asyncio.create_task(watch(client_health := health_pb2_grpc.HealthStub(client.channel), *again))
    await asyncio.wait_for(again[0].wait(), 10)
    again[1].set()
    assert await one == "SERVING" and client_health is not None


@pytest.mark.fast
@pytest.mark.parametrize(
    ("listen", "setting", "open_"),
    [
        ("127.0.0.1:50051", None, True),  # the default, "loopback": a local user's grpcurl lists without -H
        ("[::1]:50051", None, True),
        ("localhost:50051", None, True),
        ("0.0.0.0:50051", None, False),  # reachable by anyone: reflection asks the token
        ("10.1.2.3:50051", None, False),
        ("[::]:50051", None, False),
        ("0.0.0.0:50051", True, True),  # said either way, it is
        ("127.0.0.1:50051", False, False),
        ("0.0.0.0:50051", "loopback", False),
    ],
)
def test_reflection_is_open_to_strangers_only_on_a_loopback_listen_unless_set(
    tmp_path: Path, listen: str, setting: bool | str | None, open_: bool
) -> None:
    text = f'listen = "{listen}"\n' + ("" if setting is None else f"open_reflection = {toml_value(setting)}\n")
    (tmp_path / "rcoder.toml").write_text(text)
    assert load_settings(tmp_path / "rcoder.toml", {}).reflection_open is open_

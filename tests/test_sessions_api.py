"""GetSession, ListSessions, ListAgents, Subscribe, health and reflection."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from rcoder.v1 import agent_runner_pb2 as pb
from tests.conftest import DaemonFactory
from tests.harness import FakeAgentSetup, error_info, started


async def test_health_says_serving_for_the_server_and_the_service(make_daemon: DaemonFactory) -> None:
    _, client = await make_daemon()
    health = health_pb2_grpc.HealthStub(client.channel)
    for service in ("", "rcoder.v1.AgentRunner"):
        answer = await health.Check(health_pb2.HealthCheckRequest(service=service))
        assert answer.status == health_pb2.HealthCheckResponse.SERVING


async def test_reflection_lists_the_agent_runner_service(make_daemon: DaemonFactory) -> None:
    _, client = await make_daemon()
    stub = reflection_pb2_grpc.ServerReflectionStub(client.channel)

    async def ask(**fields: str) -> reflection_pb2.ServerReflectionResponse:
        call = stub.ServerReflectionInfo()
        await call.write(reflection_pb2.ServerReflectionRequest(**fields))
        await call.done_writing()
        return await call.read()

    listed = await ask(list_services="")
    names = {s.name for s in listed.list_services_response.service}
    assert {"rcoder.v1.AgentRunner", "grpc.health.v1.Health"} <= names
    described = await ask(file_containing_symbol="rcoder.v1.ChatRequest")
    assert described.file_descriptor_response.file_descriptor_proto


async def test_get_session_reports_the_record_and_whether_its_agent_is_live(make_daemon: DaemonFactory) -> None:
    _, client = await make_daemon()
    events = await client.chat(project_id="alpha", prompt="remember 1")
    session = await client.stub.GetSession(pb.GetSessionRequest(session_id=events[0].session_id))

    assert session.project_id == "alpha"
    assert session.agent == "fake"
    assert session.provider_session_id == started(events).provider_session_id
    assert session.turns == 1
    assert session.last_run_id == events[0].run_id
    assert session.status == pb.SESSION_STATUS_LIVE
    assert session.cwd.endswith("/workspace/alpha")


async def test_get_session_of_an_unknown_id_is_not_found(make_daemon: DaemonFactory) -> None:
    _, client = await make_daemon()
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await client.stub.GetSession(pb.GetSessionRequest(session_id="nope"))
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    assert error_info(caught.value).reason == "SESSION_NOT_FOUND"


async def test_list_sessions_pages_and_filters_by_project(make_daemon: DaemonFactory) -> None:
    _, client = await make_daemon(idle_timeout=0)
    ids = {p: [] for p in ("alpha", "beta")}  # type: dict[str, list[str]]
    for project, count in (("alpha", 3), ("beta", 1)):
        for _ in range(count):
            ids[project].append((await client.chat(project_id=project, prompt="hi"))[0].session_id)

    seen: list[str] = []
    token = ""
    while True:
        page = await client.stub.ListSessions(pb.ListSessionsRequest(project_id="alpha", page_size=2, page_token=token))
        assert len(page.sessions) <= 2
        seen.extend(s.session_id for s in page.sessions)
        token = page.next_page_token
        if not token:
            break
    assert sorted(seen) == sorted(ids["alpha"])
    everything = await client.stub.ListSessions(pb.ListSessionsRequest())
    assert len(everything.sessions) == 4

    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await client.stub.ListSessions(pb.ListSessionsRequest(page_token="%%%"))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_list_agents_shows_profiles_and_the_capabilities_seen(
    make_daemon: DaemonFactory, fake: FakeAgentSetup
) -> None:
    _, client = await make_daemon({"fake": fake.profile(), "other": fake.profile("--caps", "load")})
    before = {a.name: a for a in (await client.stub.ListAgents(pb.ListAgentsRequest())).agents}
    assert before["fake"].default and not before["other"].default
    assert before["fake"].kind == "generic"
    assert before["claude"].kind == "claude"
    assert not before["fake"].HasField("capabilities")

    await client.chat(prompt="hi")
    after = {a.name: a for a in (await client.stub.ListAgents(pb.ListAgentsRequest())).agents}
    caps = after["fake"].capabilities
    assert caps.session_resume and caps.load_session and caps.session_close
    assert caps.agent_name == "fake-agent"
    assert after["fake"].live_agents == 1


async def test_subscribe_replays_a_finished_run_after_a_given_seq(make_daemon: DaemonFactory) -> None:
    _, client = await make_daemon()
    events = await client.chat(prompt="stream 4")

    replay = [e async for e in client.stub.Subscribe(pb.SubscribeRequest(run_id=events[0].run_id, after_seq=2))]
    assert [e.seq for e in replay] == [e.seq for e in events[2:]]
    assert replay == events[2:]


async def test_subscribe_to_an_unknown_run_is_not_found(make_daemon: DaemonFactory) -> None:
    _, client = await make_daemon()
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        async for _ in client.stub.Subscribe(pb.SubscribeRequest(run_id="nope")):
            pass
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND

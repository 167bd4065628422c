"""``rcoder.client``, the Python client, against a real daemon running the fake ACP agent.

One daemon serves the module (each test keeps to projects of its own); the token and TLS test
starts its own. The last tests check the client's model of the stream against the .proto.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import AsyncIterator, Awaitable
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest
import pytest_asyncio

from rcoder import client_args
from rcoder.client import (
    Busy,
    BusyPolicy,
    Cancelled,
    ClientClosed,
    Completed,
    Cost,
    Event,
    FileChangeKind,
    ForkMethod,
    Gap,
    Heartbeat,
    ImageAttachment,
    IncompleteTurn,
    InvalidArgument,
    McpStdio,
    NotFound,
    PermissionDenied,
    PermissionMode,
    PermissionOutcome,
    PermissionRequest,
    PermissionResolved,
    Plan,
    Queued,
    RcoderClient,
    RcoderClientError,
    ResourceAttachment,
    ResourceLinkAttachment,
    ResumeOutcome,
    RunKind,
    RunStatus,
    SessionOrder,
    SessionStatus,
    Started,
    StopReason,
    Text,
    TextAttachment,
    ToolCall,
    ToolCalls,
    ToolCallUpdate,
    ToolDiff,
    Turn,
    Unauthenticated,
    Unavailable,
    UnknownEvent,
)
from rcoder.client.events import CONVERTERS, event_from_proto
from rcoder.client.requests import chat_request
from rcoder.client.resources import session_from_proto
from rcoder.v1 import agent_runner_pb2 as pb
from tests.conftest import assert_stores_consistent, base_settings
from tests.harness import Daemon, FakeAgentSetup, processes_mentioning, write_config
from tests.test_access import make_certificate

# the tests that talk to the daemon share the module's event loop, as its client and channel do
on_the_module_loop = pytest.mark.asyncio(loop_scope="module")

T = TypeVar("T")
WAIT = 30.0  # seconds: the bound of every wait on the daemon
TOKEN = "s3cret-token"


@contextlib.asynccontextmanager
async def serving(root: Path, **top: Any) -> AsyncIterator[tuple[Daemon, FakeAgentSetup]]:
    """A real daemon with the fake agent as its default profile; stopped, and checked, at the end."""
    fake = FakeAgentSetup(root)
    profile = fake.profile(allow_mcp=["stdio"], allow_mcp_commands=["/bin/true"])
    config = write_config(root / "rcoder.toml", {"fake": profile}, **{**base_settings(root), **top})
    daemon = await Daemon(config).start()
    try:
        yield daemon, fake
    finally:
        try:
            await daemon.stop()
        finally:
            await daemon.kill()
        assert processes_mentioning(str(fake.state_dir)) == [], "agent processes left behind"
        assert_stores_consistent(root)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[tuple[Daemon, FakeAgentSetup]]:
    async with serving(tmp_path_factory.mktemp("client"), heartbeat_interval=0.2) as daemon_and_fake:
        yield daemon_and_fake


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client(served: tuple[Daemon, FakeAgentSetup]) -> AsyncIterator[RcoderClient]:
    async with RcoderClient(served[0].address, token=served[0].token) as made:
        yield made


async def bounded(awaitable: Awaitable[T]) -> T:
    async with asyncio.timeout(WAIT):
        return await awaitable


async def read_until(turn: Turn, kind: type[Event]) -> list[Event]:
    """The turn's events up to and including the first of ``kind`` (the turn goes on streaming)."""
    seen: list[Event] = []
    async with asyncio.timeout(WAIT):
        async for event in turn:
            seen.append(event)
            if isinstance(event, kind):
                return seen
    raise AssertionError(f"the turn ended without {kind.__name__}: {seen}")


async def all_of(turn: Turn) -> list[Event]:
    async with asyncio.timeout(WAIT):
        return [event async for event in turn]


# ---------------------------------------------------------------- turns


@on_the_module_loop
async def test_chat_streams_one_typed_event_per_variant_in_order(client: RcoderClient) -> None:
    events = await all_of(client.chat("c-stream", "think tool stream 2 remember 7"))

    started, done = events[0], events[-1]
    assert isinstance(started, Started) and isinstance(done, Completed)
    assert started.resume is ResumeOutcome.NEW and started.agent == "fake" and started.project_id == "c-stream"
    assert done.stop_reason is StopReason.END_TURN and done.error == ""
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    assert {(e.run_id, e.session_id) for e in events} == {(started.run_id, started.session_id)}
    assert [e.text for e in events if isinstance(e, Text) and e.thought] == ["thinking..."]
    (call,) = [e for e in events if isinstance(e, ToolCall)]
    assert (call.tool_call_id, call.title, call.kind, call.status) == ("call-1", "touch file", "edit", "pending")
    (plan,) = [e for e in events if isinstance(e, Plan)]
    assert [(p.content, p.status) for p in plan.entries] == [
        ("look around", "completed"),
        ("touch file", "in_progress"),
    ]
    assert any(isinstance(e, ToolCallUpdate) and e.status == "completed" for e in events)
    assert "".join(e.text for e in events if isinstance(e, Text) and not e.thought) == "c0 c1 I remember: 7"
    assert isinstance(started.time, datetime) and started.time <= done.time
    assert done.to_dict()["completed"]["stop_reason"] == "STOP_REASON_END_TURN"  # the message as grpcurl prints it


@on_the_module_loop
async def test_tool_calls_carry_their_diffs_locations_output_and_exit_status(client: RcoderClient) -> None:
    events = await all_of(client.chat("c-edits", "edits"))

    tools = ToolCalls()
    states = [s for e in events if (s := tools.fold(e)) is not None]
    edit, run = tools.calls["call-e"], tools.calls["call-x"]
    assert (edit.kind, edit.status, edit.locations) == ("edit", "completed", ("notes.txt",))
    assert edit.diffs == (ToolDiff(path="notes.txt", old_text="one\ntwo\n", new_text="one\nthree\nfour\n"),)
    assert edit.diffs[0].line_counts() == (2, 1)
    assert (run.kind, run.status, run.command, run.output, run.exit_code) == (
        "execute",
        "completed",
        "ls -la",
        "x\n",
        2,
    )
    (update,) = [e for e in events if isinstance(e, ToolCallUpdate) and e.tool_call_id == "call-x"]
    assert update.title == "" and update.exit_code == 2, "an update carries only what changed"
    assert len(states) == 4


def test_the_client_tool_call_events_have_every_field_of_the_proto() -> None:
    for ours, theirs in ((ToolCall, pb.ToolCall), (ToolCallUpdate, pb.ToolCallUpdate), (ToolDiff, pb.ToolDiff)):
        assert {f.name for f in theirs.DESCRIPTOR.fields} <= set(ours.__dataclass_fields__), theirs


@on_the_module_loop
async def test_text_and_result_collect_the_answer_and_a_session_id_resumes_the_conversation(
    client: RcoderClient,
) -> None:
    first = await bounded(client.chat("c-resume", "remember 42").result())
    assert first.text == "I remember: 42"
    assert first.started is not None and first.started.resume is ResumeOutcome.NEW
    assert first.completed.stop_reason is StopReason.END_TURN

    again = client.chat("c-resume", "which number?", session_id=first.session_id)
    assert await bounded(again.text()) == "I remember: 42"
    assert again.session_id == first.session_id and again.run_id != first.run_id
    assert again.started is not None and again.started.resume is ResumeOutcome.LIVE
    assert (await again.completed()).stop_reason is StopReason.END_TURN


@on_the_module_loop
async def test_a_quiet_turn_brings_heartbeats(client: RcoderClient) -> None:
    events = await all_of(client.chat("c-quiet", "sleep 700"))
    assert any(isinstance(e, Heartbeat) for e in events)
    assert isinstance(events[-1], Completed)


@on_the_module_loop
async def test_an_agent_failure_after_started_is_a_completed_error_not_an_exception(client: RcoderClient) -> None:
    done = await bounded(client.chat("c-crash", "crash").completed())
    assert done.stop_reason is StopReason.ERROR
    assert "fake agent crashing" in done.error and done.error_reason == "AGENT_CRASHED"


@on_the_module_loop
async def test_a_turn_past_its_max_cost_usd_completes_budget_exceeded(client: RcoderClient) -> None:
    # the fake's `costs 3` reports 0.1, 0.2, 0.3 USD mid-turn; `hang` waits for the cancel
    done = await bounded(client.chat("c-budget", "costs 3 hang", max_cost_usd=0.15).completed())
    assert done.stop_reason is StopReason.BUDGET_EXCEEDED
    assert done.error_reason == "BUDGET_EXCEEDED" and "max_cost_usd 0.15 USD" in done.error


@on_the_module_loop
async def test_attachments_mcp_servers_and_meta_reach_the_agent(
    client: RcoderClient, served: tuple[Daemon, FakeAgentSetup]
) -> None:
    trace = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    turn = client.chat(
        "c-request",
        "look",
        attachments=[
            TextAttachment("and this"),
            ImageAttachment(data=b"\x89PNG", mime_type="image/png"),
            ResourceAttachment(uri="file:///notes.txt", text="notes", mime_type="text/plain"),
            ResourceLinkAttachment(uri="file:///b.txt", name="b.txt", size=3),
        ],
        mcp_servers=[McpStdio(name="tools", command="/bin/true", args=["-x"], env={"A": "1"})],
        extra_meta={"traceparent": trace},
        system_prompt="be brief",
        request_id="req-7",
    )
    result = await bounded(turn.result())

    assert result.text == "I remember nothing. [got image] [got resource] [got resource_link]"
    assert result.started is not None and result.started.request_id == "req-7"
    fake = served[1]
    (opened,) = [m["params"] for m in fake.requests("session/new") if m["params"]["cwd"].endswith("/c-request")]
    assert opened["_meta"] == {"traceparent": trace, "systemPrompt": {"append": "be brief"}}
    assert opened["mcpServers"] == [
        {"name": "tools", "command": "/bin/true", "args": ["-x"], "env": [{"name": "A", "value": "1"}]}
    ]
    prompts = [m["params"]["prompt"] for m in fake.requests("session/prompt")]
    (blocks,) = [b for b in prompts if b[0].get("text") == "look"]
    assert [b["type"] for b in blocks] == ["text", "text", "image", "resource", "resource_link"]


# ---------------------------------------------------------------- subscribe, cancel, permissions


@on_the_module_loop
async def test_subscribe_reattaches_to_a_run_by_its_id_or_its_session(client: RcoderClient) -> None:
    turn = client.chat("c-subscribe", "remember 5 stream 8 pace 30")
    seen = await read_until(turn, Text)
    turn.leave()  # the client goes away mid-stream; the turn goes on in the daemon
    assert [e async for e in turn] == []
    with pytest.raises(IncompleteTurn) as left:
        await turn.completed()
    assert left.value.run_id == seen[0].run_id

    rest = await all_of(client.subscribe(turn.run_id, after_seq=seen[-1].seq))
    assert [e.seq for e in rest] == list(range(seen[-1].seq + 1, rest[-1].seq + 1))
    assert isinstance(rest[-1], Completed) and rest[-1].stop_reason is StopReason.END_TURN

    by_session = client.subscribe(session_id=turn.session_id)
    assert await bounded(by_session.text()) == "c0 c1 c2 c3 c4 c5 c6 c7 I remember: 5"
    assert [*seen, *rest] == [e async for e in client.subscribe(turn.run_id)]


@on_the_module_loop
async def test_leaving_a_turn_ends_a_read_waiting_in_another_task_and_the_turn_goes_on(client: RcoderClient) -> None:
    turn = client.chat("c-leave", "hang")
    first = asyncio.Event()

    async def reader() -> list[Event]:
        seen = []
        async for event in turn:
            seen.append(event)
            first.set()  # then it waits in the next read
        return seen

    reading = asyncio.create_task(reader())
    await bounded(first.wait())
    turn.leave()
    seen = await bounded(reading)  # its iteration ended: no CancelledError in a task nobody cancelled
    assert isinstance(seen[0], Started) and not any(isinstance(e, Completed) for e in seen)

    assert (await bounded(client.cancel(turn.run_id))).cancelled  # the turn was still running
    assert (await bounded(client.subscribe(turn.run_id).completed())).stop_reason is StopReason.CANCELLED


@on_the_module_loop
async def test_cancel_by_run_or_session_ends_the_turn_cancelled(client: RcoderClient) -> None:
    turn = client.chat("c-cancel", "remember 3 hang")
    await read_until(turn, Started)
    answer = await bounded(client.cancel(turn.run_id))
    assert (answer.run_id, answer.cancelled) == (turn.run_id, True)
    assert (await bounded(turn.completed())).stop_reason is StopReason.CANCELLED
    assert not (await bounded(client.cancel(turn.run_id))).cancelled  # it had ended

    second = client.chat("c-cancel", "hang", session_id=turn.session_id)
    await read_until(second, Started)
    assert (await bounded(client.cancel(session_id=turn.session_id))).run_id == second.run_id
    assert (await bounded(second.completed())).stop_reason is StopReason.CANCELLED
    assert await bounded(client.chat("c-cancel", "still?", session_id=turn.session_id).text()) == "I remember: 3"


@on_the_module_loop
async def test_with_ask_a_permission_request_waits_for_resolve_permission(client: RcoderClient) -> None:
    turn = client.chat("c-ask", "permission", permission_mode=PermissionMode.ASK)
    asked = (await read_until(turn, PermissionRequest))[-1]
    assert isinstance(asked, PermissionRequest)
    assert asked.title == "touch file"
    assert {o.kind for o in asked.options} == {"allow_once", "allow_always", "reject_once"}

    await bounded(client.resolve_permission(asked.run_id, asked.permission_id, "allow-always"))
    resolved = (await read_until(turn, PermissionResolved))[-1]  # the answer, as every watcher sees it
    assert isinstance(resolved, PermissionResolved) and resolved.permission_id == asked.permission_id
    assert resolved.outcome is PermissionOutcome.ANSWERED
    assert (resolved.option_id, resolved.option_kind) == ("allow-always", "allow_always")
    assert (await bounded(turn.text())).endswith("permission=allow-always")
    with pytest.raises(NotFound) as again:  # every request gets exactly one answer
        await bounded(client.resolve_permission(asked.run_id, asked.permission_id, "allow"))
    assert again.value.code == grpc.StatusCode.NOT_FOUND
    assert again.value.metadata["id"] == asked.permission_id


@on_the_module_loop
async def test_a_chat_sent_while_busy_queues_or_is_cancelled_as_asked(client: RcoderClient) -> None:
    first = client.chat("c-busy", "remember 1 permission", permission_mode=PermissionMode.ASK)
    asked = (await read_until(first, PermissionRequest))[-1]
    assert isinstance(asked, PermissionRequest)
    with pytest.raises(Busy):
        await bounded(client.chat("c-busy", "remember 2", session_id=first.session_id).text())
    queued = client.chat("c-busy", "remember 2", session_id=first.session_id, busy=BusyPolicy.QUEUE)
    dropped = client.chat("c-busy", "remember 3", session_id=first.session_id, busy=BusyPolicy.QUEUE)
    waiting = (await read_until(queued, Queued))[0]
    assert isinstance(waiting, Queued) and waiting.position == 1 and queued.run_id == waiting.run_id
    gone = (await read_until(dropped, Queued))[0]

    assert (await bounded(client.cancel(gone.run_id))).cancelled
    with pytest.raises(Cancelled):
        await bounded(dropped.text())
    await bounded(client.resolve_permission(asked.run_id, asked.permission_id, "allow"))
    assert await bounded(queued.text()) == "I remember: 1, 2"
    assert queued.started is not None and queued.started.resume is ResumeOutcome.LIVE


# ---------------------------------------------------------------- sessions and agents


@on_the_module_loop
async def test_sessions_are_listed_paged_got_and_closed(client: RcoderClient) -> None:
    one = await bounded(client.chat("c-sessions", "remember 1").result())
    two = await bounded(client.chat("c-sessions", "remember 2").result())

    listed = [s async for s in client.sessions.list("c-sessions")]
    assert sorted(s.session_id for s in listed) == sorted([one.session_id, two.session_id])
    assert {(s.project_id, s.agent, s.turns, s.status) for s in listed} == {("c-sessions", "fake", 1, "live")}
    first = await bounded(client.sessions.page("c-sessions", page_size=1))
    assert len(first.sessions) == 1 and first.next_page_token
    last = await bounded(client.sessions.page("c-sessions", page_size=1, page_token=first.next_page_token))
    assert {first.sessions[0].session_id, last.sessions[0].session_id} == {one.session_id, two.session_id}

    record = await bounded(client.sessions.get(one.session_id))
    assert record.last_run_id == one.run_id and record.provider_session_id == one.completed.provider_session_id
    assert record.created_at is not None and record.updated_at is not None and record.created_at <= record.updated_at
    assert await bounded(client.sessions.close(one.session_id)) is True
    assert (await bounded(client.sessions.get(one.session_id))).status is SessionStatus.IDLE
    assert await bounded(client.sessions.close(one.session_id)) is False


@on_the_module_loop
async def test_a_session_carries_its_usage_totals_and_sessions_list_by_cost(client: RcoderClient) -> None:
    cheap = await bounded(client.chat("c-usage", "usage").result())
    dear = await bounded(client.chat("c-usage", "usage").result())
    await bounded(client.chat("c-usage", "usage", session_id=dear.session_id).result())
    free = await bounded(client.chat("c-usage", "hello").result())

    record = await bounded(client.sessions.get(dear.session_id))
    assert record.usage is not None and record.usage.runs == 2
    assert (record.usage.input_tokens, record.usage.thought_tokens) == (200, None)
    assert record.usage.costs == (Cost(amount=0.5, currency="USD"),)
    assert (await bounded(client.sessions.get(free.session_id))).usage is None
    by_cost = [
        s.session_id async for s in client.sessions.list("c-usage", page_size=1, order_by=SessionOrder.COST_DESC)
    ]
    assert by_cost == [dear.session_id, cheap.session_id, free.session_id]
    with pytest.raises(InvalidArgument) as caught:
        await bounded(client.sessions.page("c-usage", cost_currency="USD"))
    assert caught.value.metadata["field"] == "cost_currency"


@on_the_module_loop
async def test_a_fork_is_a_new_session_with_the_history_so_far(client: RcoderClient) -> None:
    source = await bounded(client.chat("c-fork", "remember 5").result())

    fork = await bounded(client.sessions.fork(source.session_id, "c-fork"))

    # the fake agent of this module does not advertise session/fork: the branch is re-seeded
    assert fork.method is ForkMethod.RESEEDED and "session/fork" in fork.fallback_reason
    assert fork.session.session_id != source.session_id and fork.session.status is SessionStatus.IDLE
    branch = client.chat("c-fork", "which number?", session_id=fork.session.session_id)
    assert await bounded(branch.text()) == "I remember: 5"
    with pytest.raises(PermissionDenied):
        await bounded(client.sessions.fork(source.session_id, "c-elsewhere"))
    with pytest.raises(InvalidArgument) as unknown:
        await bounded(client.sessions.fork(source.session_id, "c-fork", agent="nobody"))
    assert unknown.value.metadata["field"] == "agent"


@on_the_module_loop
async def test_a_sessions_runs_are_listed_oldest_first_and_a_deleted_session_is_not_found(
    client: RcoderClient,
) -> None:
    first = await bounded(client.chat("c-runs", "remember 8", request_id="req-8").result())
    await bounded(client.chat("c-runs", "which number?", session_id=first.session_id).result())

    runs = [run async for run in client.sessions.list_runs(first.session_id, page_size=1)]
    page = await bounded(client.sessions.runs_page(first.session_id, page_size=1))

    assert [r.prompt for r in runs] == ["remember 8", "which number?"]
    assert runs[0].status is RunStatus.COMPLETED and runs[0].stop_reason is StopReason.END_TURN
    assert runs[0].resume is ResumeOutcome.NEW and runs[1].resume is ResumeOutcome.LIVE
    assert runs[0].request_id == "req-8" and runs[0].run_id == first.run_id and runs[0].ended_at is not None
    assert page.runs == tuple(runs[:1]) and page.next_page_token
    deleted = await bounded(client.sessions.delete(first.session_id))
    assert deleted.agent_stopped and (deleted.runs, deleted.transcript_entries) == (2, 2)
    with pytest.raises(NotFound):
        await bounded(client.sessions.runs_page(first.session_id))
    with pytest.raises(NotFound):
        await bounded(client.sessions.delete(first.session_id))


@on_the_module_loop
async def test_agents_lists_the_profiles_with_what_they_advertised(client: RcoderClient) -> None:
    await bounded(client.chat("c-agents", "hi").completed())
    agents = {agent.name: agent for agent in await bounded(client.agents())}

    fake = agents["fake"]
    assert fake.default and fake.command and fake.resume == "auto"
    assert fake.capabilities is not None and fake.capabilities.seen_at is not None
    assert "echo" in agents and not agents["echo"].default

    runs_as = await bounded(client.agent_user())  # the tests' daemons: agent_user "" (the daemon's own)
    assert (runs_as.uid, runs_as.gid, runs_as.separate) == (os.getuid(), os.getgid(), False), runs_as
    assert runs_as.reason and runs_as.fix, runs_as


# ---------------------------------------------------------------- errors


@on_the_module_loop
async def test_an_unknown_run_is_not_found_with_its_reason_and_metadata(client: RcoderClient) -> None:
    with pytest.raises(NotFound) as caught:
        await bounded(client.cancel("no-such-run"))
    error = caught.value
    assert (error.code, error.reason, error.domain) == (grpc.StatusCode.NOT_FOUND, "RUN_NOT_FOUND", "rcoder.dev")
    assert error.metadata == {"kind": "run", "id": "no-such-run"}
    assert "not found" in error.message
    assert str(error).startswith("NOT_FOUND (RUN_NOT_FOUND): ")

    with pytest.raises(NotFound) as streamed:  # a stream's error arrives where it is read
        await all_of(client.subscribe("no-such-run"))
    assert streamed.value.reason == "RUN_NOT_FOUND"
    with pytest.raises(NotFound) as session:
        await bounded(client.sessions.get("no-such-session"))
    assert session.value.reason == "SESSION_NOT_FOUND"


@on_the_module_loop
async def test_bad_input_is_invalid_argument_naming_the_field(client: RcoderClient) -> None:
    with pytest.raises(InvalidArgument) as caught:
        await bounded(client.chat("../up", "hi").text())
    assert caught.value.reason == "INVALID_ARGUMENT" and caught.value.metadata == {"field": "project_id"}
    assert not caught.value.retryable

    with pytest.raises(InvalidArgument) as both:
        await bounded(client.cancel("a-run", session_id="a-session"))
    assert both.value.metadata["field"] == "run_id"


@on_the_module_loop
async def test_a_second_turn_on_a_busy_session_is_busy_and_retryable(client: RcoderClient) -> None:
    turn = client.chat("c-busy", "hang")
    await read_until(turn, Started)
    with pytest.raises(Busy) as caught:
        await bounded(client.chat("c-busy", "me too", session_id=turn.session_id).text())
    assert caught.value.reason == "SESSION_BUSY" and caught.value.retryable
    assert caught.value.metadata == {"session_id": turn.session_id, "run_id": turn.run_id}
    await bounded(client.cancel(turn.run_id))
    assert (await bounded(turn.completed())).stop_reason is StopReason.CANCELLED


@on_the_module_loop
async def test_an_unreachable_daemon_is_unavailable_without_a_reason() -> None:
    with socket.socket() as bound:  # a port nobody listens on
        bound.bind(("127.0.0.1", 0))
        async with RcoderClient(f"127.0.0.1:{bound.getsockname()[1]}", timeout=WAIT) as nowhere:
            with pytest.raises(Unavailable) as caught:
                await nowhere.agents()
    assert caught.value.code == grpc.StatusCode.UNAVAILABLE and caught.value.reason == ""
    assert caught.value.retryable


async def test_a_run_whose_history_was_cut_reads_back_with_a_typed_gap_then_its_end(tmp_path: Path) -> None:
    # a history of at most 2000 bytes, and the run read from it (run_retention 0: not kept in memory)
    async with contextlib.AsyncExitStack() as stack:
        daemon, _ = await stack.enter_async_context(serving(tmp_path, history_max_bytes_per_run=2000, run_retention=0))
        client = await stack.enter_async_context(RcoderClient(daemon.address, token=daemon.token))
        live = await all_of(client.chat("c-gap", "tool bigline 3000 bigtools 3 100"))
        stored = await all_of(client.subscribe(live[0].run_id))
    (gap,) = [e for e in stored if isinstance(e, Gap)]
    kept = stored[: stored.index(gap)]
    assert kept == live[: len(kept)] and stored[-1] == live[-1] and isinstance(stored[-1], Completed)
    assert (gap.from_seq, gap.to_seq, gap.seq, gap.reason) == (
        live[len(kept)].seq, live[-1].seq - 1, live[-1].seq - 1, "history_max_bytes_per_run",
    )  # fmt: skip


@on_the_module_loop
async def test_a_closed_client_refuses_calls(served: tuple[Daemon, FakeAgentSetup]) -> None:
    made = RcoderClient(served[0].address)
    await made.close()
    await made.close()  # twice is fine
    with pytest.raises(ClientClosed):
        await made.agents()
    with pytest.raises(ClientClosed):
        await made.chat("c-closed", "hi").text()


@on_the_module_loop
async def test_a_token_and_tls_are_sent_and_a_missing_token_is_unauthenticated(tmp_path: Path) -> None:
    cert, key = await asyncio.to_thread(make_certificate, tmp_path)
    async with serving(tmp_path, auth_token=TOKEN, tls_cert=str(cert), tls_key=str(key)) as (daemon, _):
        async with RcoderClient(daemon.address, token=TOKEN, tls=cert.read_bytes()) as good:
            assert await bounded(good.chat("c-token", "remember 9").text()) == "I remember: 9"
            assert [a.name for a in await bounded(good.agents()) if a.default] == ["fake"]
        for token in ("", "wrong"):
            async with RcoderClient(daemon.address, token=token, tls=cert.read_bytes()) as bad:
                with pytest.raises(Unauthenticated) as caught:
                    await bounded(bad.chat("c-token", "hi").text())
                assert caught.value.reason == "UNAUTHENTICATED"
                with pytest.raises(Unauthenticated):
                    await bounded(bad.agents())


@on_the_module_loop
async def test_a_turn_s_changes_read_back_and_a_rewind_through_the_client(client: RcoderClient) -> None:
    done = await bounded(client.chat("c-changes", "shell printf 'one\\ntwo\\n' > made.txt").result())
    (made,) = done.completed.changes
    assert (made.path, made.kind, made.lines_added, made.binary) == ("made.txt", FileChangeKind.ADDED, 2, False)
    changes = await client.sessions.run_changes(done.run_id, "made.txt")
    assert "+one" in changes.diff and not changes.truncated and changes.changes == (made,)
    rewound = await client.sessions.rewind(done.session_id, done.run_id)
    assert [(c.path, c.kind) for c in rewound.changes] == [("made.txt", FileChangeKind.DELETED)]
    runs = [run async for run in client.sessions.list_runs(done.session_id)]
    assert [r.kind for r in runs] == [RunKind.TURN, RunKind.REWIND] and runs[1].run_id == rewound.run_id
    assert runs[0].changes == (made,)


# ---------------------------------------------------------------- the client's model of the .proto


def test_every_chat_stream_variant_has_its_event_class() -> None:
    variants = {f.name for f in pb.ChatStream.DESCRIPTOR.oneofs_by_name["event"].fields}
    assert set(CONVERTERS) == variants


@pytest.mark.parametrize(
    ("ours", "theirs", "prefix"),
    [
        (ResumeOutcome, pb.ResumeOutcome, "RESUME_OUTCOME_"),
        (StopReason, pb.StopReason, "STOP_REASON_"),
        (SessionStatus, pb.SessionStatus, "SESSION_STATUS_"),
        (SessionOrder, pb.SessionOrder, "SESSION_ORDER_"),
        (PermissionMode, pb.PermissionMode, "PERMISSION_MODE_"),
        (PermissionOutcome, pb.PermissionOutcome, "PERMISSION_OUTCOME_"),
        (FileChangeKind, pb.FileChangeKind, "FILE_CHANGE_KIND_"),
        (RunKind, pb.RunKind, "RUN_KIND_"),
    ],
)
def test_every_enum_value_of_the_proto_has_its_member(ours: Any, theirs: Any, prefix: str) -> None:
    names = {value.name.removeprefix(prefix).lower() for value in theirs.DESCRIPTOR.values}
    assert {member.value for member in ours} | {"unspecified"} == names


def test_a_variant_newer_than_the_client_arrives_as_an_unknown_event_holding_it() -> None:
    known = pb.ChatStream(run_id="r", session_id="s", seq=4).SerializeToString()
    newer = known + bytes([0x9A, 0x06, 0x02, 0x08, 0x01])  # field 99, a message {1: 1}: a variant of tomorrow
    event = event_from_proto(pb.ChatStream.FromString(newer))

    assert isinstance(event, UnknownEvent)
    assert (event.kind, event.run_id, event.session_id, event.seq) == ("", "r", "s", 4)
    assert event.raw.SerializeToString() == newer  # nothing of it is lost


def test_an_enum_value_newer_than_the_client_reads_as_unspecified() -> None:
    message = pb.ChatStream(seq=1, completed=pb.RunCompleted(stop_reason=pb.STOP_REASON_END_TURN))
    message.completed.stop_reason = 42  # type: ignore[assignment]
    event = event_from_proto(message)
    assert isinstance(event, Completed) and event.stop_reason is StopReason.UNSPECIFIED
    assert event.raw.completed.stop_reason == 42
    record = session_from_proto(pb.Session(session_id="x"))
    assert record.status is SessionStatus.UNSPECIFIED and record.created_at is None


def test_the_request_carries_every_argument() -> None:
    request = chat_request(
        "p", "hi", session_id="s", agent="a", permission_mode=PermissionMode.DENY, system_prompt="be brief"
    )
    assert (request.project_id, request.prompt, request.session_id, request.agent) == ("p", "hi", "s", "a")
    assert request.permission_mode == pb.PERMISSION_MODE_DENY and request.system_prompt == "be brief"
    assert chat_request("p", "hi").permission_mode == pb.PERMISSION_MODE_UNSPECIFIED
    assert isinstance(RcoderClientError("x"), Exception) and str(RcoderClientError("plain")) == "plain"


@pytest.mark.fast
def test_the_busy_choices_of_rcoder_chat_are_the_clients_busy_policies() -> None:
    assert tuple(policy.value for policy in BusyPolicy) == client_args.BUSY_POLICIES

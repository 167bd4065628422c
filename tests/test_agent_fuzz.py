"""Property-based, agent side: whatever an ACP agent writes, every turn ends, the session
stays usable and nothing leaks (``test_properties.py`` does the same for gRPC input).

Hypothesis writes scripts for ``tests/fakes/fuzz_agent.py``, a real agent process that plays
them back: odd ``session/update`` payloads, requests rcoder never advertised, stray and error
responses, non-JSON and invalid UTF-8 lines, huge lines, torn lines, stderr floods, malformed
answers, exits, a closed stdout. Each generated case runs two turns of one session on one
real daemon, then closes the session:

- the first turn is a stream from ``started`` to one ``completed`` (seq 1..n, no gaps) whose
  stop reason is the one the script answered with, or ``ERROR`` with a message when the
  script broke the turn; when the script broke ``initialize`` or the session's opening it is
  a deliberate gRPC status with a message and an ``ErrorInfo`` instead;
- the session is never left BUSY, and its second turn completes (or, if the agent cannot
  open sessions, fails the same clean way); an agent that ended its side *after* answering
  may make the second turn fail once (the known gap of
  ``test_the_turn_after_an_agent_closed_its_output_resumes_on_a_new_agent``), then the
  third completes;
- every request the agent waited on got exactly one answer;
- after ``CloseSession`` no agent process is left, the daemon holds no more file
  descriptors at the end than after the first case, and it logged no failure of its own.

Scripts that never answer the prompt (``hang``, ``deaf``) are the second test: they end by
``turn_timeout``. What the fuzzer found is kept as explicit examples; the known gaps outside
the agent transport have tests of their own at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import select
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from google.rpc import error_details_pb2, status_pb2
from hypothesis import HealthCheck, Phase, event, example, given, settings
from hypothesis import strategies as st

from rcoder.v1 import agent_runner_pb2 as pb
from rcoder.v1 import agent_runner_pb2_grpc as pb_grpc
from tests.conftest import DaemonFactory
from tests.fuzz_scripts import ERROR, LINE_LIMIT, LONE_SURROGATE, SID, Action, Case, answer, cases, raw, rpc, send
from tests.harness import ROOT, Daemon, assert_daemon_healthy, processes_mentioning

FUZZ_AGENT = ROOT / "tests" / "fakes" / "fuzz_agent.py"
# turn_timeout, initialize_timeout and session_open_timeout of the daemons: with scripts that
# always answer, a bound no healthy step nears on a loaded machine; with the ones that hang, short
SAFETY_TIMEOUT = 30.0
HANG_TIMEOUT = 3.0
CALL_BOUND = 2 * SAFETY_TIMEOUT  # no gRPC call of a case may take longer: beyond it is a hang
# statuses an agent that cannot start or open its session may earn a request
START_FAILURES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.FAILED_PRECONDITION}
# `make soak` (RCODER_SOAK=1): many more cases, from a fresh seed each time
SOAK = os.environ.get("RCODER_SOAK") == "1"
FUZZ_SETTINGS = settings(
    max_examples=1000 if SOAK else 40, derandomize=not SOAK, deadline=None, database=None,
    suppress_health_check=list(HealthCheck),
)  # fmt: skip

# --------------------------------------------------------------------------- the client side


@dataclass
class Outcome:
    events: list[pb.ChatStream]
    error: grpc.RpcError | None

    @property
    def session_id(self) -> str:
        return self.events[0].session_id if self.events else ""

    @property
    def completed(self) -> pb.RunCompleted:
        return self.events[-1].completed

    def label(self) -> str:
        return str(self.error.code().name) if self.error else pb.StopReason.Name(self.completed.stop_reason)

    def text(self) -> str:
        return "".join(e.agent_message.text for e in self.events if e.WhichOneof("event") == "agent_message")


class Fuzzer:
    """Runs cases against one daemon, over a sync channel (hypothesis drives it from a thread)."""

    def __init__(
        self, stub: pb_grpc.AgentRunnerStub, script_path: Path, record: Path, daemon_pid: int, bound: float = CALL_BOUND
    ) -> None:
        self.stub = stub
        self.bound = bound
        self.script_path = script_path
        self.record = record
        self.daemon_pid = daemon_pid

    def chat(self, prompt: str, session_id: str = "") -> Outcome:
        request = pb.ChatRequest(project_id="fuzz", session_id=session_id, prompt=prompt)
        events: list[pb.ChatStream] = []
        try:
            for event in self.stub.Chat(request, timeout=self.bound):
                events.append(event)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise AssertionError(f"the turn did not end within {self.bound}s: {events[-3:]}") from exc
            return Outcome(events, exc)
        return Outcome(events, None)

    def run(self, case: Case) -> Outcome:
        """Run the case; its first turn."""
        self.script_path.write_text(json.dumps(case.script))
        self.record.write_text("")
        first = self.chat("go first")
        if not case.opens:
            if first.error is not None:
                assert_start_failure(first)
            else:
                assert_one_turn(first)  # noise aside, the agent may still have opened the session
        else:
            assert first.error is None, f"{first.error.code()}: {first.error.details()}"
            assert_one_turn(first)
            assert first.completed.stop_reason == case.stop, (first.completed, case.stop)
        if first.session_id:
            self.second_turn(case, first.session_id)
        if not case.cuts_the_pipe():
            unanswered = [r for r in self.records() if r["event"] == "no_response"]
            assert not unanswered, f"requests of the agent rcoder never answered: {unanswered}"
        left = agents_gone_within(str(self.script_path), timeout=10.0)
        assert not left, f"agent processes left after CloseSession: {left}"
        return first

    def second_turn(self, case: Case, session_id: str) -> None:
        assert self.status(session_id) != pb.SESSION_STATUS_BUSY, "busy after its turn completed"
        second = self.chat("go second", session_id)
        if case.opens and case.resumes:
            assert_one_turn(second)
            if second.completed.stop_reason == ERROR and case.ends_after_answering():
                second = self.chat("go third", session_id)  # the agent gone is known now: it resumes
                assert_one_turn(second)
            assert second.completed.stop_reason == pb.STOP_REASON_END_TURN, second.completed
            assert "-ok" in second.text()
        elif second.error is not None:
            assert_start_failure(second)
        else:
            assert_one_turn(second)
        assert self.status(session_id) != pb.SESSION_STATUS_BUSY, "busy after its turn completed"
        self.stub.CloseSession(pb.CloseSessionRequest(session_id=session_id), timeout=CALL_BOUND)
        assert self.status(session_id) == pb.SESSION_STATUS_IDLE

    def status(self, session_id: str) -> int:
        response = self.stub.GetSession(pb.GetSessionRequest(session_id=session_id), timeout=CALL_BOUND)
        return int(response.status)

    def records(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.record.read_text().splitlines() if line]

    def fds(self) -> int:
        return len(os.listdir(f"/proc/{self.daemon_pid}/fd"))


def assert_one_turn(outcome: Outcome) -> None:
    """started first, completed last and only there, seq 1..n; an ERROR says what went wrong."""
    assert outcome.error is None, f"{outcome.error.code()}: {outcome.error.details()}"
    kinds = [e.WhichOneof("event") for e in outcome.events]
    assert kinds and kinds[0] == "started" and kinds[-1] == "completed", kinds
    assert kinds.count("completed") == 1 and kinds.count("started") == 1, kinds
    assert [e.seq for e in outcome.events] == list(range(1, len(kinds) + 1))
    if outcome.completed.stop_reason == ERROR:
        assert outcome.completed.error, outcome.completed


def assert_start_failure(outcome: Outcome) -> None:
    """A deliberate status before ``started``, with a message and an ErrorInfo."""
    assert outcome.error is not None and not outcome.events
    code, details = outcome.error.code(), outcome.error.details()
    assert code in START_FAILURES, (code, details)
    assert details
    assert error_info(outcome).reason.startswith("AGENT_")


def error_info(outcome: Outcome) -> error_details_pb2.ErrorInfo:
    assert outcome.error is not None, outcome
    rich = dict(outcome.error.trailing_metadata() or ()).get("grpc-status-details-bin")
    assert rich, f"no rich status on {outcome.error.code()}: {outcome.error.details()}"
    status = status_pb2.Status.FromString(rich)
    info = error_details_pb2.ErrorInfo()
    assert any(d.Unpack(info) for d in status.details), status
    return info


def agents_gone_within(marker: str, timeout: float) -> list[int]:
    """Agent processes (command line mentioning ``marker``) still alive after ``timeout``:
    each is waited for on its pidfd, which becomes readable when it exits."""
    deadline = time.monotonic() + timeout
    for pid in processes_mentioning(marker):
        with contextlib.suppress(ProcessLookupError):
            fd = os.pidfd_open(pid)
            try:
                poll = select.poll()
                poll.register(fd, select.POLLIN)
                poll.poll(max(0.0, deadline - time.monotonic()) * 1000)
            finally:
                os.close(fd)
    return processes_mentioning(marker)


def eventually_at_most(read: Callable[[], int], bound: int, timeout: float) -> int:
    """``read()`` once it is at most ``bound`` (polled, bounded); else its last value."""
    deadline = time.monotonic() + timeout
    while (value := read()) > bound and time.monotonic() < deadline:
        select.select([], [], [], 0.05)
    return value


# --------------------------------------------------------------------------- the tests


async def fuzz_daemon(
    make_daemon: DaemonFactory, tmp_path: Path, timeout: float = SAFETY_TIMEOUT
) -> tuple[Daemon, Path, Path]:
    """A daemon whose only agent is the fuzz agent, playing the script it reads at its start."""
    folder = tmp_path / "fuzz-agent"  # the one folder the agent reaches besides its project (it is confined)
    folder.mkdir()
    script, record = folder / "script.json", folder / "record.jsonl"
    profile = {
        "command": sys.executable, "args": ["-S", str(FUZZ_AGENT), str(script), str(record)],
        "read_paths": [str(FUZZ_AGENT.parent)], "write_paths": [str(folder)],
    }  # fmt: skip
    daemon, _ = await make_daemon(
        profiles={"fuzz": profile}, default_agent="fuzz", initialize_timeout=timeout,
        session_open_timeout=timeout, turn_timeout=timeout, agent_stop_grace=1, cancel_grace=1,
        agent_line_limit=LINE_LIMIT, heartbeat_interval=0, shutdown_grace=2, reseed_on_fallback=True,
    )  # fmt: skip
    return daemon, script, record


PLAIN = Case({"session_id": SID}, opens=True, resumes=True, stop=pb.STOP_REASON_END_TURN)


def _example(prompt: list[Action], stop: int, **phases: Any) -> Case:
    return Case({"session_id": SID, "prompts": {"first": prompt}, **phases}, True, True, stop)


END = answer({"result": {"stopReason": "end_turn"}})
INIT = answer({"result": {"protocolVersion": 1, "agentCapabilities": {"sessionCapabilities": {"resume": {}}}}})


async def test_whatever_an_agent_writes_every_turn_ends_and_the_session_goes_on(
    make_daemon: DaemonFactory, tmp_path: Path
) -> None:
    daemon, script, record = await fuzz_daemon(make_daemon, tmp_path)
    assert daemon.proc is not None
    with daemon.sync_channel() as channel:  # sync client: hypothesis drives it
        fuzzer = Fuzzer(pb_grpc.AgentRunnerStub(channel), script, record, daemon.proc.pid)

        @FUZZ_SETTINGS
        @given(case=cases())
        # what the fuzzer found, kept (see tests/agent/test_transport.py for each alone)
        @example(case=_example([send(rpc(id=[1], result={})), END], pb.STOP_REASON_END_TURN))
        @example(case=_example([END], pb.STOP_REASON_END_TURN, initialize=[send(rpc(id=False, error="boom")), INIT]))
        @example(case=_example([raw(LONE_SURROGATE), END], pb.STOP_REASON_END_TURN))
        @example(case=_example([raw(b"[" * 100_000 + b"\n"), END], pb.STOP_REASON_END_TURN))
        @example(case=_example([answer({"error": "boom"})], ERROR))
        @example(case=_example([END, {"op": "exit", "code": 0}], pb.STOP_REASON_END_TURN))
        @example(case=_example([END, {"op": "close_stdout"}], pb.STOP_REASON_END_TURN))
        @example(case=_example([{"op": "close_stdout"}], ERROR))
        def property_(case: Case) -> None:
            event(f"first turn: {fuzzer.run(case).label()}")

        def run_all() -> tuple[int, int]:
            fuzzer.run(PLAIN)  # warm-up: imports, caches and pools reach their size
            before = fuzzer.fds()
            property_()
            return before, eventually_at_most(fuzzer.fds, before + 2, timeout=5.0)

        # in a thread: this loop must keep reading the daemon's logs meanwhile
        fds_before, fds_after = await asyncio.to_thread(run_all)
    assert fds_after <= fds_before + 2, f"the daemon's descriptors grew: {fds_before} -> {fds_after}"
    assert_daemon_healthy(daemon)


HANGS_AT_START = Case({"session_id": SID, "initialize": [{"op": "hang"}]}, opens=False, resumes=False, stop=ERROR)
hangs = st.one_of(st.just({"op": "hang"}), st.just({"op": "deaf"}), st.just({"op": "stderr", "size": 10}))


async def test_a_prompt_the_agent_never_answers_ends_at_turn_timeout(
    make_daemon: DaemonFactory, tmp_path: Path
) -> None:
    daemon, script, record = await fuzz_daemon(make_daemon, tmp_path, HANG_TIMEOUT)
    assert daemon.proc is not None
    with daemon.sync_channel() as channel:
        bound = HANG_TIMEOUT + 10  # a turn_timeout that works ends it well before
        fuzzer = Fuzzer(pb_grpc.AgentRunnerStub(channel), script, record, daemon.proc.pid, bound)

        @settings(FUZZ_SETTINGS, max_examples=1, phases=[Phase.explicit, Phase.generate])
        @given(case=cases(ending=hangs))
        @example(case=_example([{"op": "hang"}], ERROR))
        @example(case=_example([{"op": "stderr", "size": 100}, {"op": "deaf"}], ERROR))  # SIGTERM ignored too
        @example(case=HANGS_AT_START)
        def property_(case: Case) -> None:
            first = fuzzer.run(case)  # the rest of the properties: as for any script
            if case.opens:
                assert first.completed.error_reason == "AGENT_TIMEOUT", first.completed
            elif case is HANGS_AT_START:
                assert error_info(first).reason == "AGENT_TIMEOUT", first

        await asyncio.to_thread(property_)
    assert_daemon_healthy(daemon)


async def test_a_start_failure_after_a_long_stderr_is_still_a_deliberate_status(
    make_daemon: DaemonFactory, tmp_path: Path
) -> None:
    daemon, script, record = await fuzz_daemon(make_daemon, tmp_path)
    assert daemon.proc is not None
    refuses = [{"op": "stderr", "size": 70_000}, answer({"error": {"code": -32603, "message": "no session"}})]
    case = Case({"session_id": SID, "open": refuses}, opens=False, resumes=False, stop=ERROR)
    with daemon.sync_channel() as channel:
        fuzzer = Fuzzer(pb_grpc.AgentRunnerStub(channel), script, record, daemon.proc.pid)
        first = await asyncio.to_thread(fuzzer.run, case)
    assert first.label() == "UNAVAILABLE"


async def test_the_turn_after_an_agent_closed_its_output_resumes_on_a_new_agent(
    make_daemon: DaemonFactory, tmp_path: Path
) -> None:
    daemon, script, record = await fuzz_daemon(make_daemon, tmp_path)
    assert daemon.proc is not None
    case = _example([END, {"op": "close_stdout"}], pb.STOP_REASON_END_TURN)
    script.write_text(json.dumps(case.script))
    with daemon.sync_channel() as channel:
        fuzzer = Fuzzer(pb_grpc.AgentRunnerStub(channel), script, record, daemon.proc.pid)
        first = await asyncio.to_thread(fuzzer.chat, "go first")
        # the daemon has seen the output end: an agent that closes it as the next prompt goes
        # out fails that turn (AGENT_CRASHED), which is another case
        await daemon.wait_log("agent_output_ended", agent="fuzz")
        second = await asyncio.to_thread(fuzzer.chat, "go second", first.session_id)
        await asyncio.to_thread(
            fuzzer.stub.CloseSession, pb.CloseSessionRequest(session_id=first.session_id), timeout=CALL_BOUND
        )
    assert first.label() == "STOP_REASON_END_TURN"
    assert second.label() == "STOP_REASON_END_TURN", second.completed

"""Agent scripts for ``tests/fakes/fuzz_agent.py``, as hypothesis strategies, and what rcoder
must make of each (``Case``). The scripts are plain JSON; see the fuzz agent for the actions."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st

from rcoder.v1 import agent_runner_pb2 as pb

SID = "fuzz-session-1"  # the session id the fuzz agent's session/new answers with
LINE_LIMIT = 1 << 20  # agent_line_limit of the daemon under test: over it is a protocol error
WAIT = 5.0  # seconds the agent waits for rcoder's answer to one of its requests
STOP_REASONS = {
    "end_turn": pb.STOP_REASON_END_TURN,
    "max_tokens": pb.STOP_REASON_MAX_TOKENS,
    "max_turn_requests": pb.STOP_REASON_MAX_TURN_REQUESTS,
    "refusal": pb.STOP_REASON_REFUSAL,
    "cancelled": pb.STOP_REASON_CANCELLED,
}
ERROR = pb.STOP_REASON_ERROR

Action = dict[str, Any]

# --------------------------------------------------------------------------- JSON values

NASTY = ["\ud800", "a\udfffb", "你好, 世界", "これは", "😀", "\x00", "\u2028\u2029", "\r\n", "é", "\ufeff", ""]
texts = st.one_of(st.sampled_from(NASTY), st.text(max_size=20))
json_leaf = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70), st.floats(), texts
)  # fmt: skip
json_value = st.recursive(
    json_leaf, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts, inner, max_size=3), max_leaves=8
)
# ids no request of rcoder's has (rcoder numbers its own from 0): invalid ones included
stray_ids = st.sampled_from([-1, 10**6, 2**63, 2**70, "x", "", "2", None, True, False, 0.5, [1], {"a": 1}, [], {}])
request_ids = st.one_of(stray_ids, st.integers(min_value=1000, max_value=10**9), st.uuids().map(str))

# --------------------------------------------------------------------------- messages


def rpc(**fields: Any) -> dict[str, Any]:
    return {"jsonrpc": "2.0", **fields}


content_blocks = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": texts}),
    st.fixed_dictionaries({"type": st.just("text"), "text": json_value}),
    st.fixed_dictionaries({"type": st.just("image"), "data": texts, "mimeType": texts}),
    st.fixed_dictionaries({"type": st.just("resource_link"), "uri": texts, "name": texts}),
    st.fixed_dictionaries({"type": texts}),
    json_value,
)
update_kinds = st.one_of(
    st.sampled_from([
        "agent_message_chunk", "agent_thought_chunk", "user_message_chunk", "tool_call", "tool_call_update",
        "plan", "available_commands_update", "current_mode_update", "config_option_update",
        "session_info_update", "usage_update", "future_kind", "",
    ]),
    json_value,
)  # fmt: skip
plan_entries = st.lists(
    st.fixed_dictionaries({
        "content": texts,
        "priority": st.sampled_from(["high", "low", "urgent"]),
        "status": st.sampled_from(["pending", "completed", 3]),
    }),
    max_size=3,
)  # fmt: skip
updates = st.one_of(
    st.fixed_dictionaries(
        {"sessionUpdate": update_kinds},
        optional={
            "content": content_blocks | st.lists(st.fixed_dictionaries({"type": st.just("content"),
                                                                        "content": content_blocks})),
            "toolCallId": texts | json_value,
            "title": texts | json_value,
            "kind": st.sampled_from(["read", "edit", "execute", "bogus"]),
            "status": st.sampled_from(["pending", "completed", "failed", "bogus"]),
            "locations": st.lists(st.fixed_dictionaries({"path": texts}), max_size=2) | json_value,
            "rawInput": json_value,
            "rawOutput": json_value,
            "entries": plan_entries | json_value,
            "used": st.integers() | json_value,
            "size": st.integers(),
        },
    ),
    json_value,
)  # fmt: skip
session_ids = st.one_of(st.just(SID), st.just(SID), texts, json_value)
update_notes = st.builds(
    lambda params: rpc(method="session/update", params=params),
    st.one_of(st.fixed_dictionaries({"sessionId": session_ids, "update": updates}), json_value),
)
permission_params = st.fixed_dictionaries({
    "sessionId": session_ids,
    "toolCall": st.fixed_dictionaries({"toolCallId": texts}, optional={"title": texts, "kind": texts}),
    "options": st.lists(
        st.fixed_dictionaries({
            "optionId": texts, "name": texts, "kind": st.sampled_from(["allow_once", "reject_once", "maybe"])
        }),
        max_size=3,
    ),
})  # fmt: skip
methods = st.one_of(
    st.sampled_from([
        "session/request_permission", "fs/read_text_file", "fs/write_text_file", "terminal/create",
        "terminal/output", "terminal/release", "terminal/wait_for_exit", "terminal/kill", "elicitation/create",
        "session/update", "initialize", "session/prompt", "$/cancel_request", "_ext/thing", "_", "unknown/method",
    ]),
    texts,
    json_value.filter(lambda v: v is not None),
)  # fmt: skip
request_params = st.one_of(
    permission_params,
    st.fixed_dictionaries({"sessionId": session_ids, "path": st.just("/etc/hostname")}),
    st.fixed_dictionaries({"sessionId": session_ids, "command": st.just("true")}),
    json_value,
)
requests = st.builds(lambda i, m, p: rpc(id=i, method=m, params=p), request_ids, methods, request_params)
other_notes = st.builds(
    lambda m, p: rpc(method=m, params=p),
    st.sampled_from(["_ext/note", "elicitation/complete", "$/cancel_request", "session/cancel", "what"]) | texts,
    json_value,
)
error_objects = st.one_of(
    st.fixed_dictionaries({"code": st.sampled_from([-32603, -32002, -32000, -32601, 7])},
                          optional={"message": texts | json_value, "data": json_value}),
    st.fixed_dictionaries({}, optional={"code": json_value, "message": json_value, "data": json_value}),
    json_value,
)  # fmt: skip
stray_responses = st.one_of(
    st.builds(lambda i, r: rpc(id=i, result=r), stray_ids, json_value),
    st.builds(lambda i, e: rpc(id=i, error=e), stray_ids, error_objects),
    st.builds(lambda i: rpc(id=i), stray_ids),
)
# a text chunk whose JSON holds a lone UTF-16 surrogate: valid JSON, but no UTF-8 encoder takes it
LONE_SURROGATE = (
    b'{"jsonrpc": "2.0", "method": "session/update", "params": {"sessionId": "' + SID.encode() + b'", "update": '
    b'{"sessionUpdate": "agent_message_chunk", "content": {"type": "text", "text": "\\ud800"}}}}\n'
)
RAW_LINES = [
    b"this is not json\n",
    b"\xff\xfe\xfd\n",
    b"\xc3\x28 invalid utf-8\n",
    "你好 世界 これは JSON ではありません\n".encode(),
    b'{"jsonrpc": "2.0"}{"trailing": 1}\n',
    b"[1, 2, 3]\n",
    b"null\n",
    b"42\n",
    b'"a string"\n',
    b'{"jsonrpc": "2.0", "method": "session/update", "params": {"sessionId": ',  # torn: no newline
    b"\n\n\r\n   \n",
    b"\x00\x00\x00\n",
    b'\xef\xbb\xbf{"jsonrpc": "2.0", "method": "_bom"}\n',
    b"[" * 100_000 + b"\n",  # deeper than the JSON decoder goes
    b'{"a": ' * 600 + b"1" + b"}" * 600 + b"\n",
    LONE_SURROGATE,
]

# --------------------------------------------------------------------------- actions


def send(message: Any, ascii_: bool = True) -> Action:
    return {"op": "send", "message": message, "ascii": ascii_}


def answer(body: dict[str, Any]) -> Action:
    return {"op": "answer", "body": body}


def raw(data: bytes) -> Action:
    return {"op": "bytes", "hex": data.hex()}


def line_bytes(action: Action) -> int:
    return int(action["size"]) * len(str(action["char"]).encode()) if action["op"] == "big" else 0


def noise_with(stderr_sizes: list[int]) -> st.SearchStrategy[Action]:
    """Whatever an agent may write beside its answers (``stderr_sizes``: its log floods)."""
    return st.one_of(
        st.builds(send, update_notes | stray_responses | other_notes | json_value, st.booleans()),
        st.builds(lambda m, w: {"op": "request", "message": m, "wait": WAIT if w else 0}, requests, st.booleans()),
        st.builds(lambda m, n: {"op": "repeat", "message": m, "count": n}, update_notes, st.sampled_from([100, 5_000])),
        st.builds(raw, st.sampled_from(RAW_LINES) | st.binary(max_size=40)),
        st.builds(
            lambda size, char, as_: {"op": "big", "size": size, "char": char, "as": as_},
            st.sampled_from([1_000, 70_000, 200_000]), st.sampled_from(["x", "界", "😀"]),
            st.sampled_from(["chunk", "raw"]),
        ),
        st.builds(lambda n: {"op": "stderr", "size": n}, st.sampled_from(stderr_sizes)),
    )  # fmt: skip


noise = noise_with([100, 70_000, 300_000])
# a start-up failure's status carries the stderr tail twice: over ~3 KiB of it is the known gap
# of test_a_start_failure_after_a_long_stderr_is_still_a_deliberate_status (at most 5 x 500 here)
startup_noise = noise_with([100, 500])
# what ends the agent's side of a turn without an answer (an exit, a closed stdout, an overlong line)
fatal: st.SearchStrategy[Action] = st.one_of(
    st.builds(lambda code: {"op": "exit", "code": code}, st.sampled_from([0, 1, 3, 137, 255])),
    st.just({"op": "close_stdout"}),
    st.just({"op": "big", "size": LINE_LIMIT + 100_000, "char": "x", "as": "chunk"}),
    st.just({"op": "big", "size": LINE_LIMIT + 100_000, "char": "x", "as": "raw"}),
)
valid_answers = st.builds(
    lambda stop, extra: answer({"result": {"stopReason": stop, **extra}}),
    st.sampled_from(sorted(STOP_REASONS)),
    st.fixed_dictionaries({}, optional={"_meta": st.dictionaries(texts, json_value, max_size=2),
                                        "usage": json_value, "unknownField": json_value}),
)  # fmt: skip
malformed_answers = st.one_of(
    st.builds(lambda s: answer({"result": {"stopReason": s}}), texts | json_value),
    st.builds(lambda r: answer({"result": r}), json_value),
    st.builds(lambda e: answer({"error": e}), error_objects),
    st.just(answer({})),
    st.just(answer({"result": {}})),
)


def ends_turn(action: Action) -> bool:
    return action["op"] in {"exit", "close_stdout", "hang", "deaf"} or line_bytes(action) >= LINE_LIMIT


# --------------------------------------------------------------------------- cases


@dataclass(frozen=True)
class Case:
    """A script and what rcoder must make of it."""

    script: dict[str, Any]
    opens: bool  # initialize and session/new are answered the valid way (noise around them allowed)
    resumes: bool  # session/resume (or load) is too, or says the session is gone (then a new one)
    stop: int  # the first turn's stop reason (ERROR: the script broke the turn)

    def ends_after_answering(self) -> bool:
        """Whether the agent ends its side (exits, closes stdout, overflows a line) after it
        answered the first prompt: rcoder may then still take it for live, and the next turn
        fail once (with a message) before the one after resumes."""
        first = self.script.get("prompts", {}).get("first", [])
        answered = [i for i, a in enumerate(first) if a["op"] == "answer"]
        return bool(answered) and any(ends_turn(a) for a in first[answered[0] :])

    def cuts_the_pipe(self) -> bool:
        """Whether the agent may stop reading or writing before a request it waits on is answered."""
        return any(ends_turn(a) for actions in self.phases() for a in actions)

    def phases(self) -> Iterator[list[Action]]:
        for key in ("initialize", "open", "resume"):
            if self.script.get(key):
                yield self.script[key]
        yield from self.script.get("prompts", {}).values()


def handshake(valid_result: st.SearchStrategy[Any], broken_extra: list[Action]) -> st.SearchStrategy[Any]:
    """(actions or None for the default, whether they answer the valid way) for one start-up request."""
    valid = st.builds(
        lambda before, result, after: ([*before, answer({"result": result}), *after], True),
        st.lists(startup_noise, max_size=3), valid_result, st.lists(startup_noise, max_size=2),
    )  # fmt: skip
    broken = st.builds(
        lambda before, end: ([*before, end], False),
        st.lists(startup_noise, max_size=2),
        st.one_of(malformed_answers, fatal, *([st.sampled_from(broken_extra)] if broken_extra else [])),
    )
    return st.one_of(st.just((None, True)), st.just((None, True)), st.just((None, True)), valid, broken)


capabilities = st.fixed_dictionaries(
    {},
    optional={
        "loadSession": st.booleans(),
        "sessionCapabilities": st.fixed_dictionaries({}, optional={"resume": st.just({}), "close": st.just({})}),
        "promptCapabilities": st.fixed_dictionaries({}, optional={"image": st.booleans()}),
    },
)
init_results = st.builds(
    lambda caps: {"protocolVersion": 1, "agentCapabilities": caps, "agentInfo": {"name": "fz", "version": "1"}},
    capabilities,
)
GONE = answer({"error": {"code": -32002, "message": "Resource not found"}})


@st.composite
def cases(draw: st.DrawFn, ending: st.SearchStrategy[Action] | None = None) -> Case:
    """A script: start-up requests mostly answered well, the first prompt fuzzed.

    ``ending``: what ends the first prompt instead of an answer or a fatal action (hang, deaf)."""
    script: dict[str, Any] = {"session_id": SID}
    init, init_ok = draw(handshake(init_results, [answer({"result": {"protocolVersion": 99}})]))
    opened, open_ok = draw(handshake(st.just({"sessionId": SID}), [answer({"result": {"sessionId": 5}})]))
    resumed, resume_ok = draw(st.one_of(handshake(st.just({}), []), st.just(([GONE], True))))
    for key, actions in (("initialize", init), ("open", opened), ("resume", resumed)):
        if actions is not None:
            script[key] = actions
    before = draw(st.lists(noise, max_size=6))
    end = draw(ending if ending is not None else st.one_of(valid_answers, valid_answers, malformed_answers, fatal))
    after = draw(st.lists(noise | valid_answers | malformed_answers, max_size=2))  # answers: the same id again
    script["prompts"] = {"first": [*before, end, *after]}
    return Case(script, init_ok and open_ok, resume_ok, answered_stop(end))


def answered_stop(end: Action) -> int:
    """The stop reason a prompt answered with ``end`` ends with: ERROR unless it is a valid
    answer (a result with a known stop reason; unknown fields are ignored, a bad usage dropped)."""
    result = end["body"].get("result") if end["op"] == "answer" else None
    if not isinstance(result, dict) or not isinstance(result.get("_meta", {}), dict | None):
        return ERROR
    stop = result.get("stopReason")
    return STOP_REASONS.get(stop, ERROR) if isinstance(stop, str) else ERROR

"""A scripted ACP agent that writes whatever its script says: the agent side of rcoder's fuzzing.

    python -S tests/fakes/fuzz_agent.py SCRIPT.json [RECORD.jsonl]

Standard library only, so it starts in a few tens of milliseconds (the ``acp`` SDK alone takes
~350 ms to import). It speaks just enough ACP to answer ``initialize``, ``session/new``,
``session/resume``/``session/load``, ``session/close`` and ``session/cancel`` the valid way, and
for each of those (and for every ``session/prompt``) the script may instead give a list of
actions, played in order while that request is the current one:

    {"op": "send", "message": ANY, "ascii": BOOL}  one line: the JSON of ANY (non-ASCII written as
                                                   UTF-8 when ascii is false; a lone surrogate then
                                                   becomes invalid UTF-8)
    {"op": "request", "message": ANY, "wait": S}    the same, then wait up to S seconds for the
                                                   response carrying message["id"] (recorded)
    {"op": "repeat", "message": ANY, "count": N}    that line N times, in one write (a flood)
    {"op": "bytes", "hex": HEX}                    these bytes as they are (no newline added)
    {"op": "big", "size": N, "char": C, "as": "chunk" | "raw"}
                                                   one line of N times C: an agent_message_chunk,
                                                   or bare text
    {"op": "stderr", "size": N}                    N bytes of log text on stderr
    {"op": "answer", "body": {...}}                {"jsonrpc": "2.0", "id": <the request's id>, ...body}
    {"op": "exit", "code": N}                      exit at once with code N
    {"op": "close_stdout"}                         stdout becomes /dev/null (the pipe closes)
    {"op": "hang"}                                 answer nothing any more; exit when stdin closes
    {"op": "deaf"}                                 as hang, and ignore stdin closing and SIGTERM

A line written after bytes that did not end one starts on a line of its own, so only the
bytes' own line is torn. The script file (JSON):

    {"session_id": "S", "caps": {...agentCapabilities},
     "initialize": [ACTION, ...], "open": [...], "resume": [...],
     "prompts": {"KEY": [...]}}

Every key is optional. A missing phase is answered the valid way; a prompt is looked up by
the last word of its text, and one not in ``prompts`` is answered with the text chunk
"KEY-ok" and ``end_turn``. The record file gets one JSON line per request received and per
awaited response (``{"pid", "event", ...}``).
"""

from __future__ import annotations

import json
import os
import queue
import signal
import sys
import threading
from typing import Any, NoReturn

DEFAULT_CAPS: dict[str, Any] = {"loadSession": False, "sessionCapabilities": {"resume": {}, "close": {}}}
STOP = object()  # queued when stdin closes


class Agent:
    def __init__(self, script: dict[str, Any], record: str | None) -> None:
        self.script = script
        self.record_path = record
        self.session_id = str(script.get("session_id", "fuzz-session"))
        self.inbox: queue.Queue[Any] = queue.Queue()
        self.responses: dict[str, Any] = {}
        self.answered = threading.Condition()
        self.deaf = False
        self.hung = False
        self.line_open = False  # the last bytes written did not end a line
        self.out = 1

    # ---------------------------------------------------------------- output

    def write(self, data: bytes, *, line: bool = False) -> None:
        if line and self.line_open:
            data = b"\n" + data
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(self.out, view) :]
        except OSError:  # rcoder stopped reading: nothing more can reach it
            self.out = os.open(os.devnull, os.O_WRONLY)
        if data:
            self.line_open = not data.endswith(b"\n")

    def send(self, message: Any, ascii: bool = True) -> None:
        text = json.dumps(message, ensure_ascii=ascii)
        self.write(text.encode("utf-8", "surrogatepass") + b"\n", line=True)

    def record(self, **fields: Any) -> None:
        if self.record_path:
            with open(self.record_path, "a", encoding="utf-8") as f:
                f.write(json.dumps({"pid": os.getpid(), **fields}) + "\n")

    # ---------------------------------------------------------------- input

    def read_stdin(self) -> None:
        for raw in sys.stdin.buffer:
            try:
                message = json.loads(raw)
            except ValueError:
                continue
            if isinstance(message, dict) and "method" not in message and "id" in message:
                with self.answered:
                    self.responses[json.dumps(message["id"], sort_keys=True)] = message
                    self.answered.notify_all()
            else:
                self.inbox.put(message)
        self.inbox.put(STOP)

    def wait_response(self, request_id: Any, timeout: float) -> Any:
        key = json.dumps(request_id, sort_keys=True)
        with self.answered:
            self.answered.wait_for(lambda: key in self.responses, timeout)
            return self.responses.pop(key, None)

    # ---------------------------------------------------------------- requests

    def serve(self) -> None:
        while True:
            message = self.inbox.get()
            if message is STOP:
                if self.deaf:
                    threading.Event().wait()  # only SIGKILL ends this
                os._exit(0)
            if not isinstance(message, dict) or self.hung:
                continue
            method, rid = message.get("method"), message.get("id")
            self.record(event="received", method=method, id=rid)
            params = message.get("params")
            params = params if isinstance(params, dict) else {}
            if method == "initialize":
                default = {"protocolVersion": 1, "agentCapabilities": self.script.get("caps", DEFAULT_CAPS),
                           "agentInfo": {"name": "fuzz-agent", "version": "0"}}  # fmt: skip
                self.phase(self.script.get("initialize"), rid, {"result": default})
            elif method == "session/new":
                self.phase(self.script.get("open"), rid, {"result": {"sessionId": self.session_id}})
            elif method in {"session/resume", "session/load"}:
                self.phase(self.script.get("resume"), rid, {"result": {}})
            elif method == "session/prompt":
                self.prompt(rid, params)
            elif method == "session/close":
                self.send({"jsonrpc": "2.0", "id": rid, "result": {}})
            elif "id" in message and method != "session/cancel":
                error = {"code": -32601, "message": "Method not found", "data": {"method": method}}
                self.send({"jsonrpc": "2.0", "id": rid, "error": error})

    def prompt(self, rid: Any, params: dict[str, Any]) -> None:
        blocks = params.get("prompt")
        blocks = blocks if isinstance(blocks, list) else []
        text = " ".join(b.get("text", "") for b in blocks if isinstance(b, dict) and isinstance(b.get("text"), str))
        key = text.split()[-1] if text.split() else ""
        actions = self.script.get("prompts", {}).get(key)
        if actions is None:
            chunk = {"sessionUpdate": "agent_message_chunk", "content": {"type": "text", "text": f"{key}-ok"}}
            self.send({"jsonrpc": "2.0", "method": "session/update",
                       "params": {"sessionId": self.session_id, "update": chunk}})  # fmt: skip
            actions = [{"op": "answer", "body": {"result": {"stopReason": "end_turn"}}}]
        self.phase(actions, rid, None)

    def phase(self, actions: list[dict[str, Any]] | None, rid: Any, default: dict[str, Any] | None) -> None:
        if actions is None:
            actions = [{"op": "answer", "body": default}]
        for action in actions:
            self.act(action, rid)
            if self.hung:
                return

    # ---------------------------------------------------------------- actions

    def act(self, action: dict[str, Any], rid: Any) -> None:
        op = action["op"]
        if op == "send":
            self.send(action["message"], action.get("ascii", True))
        elif op == "request":
            message = action["message"]
            self.send(message)
            if action.get("wait") and isinstance(message, dict) and "id" in message:
                response = self.wait_response(message["id"], float(action["wait"]))
                self.record(event="response" if response is not None else "no_response",
                            id=message["id"], method=message.get("method"), response=response)  # fmt: skip
        elif op == "repeat":
            line = json.dumps(action["message"]).encode() + b"\n"
            self.write(line * action["count"], line=True)
        elif op == "bytes":
            self.write(bytes.fromhex(action["hex"]))
        elif op == "big":
            body = action["char"] * action["size"]
            if action["as"] == "chunk":
                chunk = {"sessionUpdate": "agent_message_chunk", "content": {"type": "text", "text": body}}
                self.send({"jsonrpc": "2.0", "method": "session/update",
                           "params": {"sessionId": self.session_id, "update": chunk}}, ascii=False)  # fmt: skip
            else:
                self.write(body.encode() + b"\n", line=True)
        elif op == "stderr":
            os.write(2, (b"fuzz agent log line\n" * (action["size"] // 20 + 1))[: action["size"]])
        elif op == "answer":
            self.send({"jsonrpc": "2.0", "id": rid, **action["body"]})
        elif op == "exit":
            os._exit(action["code"])
        elif op == "close_stdout":
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, 1)
            os.close(null)
        elif op in {"hang", "deaf"}:
            self.hung = True
            if op == "deaf":
                self.deaf = True
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
        else:
            raise ValueError(f"unknown op {op!r}")


def main() -> NoReturn:
    with open(sys.argv[1], encoding="utf-8") as f:
        script = json.load(f)
    agent = Agent(script, sys.argv[2] if len(sys.argv) > 2 else None)
    threading.Thread(target=agent.read_stdin, daemon=True).start()
    agent.serve()
    raise AssertionError("serve() returned")


if __name__ == "__main__":
    main()

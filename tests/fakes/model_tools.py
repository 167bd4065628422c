"""Tool calls the fake model APIs make when a prompt asks for them: each agent's own file and shell tools.

A user message holding ``rcoder-tools: <JSON list of steps>`` (see :func:`tools_prompt`) makes
the fake model answer each request of that turn with the next step as a call of the agent's own
tool, and the request after the last step with :data:`DONE` text. A step is counted as made
once the conversation the agent sends carries its call (the agent adds the result beside it),
so the fake answers step by step, whether or not a tool succeeded.

The tools, by name and argument shape, as each agent offers them to its model (read from the
``tools`` of the recorded requests; pinned versions in ``docs/configuration.md`` (the built-in profiles)):

* Claude Code (``claude``, ``claude-legacy``), Anthropic ``tool_use``: ``Write {file_path,
  content}``, ``Edit {file_path, old_string, new_string}``, ``Read {file_path}``, ``Bash
  {command, description}``.
* Codex, Responses API: ``apply_patch``, a ``custom`` tool (a ``custom_tool_call`` whose
  ``input`` is the patch text, ``*** Begin Patch`` … ``*** End Patch``, grammar in its tool
  definition); ``exec_command``, a ``function_call`` with arguments ``{"cmd": "<string>"}``.
  Codex has no file-read tool: reading is ``exec_command`` with ``cat``.
* Gemini CLI, ``functionCall``: ``write_file {file_path, content}``, ``replace {file_path,
  instruction, old_string, new_string}``, ``read_file {file_path}``, ``run_shell_command
  {command, description}``.
* OpenCode, chat-completions ``tool_calls``: ``write {filePath, content}``, ``edit {filePath,
  oldString, newString}``, ``read {filePath}``, ``bash {command, description}``.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import asdict, dataclass
from typing import Any, Literal

DIRECTIVE = "rcoder-tools:"
DONE = "tools done"
_DIRECTIVE = re.compile(re.escape(DIRECTIVE) + r"\s*(\[.*\])", re.DOTALL)

Op = Literal["write", "edit", "read", "run"]


@dataclass(frozen=True)
class Step:
    """One tool call: ``write`` (path, content), ``edit`` (path, old, new), ``read`` (path), ``run``
    (command; ``wait_ms``: how long Codex waits for it before answering "still running", else its 10 s)."""

    op: Op
    path: str = ""
    content: str = ""
    old: str = ""
    new: str = ""
    command: str = ""
    wait_ms: int = 0


def write(path: str, content: str) -> Step:
    return Step("write", path=path, content=content)


def edit(path: str, old: str, new: str) -> Step:
    return Step("edit", path=path, old=old, new=new)


def read(path: str) -> Step:
    return Step("read", path=path)


def run(command: str, wait_ms: int = 0) -> Step:
    return Step("run", command=command, wait_ms=wait_ms)


def tools_prompt(*steps: Step, intro: str = "Please do this.") -> str:
    """A prompt that makes the fake model call these tools, in order."""
    return f"{intro}\n{DIRECTIVE} {json.dumps([asdict(s) for s in steps])}"


def steps_in(text: str) -> list[Step] | None:
    """The steps a user text asks for, or None when it asks for none."""
    match = _DIRECTIVE.search(text)
    if not match:
        return None
    return [Step(**item) for item in json.loads(match.group(1))]


def done_text(calls: int) -> str:
    return f"{DONE} after {calls} tool calls"


# ---------------------------------------------------------------------------
# Each agent's own tools


def anthropic_call(step: Step) -> tuple[str, dict[str, Any]]:
    """Claude Code's tool for ``step``: name and input."""
    if step.op == "write":
        return "Write", {"file_path": step.path, "content": step.content}
    if step.op == "edit":
        return "Edit", {"file_path": step.path, "old_string": step.old, "new_string": step.new}
    if step.op == "read":
        return "Read", {"file_path": step.path}
    return "Bash", {"command": step.command, "description": "Run the command"}


def gemini_call(step: Step) -> tuple[str, dict[str, Any]]:
    """Gemini CLI's tool for ``step``: name and args."""
    if step.op == "write":
        return "write_file", {"file_path": step.path, "content": step.content}
    if step.op == "edit":
        args = {"file_path": step.path, "old_string": step.old, "new_string": step.new}
        return "replace", {**args, "instruction": "Change the text as asked."}
    if step.op == "read":
        return "read_file", {"file_path": step.path}
    return "run_shell_command", {"command": step.command, "description": "Run the command"}


def opencode_call(step: Step) -> tuple[str, dict[str, Any]]:
    """OpenCode's tool for ``step``: name and arguments."""
    if step.op == "write":
        return "write", {"filePath": step.path, "content": step.content}
    if step.op == "edit":
        return "edit", {"filePath": step.path, "oldString": step.old, "newString": step.new}
    if step.op == "read":
        return "read", {"filePath": step.path}
    return "bash", {"command": step.command, "description": "Run the command"}


def codex_call(step: Step) -> tuple[str, str]:
    """Codex's tool for ``step``: ``("apply_patch", <patch text>)`` or ``("exec_command", <JSON arguments>)``."""
    if step.op == "write":
        lines = "".join(f"+{line}\n" for line in step.content.splitlines())
        return "apply_patch", f"*** Begin Patch\n*** Add File: {step.path}\n{lines}*** End Patch\n"
    if step.op == "edit":
        old = "".join(f"-{line}\n" for line in step.old.splitlines())
        new = "".join(f"+{line}\n" for line in step.new.splitlines())
        return "apply_patch", f"*** Begin Patch\n*** Update File: {step.path}\n@@\n{old}{new}*** End Patch\n"
    command = f"cat {shlex.quote(step.path)}" if step.op == "read" else step.command
    wait = {"yield_time_ms": step.wait_ms} if step.wait_ms else {}
    return "exec_command", json.dumps({"cmd": command, **wait})


def next_step(user_texts_and_calls: list[tuple[str, int]]) -> tuple[list[Step], int] | None:
    """From a conversation reduced to ``(user text, tool calls after it)`` entries: the steps the
    last directive asked for and how many calls the model made since, or None without one."""
    for index in range(len(user_texts_and_calls) - 1, -1, -1):
        steps = steps_in(user_texts_and_calls[index][0])
        if steps is not None:
            return steps, sum(calls for _, calls in user_texts_and_calls[index:])
    return None


def planned(turns: list[tuple[str, int]]) -> tuple[Step | None, str | None]:
    """What a tool directive in the conversation asks for now: the next step, or the final text
    once every step was called; ``(None, None)`` without a directive (see tests.fakes.model_tools)."""
    plan = next_step(turns)
    if plan is None:
        return None, None
    steps, made = plan
    return (steps[made], None) if made < len(steps) else (None, done_text(made))

"""The turn's state machine has one driver, and every result of it is acted on: only the runner
calls ``TurnMachine.handle``, and never drops what it returns (docs/design/turn.md#the-parts).
The runner performs the actions that can follow the events it tells, itself or through the
ender's steps, and raises on any other, so a new action the machine learns to return cannot go
unperformed unnoticed."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast  # starts no process: `make check` (tests/process_guard.py)

PACKAGE = Path(__file__).resolve().parent.parent.parent / "rcoder"
# the machine's one driver: the only module that tells it anything
DRIVER = PACKAGE / "session" / "turns" / "runner.py"


def told(tree: ast.AST) -> list[int]:
    """Lines where ``<...>machine.handle(...)`` is called, its result used or not."""
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "handle"
        and ast.unparse(node.func.value).endswith("machine")
    ]


def dropped(tree: ast.AST) -> list[int]:
    """Lines where ``<...>machine.handle(...)`` is a statement of its own: its actions dropped."""
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Call)
        and isinstance(node.value.func, ast.Attribute)
        and node.value.func.attr == "handle"
        and ast.unparse(node.value.func.value).endswith("machine")
    ]


def test_no_caller_drops_what_the_turn_machine_returns() -> None:
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{line}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for line in dropped(ast.parse(path.read_text()))
    ]
    assert not found, "the machine's actions are performed, or it returns none:\n" + "\n".join(found)


def test_only_the_runner_tells_the_turn_machine_anything() -> None:
    assert told(ast.parse(DRIVER.read_text())), "the runner tells the machine what happened"
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{line}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path != DRIVER
        for line in told(ast.parse(path.read_text()))
    ]
    assert not found, "only the runner drives the turn's machine (session/turns/runner.py):\n" + "\n".join(found)


def test_the_walker_finds_a_dropped_result_and_passes_a_used_one() -> None:
    source = (
        "def f(scope, machine):\n"
        "    scope.machine.handle(Started())\n"
        "    machine.handle(Begin())\n"
        "    for action in scope.machine.handle(Begin()):\n"
        "        pass\n"
        "    actions = scope.machine.handle(Started())\n"
        "    handler.handle(x)\n"
    )
    assert dropped(ast.parse(source)) == [2, 3]
    assert told(ast.parse(source)) == [2, 3, 4, 6]

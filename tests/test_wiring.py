"""Wiring in one place: collaborators are built in ``rcoder/daemon.py`` and passed in constructors,
and no callback is assigned after construction.

Read with ``ast``, like the layer test: every assignment to an attribute named ``on_*`` outside an
``__init__`` is a callback set after construction, and every call of one of the daemon's
collaborator classes (or of a constructor of theirs, such as ``LeaseKeeper.local``) outside
``rcoder/daemon.py`` is a collaborator built somewhere else. Each finding is named by file and line.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast  # starts no process: `make check` (tests/process_guard.py)

PACKAGE = Path(__file__).resolve().parent.parent / "rcoder"
GENERATED = PACKAGE / "v1"
COMPOSITION_ROOT = PACKAGE / "daemon.py"

# the classes only the composition root builds
COLLABORATORS = frozenset(
    {
        "TurnIntake",
        "AgentPool",
        "Checkpoints",
        "ClaimedTurns",
        "DiskGuard",
        "History",
        "LeaseKeeper",
        "RunRegistry",
        "SessionEraser",
        "SessionForker",
        "SessionHolds",
        "SessionRewinder",
        "SpendGuard",
        "TurnQueues",
        "TurnRunner",
        "TurnTasks",
    }
)


def sources() -> Iterator[tuple[Path, ast.Module]]:
    for path in sorted(PACKAGE.rglob("*.py")):
        if GENERATED not in path.parents:
            yield path, ast.parse(path.read_text(), filename=str(path))


def where(path: Path, node: ast.AST) -> str:
    return f"{path.relative_to(PACKAGE.parent)}:{getattr(node, 'lineno', 0)}"


def attribute_targets(target: ast.expr) -> Iterator[ast.Attribute]:
    """The attributes an assignment target writes, through tuples and lists (``a.x, b.y = ...``)."""
    if isinstance(target, ast.Attribute):
        yield target
    elif isinstance(target, ast.Tuple | ast.List):
        for element in target.elts:
            yield from attribute_targets(element)
    elif isinstance(target, ast.Starred):
        yield from attribute_targets(target.value)


class CallbackAssignments(ast.NodeVisitor):
    """``x.on_y = ...`` (also ``+=`` and annotated) outside ``__init__``."""

    def __init__(self) -> None:
        self.found: list[ast.Attribute] = []
        self._functions: list[str] = []

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self._functions.append(node.name)
        self.generic_visit(node)
        self._functions.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def _targets(self, targets: list[ast.expr]) -> None:
        if self._functions and self._functions[-1] == "__init__":
            return
        for target in targets:
            self.found += [a for a in attribute_targets(target) if a.attr.startswith("on_")]

    def visit_Assign(self, node: ast.Assign) -> None:
        self._targets(node.targets)
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self._targets([node.target])
        self.generic_visit(node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        if node.value is not None:
            self._targets([node.target])
        self.generic_visit(node)


def callback_assignments(module: ast.Module) -> list[ast.Attribute]:
    visitor = CallbackAssignments()
    visitor.visit(module)
    return visitor.found


def constructions(module: ast.Module) -> Iterator[tuple[ast.Call, str]]:
    """Calls of a collaborator class, by name or attribute (``Checkpoints(...)``,
    ``history.History(...)``), or of a constructor of one (``LeaseKeeper.local(...)``)."""
    for node in ast.walk(module):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Name) and func.id in COLLABORATORS:
            yield node, func.id
        elif isinstance(func, ast.Attribute):
            if func.attr in COLLABORATORS:
                yield node, func.attr
            elif isinstance(func.value, ast.Name) and func.value.id in COLLABORATORS:
                yield node, f"{func.value.id}.{func.attr}"


def test_no_callback_is_assigned_after_construction() -> None:
    found = [
        where(path, node) + f" sets .{node.attr}" for path, module in sources() for node in callback_assignments(module)
    ]
    assert not found, "callbacks are passed to constructors, never assigned afterwards:\n" + "\n".join(found)


def test_collaborators_are_built_only_in_the_daemon() -> None:
    found = [
        where(path, call) + f" builds {name}"
        for path, module in sources()
        if path != COMPOSITION_ROOT
        for call, name in constructions(module)
    ]
    assert not found, "collaborators are built in rcoder/daemon.py and passed in:\n" + "\n".join(found)


def test_the_checks_find_what_they_forbid() -> None:
    """Each check fails on the code it is there to keep out."""
    module = ast.parse(
        "class Runner:\n"
        "    def __init__(self, pool):\n"
        "        self.on_done = None\n"  # in __init__: the constructor's own
        "        self.guard = DiskGuard(pool)\n"
        "    def start(self, conn):\n"
        "        conn.on_active, self.x = print, 1\n"
        "        keeper = LeaseKeeper.local(1.0)\n"
        "        return history.History(keeper)\n"
    )
    assert [(node.attr, node.lineno) for node in callback_assignments(module)] == [("on_active", 6)]
    assert [(name, call.lineno) for call, name in constructions(module)] == [
        ("DiskGuard", 4),
        ("LeaseKeeper.local", 7),
        ("History", 8),
    ]

"""The design pages say what the code has, read from the code: docs/design/index.md names every
RPC of the proto, and docs/design/turn.md's table of parts names every part the turn's intake and
runner are given, each at the module that holds it (docs/design/turn.md#the-parts)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast  # starts no process: `make check` (tests/process_guard.py)

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "rcoder"
PROTO = ROOT / "proto" / "rcoder" / "v1" / "agent_runner.proto"
INDEX = ROOT / "docs" / "design" / "index.md"
TURN = ROOT / "docs" / "design" / "turn.md"
# the classes whose constructors take the turn's parts
TAKERS = {"TurnIntake", "IntakeParts", "TurnRunner", "TurnSteps"}


def rpcs() -> set[str]:
    return set(re.findall(r"^\s*rpc (\w+)\(", PROTO.read_text(), re.M))


def section(text: str, heading: str) -> str:
    start = text.index(heading)
    end = text.find("\n## ", start + len(heading))
    return text[start : end if end != -1 else len(text)]


def named(text: str) -> set[str]:
    return set(re.findall(r"`(\w+)`", text))


def table(text: str) -> list[tuple[set[str], list[str]]]:
    """The parts table's rows: (the classes named in its first cell, the modules in its second)."""
    rows = []
    for line in section(text, "## The parts").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and cells[0].startswith("`"):
            rows.append((named(cells[0]), re.findall(r"`([\w/.]+)`", cells[1])))
    return rows


def classes_in(path: str) -> set[str]:
    """The classes defined in the module (``x.py``) or package (``x/``) at ``rcoder/<path>``."""
    target = PACKAGE / path
    files = sorted(target.rglob("*.py")) if path.endswith("/") else [target]
    return {node.name for file in files for node in ast.parse(file.read_text()).body if isinstance(node, ast.ClassDef)}


def engine_classes() -> set[str]:
    """Every class of the session and agent packages."""
    return {name for package in ("session/", "agent/") for name in classes_in(package)}


def given_parts() -> set[str]:
    """The engine classes the turn's intake and runner are given: their constructors' parameters
    and their parts' fields, by annotation."""
    engine = engine_classes()
    found: set[str] = set()
    for file in sorted((PACKAGE / "session").rglob("*.py")):
        for node in ast.parse(file.read_text()).body:
            if not (isinstance(node, ast.ClassDef) and node.name in TAKERS):
                continue
            annotations: list[ast.expr] = []
            for item in node.body:
                if isinstance(item, ast.AnnAssign):
                    annotations.append(item.annotation)
                elif isinstance(item, ast.FunctionDef) and item.name == "__init__":
                    annotations += [a.annotation for a in item.args.args if a.annotation is not None]
            for annotation in annotations:
                found |= set(re.findall(r"\w+", ast.unparse(annotation))) & engine
    return found - TAKERS


def test_the_design_index_names_every_rpc_of_the_proto() -> None:
    assert len(rpcs()) >= 18
    missing = rpcs() - named(section(INDEX.read_text(), "## The gRPC contract"))
    assert not missing, f"docs/design/index.md's gRPC contract leaves out {sorted(missing)}"


def test_each_row_of_the_parts_table_names_classes_its_module_holds() -> None:
    rows = table(TURN.read_text())
    assert len(rows) >= 10
    for classes, modules in rows:
        held = set().union(*(classes_in(m) for m in modules))
        assert classes <= held, f"{sorted(classes - held)} are not in {modules} (docs/design/turn.md)"


def test_the_parts_table_lists_every_part_the_intake_and_the_runner_are_given() -> None:
    given = given_parts()
    assert {"SessionOpener", "TurnEnder", "LiveSessions", "History", "AgentPool"} <= given
    listed = set().union(*(classes for classes, _ in table(TURN.read_text())))
    assert not given - listed, f"docs/design/turn.md's parts table leaves out {sorted(given - listed)}"


def test_the_readers_find_what_a_page_leaves_out() -> None:
    page = (
        "## The parts\n\n| part | module | job |\n|---|---|---|\n"
        "| `TurnRunner`, `Nowhere` | `session/turns/runner.py` | x |\n"
    )
    [(classes, modules)] = table(page)
    assert classes == {"TurnRunner", "Nowhere"} and modules == ["session/turns/runner.py"]
    assert "Nowhere" not in classes_in("session/turns/runner.py")
    assert "ListFiles" not in named(
        section("## The gRPC contract\n`Chat`, `Cancel`\n## Next\n`ListFiles`", "## The gRPC contract")
    )

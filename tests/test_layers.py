"""Imports flow one way: api → session → agent, store → config, domain, errors."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "rcoder"

# which rcoder packages each layer may import
ALLOWED = {
    "api": {"api", "session", "domain", "errors", "logs", "v1", "config"},
    "session": {"session", "agent", "store", "domain", "errors", "logs", "config", "metrics"},
    "agent": {"agent", "domain", "errors", "logs", "config"},
    "store": {"store", "domain", "errors", "logs"},
    "domain": set(),
    "errors": set(),
    "config": {"domain", "errors"},
    "metrics": set(),
    # beside the daemon: a gRPC client of it (the generated stubs only) and an ACP agent it runs
    "client_cli": {"v1"},
    "echo_agent": set(),
}
# third-party packages only these layers may import
EDGES = {
    "grpc": {"api", "client_cli"},
    "acp": {"agent", "echo_agent"},
    "sqlite3": {"store"},
    "prometheus_client": {"metrics"},
}


def imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def layer_of(path: Path) -> str:
    rel = path.relative_to(PACKAGE)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


SOURCES = [p for p in PACKAGE.rglob("*.py") if "v1" not in p.relative_to(PACKAGE).parts]


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_each_module_imports_only_what_its_layer_may(path: Path) -> None:
    layer = layer_of(path)
    for name in imports(path):
        top = name.split(".")[0]
        if top == "rcoder" and layer in ALLOWED:
            sub = name.split(".")[1] if "." in name else ""
            assert not sub or sub in ALLOWED[layer] or sub == "__init__", f"{layer} must not import {name}"
        if top in EDGES:
            assert layer in EDGES[top], f"only {sorted(EDGES[top])} may import {top}; {path.name} does"

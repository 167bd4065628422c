"""Imports flow one way: api → session → agent, store → config, domain, errors.

Every import is read with ``ast``, whatever its spelling: ``import rcoder.x``,
``from rcoder.x import y``, ``from rcoder import x`` and relative imports, which
are resolved to the absolute module they name (as Python itself does) and
checked like any other. Resolving rather than forbidding them keeps this test
about the dependency graph alone; how an import is spelled is a lint question.
"""

from __future__ import annotations

import ast
from importlib.util import resolve_name
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast  # starts no process: `make check` (tests/process_guard.py)

PACKAGE = Path(__file__).resolve().parent.parent / "rcoder"
ROOT = "__init__"  # the layer of the package itself (``rcoder/__init__.py``: ``__version__``)

# which rcoder layers (top-level modules and packages) each layer may import
ALLOWED: dict[str, set[str]] = {
    "api": {"api", "session", "domain", "errors", "logs", "v1", "config", "tracing"},
    "session": {"session", "agent", "store", "domain", "errors", "logs", "config", "metrics", "tracing"},
    "agent": {"agent", "domain", "errors", "logs", "config", "landlock", "tracing", ROOT},
    "store": {"store", "domain", "errors", "logs"},
    # `rcoder relay` (docs/relay.md): a gRPC edge of its own, in a process of its own, spawning agents as
    # the daemon does; its generated code (rcoder/relay/v1) is part of it
    # its checkpoint stores too, with the store's git code (docs/relay.md#files-and-checkpoints)
    "relay": {"relay", "agent", "store", "domain", "errors", "logs", "landlock", "data_lock", ROOT},
    "domain": set(),
    "errors": set(),
    "config": {"config_types", "config_groups", "domain", "errors", "builtin_agents", "landlock", "addresses"},
    "addresses": set(),  # what a host:port says of its host (loopback or not): stdlib only
    "config_groups": set(),  # which table of the file holds each setting, and the flat names still read
    "config_types": {"errors"},  # the schema's value types, and pydantic's errors as ConfigError
    "builtin_agents": set(),  # the profiles rcoder ships, as plain tables
    "landlock": set(),  # the kernel's Landlock, and the exec wrapper that confines agents (stdlib only)
    "logs": set(),
    "data_lock": {"errors"},  # one daemon per data_dir: a flock, stdlib only
    "metrics": {"domain"},
    "tracing": {"logs", ROOT},  # OpenTelemetry: spans and W3C trace context, for every layer that makes spans
    ROOT: set(),
    # generated from the proto: its messages and stubs only
    "v1": {"v1"},
    # argv → Settings → serve / chat; `daemon` is imported late, by `serve` only
    "cli": {
        "cli",
        "config",
        "errors",
        "logs",
        "client_args",
        "client_cli",
        "files_cli",
        "runs_cli",
        "client",
        "health_check",
        "daemon",
        "relay",
        ROOT,
    },
    "__main__": {"cli"},
    # beside the daemon: the Python client of it (the generated stubs only), the CLI made on that
    # client, and an ACP agent it runs
    "client": {"client", "v1", "addresses"},
    "client_cli": {"client", "client_args"},
    "files_cli": {"client", "client_cli"},  # `rcoder files`: the client's file calls, with chat's output
    "runs_cli": {"client", "client_cli"},  # `rcoder runs|diff|rewind|fork|cancel|attach`, with chat's output
    "client_args": set(),  # the client commands' arguments: stdlib only, as `rcoder serve` parses them too
    "echo_agent": {"agent"},
    # `rcoder health`: the daemon's grpc.health.v1 on its own port (the image's HEALTHCHECK)
    "health_check": set(),  # rcoder.agent.acp.sdk alone: the SDK imported quickly, as the daemon does
}
# the composition root builds every layer and wires them together
ALLOWED["daemon"] = {*ALLOWED, "daemon"}

# third-party packages only these layers may import
EDGES = {
    "grpc": {"api", "client", "v1", "health_check", "relay"},
    "grpc_health": {"api", "health_check"},
    "grpc_reflection": {"api"},
    "grpc_status": {"api", "client", "relay"},
    "google": {"api", "client", "v1", "relay"},  # protobuf: the generated code and its converters
    "acp": {"agent", "echo_agent"},
    "sqlite3": {"store"},
    "psycopg": {"store"},  # PostgreSQL: the shared store, its leases and hosts
    "psycopg_pool": {"store"},
    "prometheus_client": {"metrics"},
    "structlog": {"logs"},
    "opentelemetry": {"tracing"},
    "jwt": {"api"},  # PyJWT: scoped clients' bearer tokens (rcoder/api/jwt_tokens.py)
    # PyJWT's RSA, EC and Ed25519 keys (api); a TCP relay's self-signed certificate (relay.relay_cert)
    "cryptography": {"api", "relay"},
}

# Inside a layer, which of its sub-packages each may import ("." is the layer's own modules, which
# put its sub-packages together). The agent's are in an order: processes → confinement →
# profiles → acp, files. The session's turns, hosts, resume, guards and sessions still import each
# other both ways, through what one session's state is spread over (docs/design/turn.md#the-parts):
# the table holds what is, so that no new edge comes in unnoticed, until the session's owner
# takes that state into one place.
SUBLAYERS: dict[str, dict[str, set[str]]] = {
    "agent": {
        ".": {".", "processes", "confinement", "profiles", "acp", "files"},
        "processes": {"processes", "confinement"},
        "confinement": {"confinement", "profiles", "files"},
        "profiles": {"profiles", "acp", "files"},
        "acp": {"acp"},
        "files": {"files"},
    },
    "session": {
        ".": {".", "turns", "resume", "runs", "sessions", "files", "hosts", "guards"},
        "turns": {"turns", "guards", "hosts", "resume", "runs", "sessions"},
        "sessions": {"sessions", "hosts", "resume", "runs", "turns"},
        "resume": {"resume", "hosts", "turns"},
        "hosts": {"hosts", "runs", "turns"},
        "guards": {"guards", "turns"},
        "files": {"files", "runs"},
        "runs": {"runs"},
    },
}

LAYERS = {p.stem for p in PACKAGE.glob("*.py")} | {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
SUBPACKAGES = {layer: {p.parent.name for p in (PACKAGE / layer).glob("*/__init__.py")} for layer in SUBLAYERS}
SOURCES = sorted(PACKAGE.rglob("*.py"))


def module_of(path: Path) -> tuple[str, str]:
    """The dotted name of the module at ``path`` and the package its relative imports start from."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    if parts[-1] == "__init__":
        name = ".".join(parts[:-1])
        return name, name
    return ".".join(parts), ".".join(parts[:-1])


def layer_of(module: str) -> str:
    """The layer of the module named ``module`` (``rcoder`` itself: the root)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ROOT


def sublayer_of(name: str) -> str:
    """The sub-package of its layer the module or name ``name`` is in ("." for the layer's own)."""
    parts = name.split(".")
    layer = layer_of(name)
    return parts[2] if len(parts) > 2 and parts[2] in SUBPACKAGES.get(layer, set()) else "."


def target_layer(name: str) -> str:
    """The layer an imported ``rcoder`` name belongs to; a name that is no module is an attribute of the root."""
    layer = layer_of(name)
    return layer if layer in LAYERS else ROOT


def imported(source: str, package: str) -> set[str]:
    """Absolute names of what ``source`` (in ``package``) imports, anywhere in it (functions too).

    ``from a import b`` yields ``a.b``: ``b`` may be a module of ``a`` (``from rcoder import errors``)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = resolve_name("." * node.level + (node.module or ""), package) if node.level else node.module
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def violations(source: str, module: str, package: str) -> list[str]:
    """What in ``source``, the module ``module`` of ``package``, breaks the layering (empty: nothing)."""
    layer = layer_of(module)
    if layer not in ALLOWED:
        return [f"layer {layer!r} ({module}) has no entry in ALLOWED"]
    try:
        names = imported(source, package)
    except ImportError as exc:  # a relative import climbing out of rcoder
        return [f"{module}: {exc}"]
    found = []
    for name in sorted(names):
        top = name.split(".")[0]
        if top == "rcoder" and target_layer(name) not in ALLOWED[layer]:
            found.append(f"{layer} must not import {name}")
        elif top == "rcoder" and layer in SUBLAYERS and target_layer(name) == layer:
            here, there = sublayer_of(module), sublayer_of(name)
            if there not in SUBLAYERS[layer][here]:
                found.append(f"{layer}.{here} must not import {name}")
        if top in EDGES and layer not in EDGES[top]:
            found.append(f"only {sorted(EDGES[top])} may import {top}; {module} does")
    return found


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_each_module_imports_only_what_its_layer_may(path: Path) -> None:
    module, package = module_of(path)
    assert violations(path.read_text(), module, package) == []


def test_every_layer_has_an_entry_naming_only_layers_that_exist() -> None:
    assert set(ALLOWED) == LAYERS
    for layer, allowed in ALLOWED.items():
        assert allowed <= LAYERS, f"{layer} allows layers that do not exist: {sorted(allowed - LAYERS)}"


def test_every_sub_package_has_an_entry_naming_only_sub_packages_that_exist() -> None:
    for layer, table in SUBLAYERS.items():
        assert set(table) == SUBPACKAGES[layer] | {"."}, f"the sub-packages of {layer} and SUBLAYERS differ"
        for sub, allowed in table.items():
            assert sub in allowed and allowed <= set(table), f"{layer}.{sub}: {sorted(allowed)}"


@pytest.mark.parametrize(
    ("module", "source", "found"),
    [
        ("rcoder.agent.m", "from rcoder import session", "agent must not import rcoder.session"),
        ("rcoder.agent.m", "from rcoder import errors, api", "agent must not import rcoder.api"),
        ("rcoder.agent.m", "def f():\n    import rcoder.api.service", "agent must not import rcoder.api.service"),
        ("rcoder.agent.m", "from ..session.runs import Run", "agent must not import rcoder.session.runs.Run"),
        ("rcoder.agent.m", "from .. import store", "agent must not import rcoder.store"),
        ("rcoder.store.m", "from rcoder import __version__", "store must not import rcoder.__version__"),
        ("rcoder.domain", "from . import errors", "domain must not import rcoder.errors"),
        ("rcoder.client.m", "from rcoder.session import runs", "client must not import rcoder.session.runs"),
        (
            "rcoder.client_cli",
            "import grpc",
            "only ['api', 'client', 'health_check', 'relay', 'v1'] may import grpc; rcoder.client_cli does",
        ),
        (
            "rcoder.session.m",
            "import grpc",
            "only ['api', 'client', 'health_check', 'relay', 'v1'] may import grpc; rcoder.session.m does",
        ),
        (
            "rcoder.session.m",
            "from ... import m",
            "rcoder.session.m: attempted relative import beyond top-level package",
        ),
        ("rcoder.nowhere", "", "layer 'nowhere' (rcoder.nowhere) has no entry in ALLOWED"),
        (
            "rcoder.agent.acp.m",
            "from rcoder.agent.processes import tree",
            "agent.acp must not import rcoder.agent.processes.tree",
        ),
        (
            "rcoder.agent.files.m",
            "from ..profiles.kinds import x",
            "agent.files must not import rcoder.agent.profiles.kinds.x",
        ),
        (
            "rcoder.session.runs.m",
            "from rcoder.session.turns import claimed",
            "session.runs must not import rcoder.session.turns.claimed",
        ),
    ],
)
def test_the_walker_reports_a_forbidden_import_however_it_is_spelled(module: str, source: str, found: str) -> None:
    assert violations(source, module, module.rpartition(".")[0]) == [found]


@pytest.mark.parametrize(
    ("module", "source"),
    [
        (
            "rcoder.agent.m",
            "from rcoder import errors, __version__\nfrom . import convert\nfrom ..config import Settings",
        ),
        ("rcoder.session.m", "from . import runs\nfrom rcoder.agent.launcher import AgentLauncher"),
        ("rcoder.daemon", "from rcoder import api, cli, session, store, metrics"),
        ("rcoder.agent.launcher", "from rcoder.agent.processes.tree import Trees\nfrom .files import safe_fs"),
        ("rcoder.agent.processes.m", "from ..confinement.sandbox import Confinement\nfrom . import tree"),
    ],
)
def test_the_walker_lets_allowed_imports_pass(module: str, source: str) -> None:
    assert violations(source, module, module.rpartition(".")[0]) == []

"""What the daemon imports to start: none of the relay's server, which only ``rcoder relay`` runs.

The daemon's side of the relay (``relay.host``, ``relay.containers``, ``relay.container_host``,
``relay.workspace_client``) needs a few names the server uses too (its socket's and its secret's
file names, the largest message, the file changes' message form); those live in modules of their
own (``relay.endpoint``, ``relay.workspace_changes``), so that every daemon's start does not
import the relay's service, its agents and its workspace service. Read with ``ast`` (the walker of
``tests/test_layers.py``), every import of every module reached, those inside functions too.
"""

from __future__ import annotations

import pytest

from tests.test_layers import PACKAGE, imported, module_of

pytestmark = pytest.mark.fast  # starts no process: `make check` (tests/process_guard.py)

# run by `rcoder relay` alone (rcoder.cli imports rcoder.relay.serve late, for that command)
RELAY_SERVER = {
    "rcoder.relay.serve",
    "rcoder.relay.service",
    "rcoder.relay.agents",
    "rcoder.relay.secret",
    "rcoder.relay.workspace_service",
    "rcoder.relay.idle",
}
MODULES = {module_of(path)[0]: path for path in PACKAGE.rglob("*.py")}


def module_named(name: str) -> str | None:
    """The module an imported name is, or is in (``rcoder.relay.serve.SOCKET_FILE``: its module)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def reached_from(start: str) -> set[str]:
    """Every rcoder module that importing ``start`` may import, its packages included."""
    reached: set[str] = set()
    todo = [start]
    while todo:
        module = todo.pop()
        if module in reached:
            continue
        reached.add(module)
        path = MODULES[module]
        for name in imported(path.read_text(), module_of(path)[1]):
            found = module_named(name) if name.startswith("rcoder") else None
            while found:  # a module's packages are imported with it
                todo.append(found)
                found = module_named(found.rpartition(".")[0])
    return reached


def test_the_daemon_imports_none_of_the_relays_server() -> None:
    reached = reached_from("rcoder.daemon")
    assert "rcoder.relay.host" in reached  # the walk does reach the daemon's side of the relay
    assert sorted(reached & RELAY_SERVER) == []


def test_the_relay_still_imports_its_server() -> None:
    assert reached_from("rcoder.relay.serve") >= RELAY_SERVER

"""Wiring in one place (docs/design/turn.md#the-parts): the daemon's parts are built in
``rcoder/daemon.py`` and passed in constructors, and no caller sets an attribute on another object
after it is made.

Read with ``ast``, like the layer test, and derived from the code rather than from a list kept by
hand:

- the parts are the classes ``rcoder/daemon.py`` builds, and every class one of them builds in
  its ``__init__`` (it lives as long as they do); a construction of a part anywhere else
  (``Part(...)``, or a class method of it such as ``LeaseKeeper.local``) is a finding, unless
  ``OWN_PARTS`` names the builder and says why;
- every assignment to an attribute of anything but ``self`` (``x.attr = ...``, ``+=``, annotated,
  in tuples) in the engine packages and the daemon is a finding, unless ``STATE_WRITES`` names
  the module and the object and says why; and anywhere in rcoder, an ``on_*`` attribute set
  outside ``__init__`` is a callback assigned after construction.

Each finding is named by file and line, and an exception that no longer matches anything fails
too, so the lists only shrink.
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
# a process of its own that builds the parts it shares with the daemon (docs/relay.md): its own root
OTHER_ROOTS = (PACKAGE / "relay" / "serve.py",)
# the packages whose classes make up the daemon's parts
ENGINE = ("session", "agent", "store")

# (the class or function that builds, the part it builds): why that is not the daemon's to build
OWN_PARTS: dict[tuple[str, str], str] = {
    ("AgentLauncher", "Homes"): "made from the uid the launcher resolves (agent_user); no other part uses it",
    ("AgentLauncher", "SessionLists"): "the launcher's cache of the agents' session lists (a test passes one in)",
    ("ProjectFiles", "FileThreads"): "the file calls' own threads; no other part uses them",
    ("ProjectFiles", "UploadJournal"): "the file calls' own journal of writes in flight",
    ("ProjectFiles", "ProjectDisk"): "the disk half of the file calls (rcoder/agent/files/disk.py), theirs alone",
    ("ProjectDisk", "Beneath"): "a stateless opener (whether the kernel has openat2 is its class's)",
    ("Workspaces", "ProjectDisk"): "the relay's disk for each workspace root a daemon names, made at its first call",
    (
        "Workspaces",
        "UploadJournal",
    ): "the relay's journal of the writes under way for each workspace root, made with its disk",
    ("give_back", "Beneath"): "the same opener, for a rewind's files given back to their folder's owner",
    ("LiveSessions", "TaskScope"): "the owners' scope of the tasks their turns start, closed by shutdown through them",
    ("DiskGuard", "TaskScope"): "the guard's own checks and watchers, closed by its aclose; no other part uses them",
    ("RunRegistry", "ByteLedger"): "the byte count all its runs share (runs_total_bytes), its own",
    ("Run", "ByteLedger"): "a run kept by no registry (a test's, a released one) counts its bytes alone",
}

# (module, the object written): why a caller writes that object's attributes. Records private to
# their module, values of other libraries, and the state of one turn, which the parts of that turn
# fill in as it goes.
STATE_WRITES: dict[tuple[str, str], str] = {
    ("agent/acp/sdk.py", "_fields"): "the SDK's import made quick: pydantic's docstring reader switched off",
    ("agent/processes/tree.py", "libc.prctl"): "ctypes: a C function's return type",
    ("agent/files/beneath.py", "_syscall"): "ctypes: a C function's return type",
    ("agent/files/folder_read.py", "_syscall"): "ctypes: a C function's return type",
    ("store/sqlite.py", "conn"): "sqlite3's connection: its row factory",
    ("agent/confinement/limits.py", "totals"): "Cgroups' own record of a profile's totals (_Totals)",
    ("agent/pool.py", "slot"): "the pool's own record of each agent it holds (_Slot)",
    ("agent/processes/confined.py", "pipes"): "the confined child's own record of its pipes (_Pipes)",
    ("agent/files/blocking.py", "level"): "the lister's own record of a folder level (_Level)",
    ("session/guards/disk.py", "project"): "the disk guard's own record of a project (_Project)",
    ("session/guards/usage_writer.py", "entry"): "the usage writer's own record of a run (_Noted)",
    ("session/runs/history.py", "batch"): "the history's own record of a write (_Batch)",
    ("session/runs/history.py", "entry"): "the history's own record of a tracked run (_Tracked)",
    ("store/checkpoint_repo.py", "done"): "the repository's own record of a collection pass",
    ("session/runs/run.py", "ledger"): "the byte count all runs of a registry share: a record (ByteLedger)",
    ("session/runs/run.py", "self._ledger"): "the same count, added to on every event (no call on that path)",
    # One turn's state: its plan (a TurnPlan) and its claimed turn (ClaimedTurn) are filled in by
    # the parts of that turn as it goes (opening, records, runner, ending, checkpoints, the claimed
    # turns' kill timer); they are values of the turn, not parts of the daemon.
    ("session/resume/opening.py", "plan"): "the turn's plan: the lease and the agent it opened with",
    ("session/turns/intake.py", "plan"): "the turn's plan: its session named once stored",
    ("session/turns/live_sessions.py", "waiting.plan"): "a queued turn's plan: when it left the queue",
    ("session/turns/records.py", "plan"): "the turn's plan: the session's record as stored",
    ("session/turns/runner.py", "plan"): "the turn's plan: re-planned after a refused start",
    ("session/turns/runner.py", "scope"): "the claimed turn: its agent, start, answer, snapshot, usage",
    ("session/turns/ending.py", "scope"): "the claimed turn: its start and its changes",
    ("session/turns/checkpoints.py", "scope"): "the claimed turn: its snapshots and changes",
}


def sources() -> Iterator[tuple[Path, ast.Module]]:
    for path in sorted(PACKAGE.rglob("*.py")):
        if GENERATED not in path.parents:
            yield path, ast.parse(path.read_text(), filename=str(path))


def module(path: Path) -> str:
    return str(path.relative_to(PACKAGE))


def where(path: Path, node: ast.AST) -> str:
    return f"{path.relative_to(PACKAGE.parent)}:{getattr(node, 'lineno', 0)}"


def is_value(node: ast.ClassDef) -> bool:
    """A dataclass, named tuple, enum, protocol or error: a value, never a part."""
    if any("dataclass" in ast.unparse(d) for d in node.decorator_list):
        return True
    kinds = ("NamedTuple", "Enum", "Protocol", "TypedDict", "Exception", "Error")
    return any(kind in ast.unparse(base) for base in node.bases for kind in kinds)


class Classes:
    """The engine packages' classes that are not values: each one's ``__init__`` and class methods."""

    def __init__(self, modules: list[tuple[Path, ast.Module]]) -> None:
        self.inits: dict[str, ast.FunctionDef] = {}
        self.class_methods: dict[str, set[str]] = {}
        for path, tree in modules:
            if path.relative_to(PACKAGE).parts[0] not in ENGINE:
                continue
            for node in tree.body:
                if isinstance(node, ast.ClassDef) and not is_value(node):
                    self.class_methods[node.name] = set()
                    for item in node.body:
                        if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                            self.inits[node.name] = item
                        elif isinstance(item, ast.FunctionDef) and any(
                            ast.unparse(d) == "classmethod" for d in item.decorator_list
                        ):
                            self.class_methods[node.name].add(item.name)

    def built(self, tree: ast.AST) -> Iterator[tuple[ast.Call, str]]:
        """Calls in ``tree`` that make an instance of one of these classes: ``Cls(...)``,
        ``pkg.Cls(...)``, or a class method of it (``LeaseKeeper.local(...)``)."""
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            if isinstance(func, ast.Name) and func.id in self.class_methods:
                yield node, func.id
            elif isinstance(func, ast.Attribute):
                if func.attr in self.class_methods:
                    yield node, func.attr
                elif isinstance(func.value, ast.Name) and func.attr in self.class_methods.get(func.value.id, ()):
                    yield node, func.value.id

    def parts(self, root: ast.Module) -> set[str]:
        """What ``root`` builds, and what each of those builds in its ``__init__``, and so on."""
        found = {name for _, name in self.built(root)}
        waiting = list(found)
        while waiting:
            init = self.inits.get(waiting.pop())
            for _, name in self.built(init) if init is not None else ():
                if name not in found:
                    found.add(name)
                    waiting.append(name)
        return found


def builders(tree: ast.Module) -> Iterator[tuple[ast.AST, str]]:
    """Every node of ``tree`` with the class (else the function) it is in ("" at module level)."""

    def walk(node: ast.AST, inside: str) -> Iterator[tuple[ast.AST, str]]:
        for child in ast.iter_child_nodes(node):
            yield child, inside
            named = isinstance(child, ast.ClassDef) or (
                isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef) and not inside
            )
            yield from walk(child, child.name if named else inside)  # type: ignore[attr-defined]

    return walk(tree, "")


def constructions(modules: list[tuple[Path, ast.Module]]) -> list[tuple[Path, ast.Call, str, str]]:
    """(file, call, the class or function it is in, the part it builds), outside the daemon."""
    classes = Classes(modules)
    root = next(tree for path, tree in modules if path == COMPOSITION_ROOT)
    parts = classes.parts(root)
    found = []
    for path, tree in modules:
        if path == COMPOSITION_ROOT or path in OTHER_ROOTS:
            continue
        for node, inside in builders(tree):
            if isinstance(node, ast.Call):
                for call, name in classes.built(node):
                    if call is node and name in parts:
                        found.append((path, call, inside, name))
    return found


def attribute_targets(target: ast.expr) -> Iterator[ast.Attribute]:
    """The attributes an assignment target writes, through tuples and lists (``a.x, b.y = ...``)."""
    if isinstance(target, ast.Attribute):
        yield target
    elif isinstance(target, ast.Tuple | ast.List):
        for element in target.elts:
            yield from attribute_targets(element)
    elif isinstance(target, ast.Starred):
        yield from attribute_targets(target.value)


def assigned(tree: ast.AST) -> Iterator[tuple[ast.Attribute, str, str]]:
    """Every attribute written in ``tree``: (the target, the function it is in, the class it is in)."""
    yield from _assigned(tree, "", "")


def _assigned(node: ast.AST, function: str, cls: str) -> Iterator[tuple[ast.Attribute, str, str]]:
    for child in ast.iter_child_nodes(node):
        targets: list[ast.expr] = []
        if isinstance(child, ast.Assign):
            targets = child.targets
        elif isinstance(child, ast.AugAssign) or (isinstance(child, ast.AnnAssign) and child.value is not None):
            targets = [child.target]
        for target in targets:
            for attribute in attribute_targets(target):
                yield attribute, function, cls
        if isinstance(child, ast.ClassDef):
            yield from _assigned(child, "", child.name)
        elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
            yield from _assigned(child, child.name, cls)
        else:
            yield from _assigned(child, function, cls)


def callback_assignments(tree: ast.Module) -> list[ast.Attribute]:
    """``x.on_y = ...`` (also ``+=`` and annotated) outside ``__init__``."""
    return [a for a, function, _ in assigned(tree) if a.attr.startswith("on_") and function != "__init__"]


def writes_on_others(tree: ast.Module) -> list[tuple[ast.Attribute, str]]:
    """``x.y = ...`` where ``x`` is not the object itself (``self``, ``cls``, or its class by name):
    (the target, the object written, as written)."""
    found = []
    for attribute, _, cls in assigned(tree):
        owner = attribute.value
        if isinstance(owner, ast.Name) and owner.id in {"self", "cls", cls}:
            continue
        found.append((attribute, ast.unparse(owner)))
    return found


def engine_modules() -> list[tuple[Path, ast.Module]]:
    return [
        (path, tree)
        for path, tree in sources()
        if path == COMPOSITION_ROOT or path.relative_to(PACKAGE).parts[0] in ENGINE
    ]


def test_no_callback_is_assigned_after_construction() -> None:
    found = [
        where(path, node) + f" sets .{node.attr}" for path, tree in sources() for node in callback_assignments(tree)
    ]
    assert not found, "callbacks are passed to constructors, never assigned afterwards:\n" + "\n".join(found)


def test_no_caller_sets_an_attribute_of_another_object_but_the_listed_ones() -> None:
    found, used = [], set()
    for path, tree in engine_modules():
        for attribute, owner in writes_on_others(tree):
            if (module(path), owner) in STATE_WRITES:
                used.add((module(path), owner))
            else:
                found.append(f"{where(path, attribute)} sets {owner}.{attribute.attr}")
    assert not found, "an object's state is its own: pass it in, or call a method of it:\n" + "\n".join(found)
    assert set(STATE_WRITES) == used, f"listed but written no more: {sorted(set(STATE_WRITES) - used)}"


def test_parts_are_built_only_in_the_daemon() -> None:
    found, used = [], set()
    for path, call, inside, name in constructions(list(sources())):
        if (inside, name) in OWN_PARTS:
            used.add((inside, name))
        else:
            found.append(f"{where(path, call)} ({inside or 'module'}) builds {name}")
    assert not found, "parts are built in rcoder/daemon.py and passed in:\n" + "\n".join(found)
    assert set(OWN_PARTS) == used, f"listed but built there no more: {sorted(set(OWN_PARTS) - used)}"


def test_the_parts_are_read_from_the_daemon_and_include_what_a_part_builds_for_itself() -> None:
    modules = list(sources())
    parts = Classes(modules).parts(next(tree for path, tree in modules if path == COMPOSITION_ROOT))
    # built by the daemon; built by one of those in its __init__ (the launcher's homes)
    assert {"TurnIntake", "TurnRunner", "SessionOpener", "TurnEnder", "Trees", "LeaseKeeper"} <= parts
    assert "Homes" in parts
    # values and what a turn makes for itself are no parts
    assert not {"Run", "ClaimedTurn", "TurnMachine", "AgentConnection", "RunEnd", "TurnPlan"} & parts


def test_the_checks_find_what_they_forbid() -> None:
    """Each check fails on the code it is there to keep out."""
    tree = ast.parse(
        "class Runner:\n"
        "    def __init__(self, pool):\n"
        "        self.on_done = None\n"  # in __init__: the constructor's own
        "        self.opener = Opener(pool)\n"  # a part building a part
        "        pool.size = 2\n"  # even in __init__: another object's
        "    def start(self, conn):\n"
        "        conn.on_active, self.x = print, 1\n"
        "        conn.pipe.pace = self.pace\n"
        "        Runner.count = 1\n"  # its own class
        "        keeper = Keeper.local(1.0)\n"
        "        return history.History(keeper)\n"
        "class Opener:\n"
        "    def __init__(self, pool): ...\n"
        "class Keeper:\n"
        "    @classmethod\n"
        "    def local(cls, ttl): ...\n"
        "    @staticmethod\n"
        "    def done(note): ...\n"
        "class History:\n"
        "    def __init__(self, keeper):\n"
        "        Keeper.done(1)\n"  # a static method: builds nothing
    )
    assert [(node.attr, node.lineno) for node in callback_assignments(tree)] == [("on_active", 7)]
    assert [(a.attr, owner, a.lineno) for a, owner in writes_on_others(tree)] == [
        ("size", "pool", 5),
        ("on_active", "conn", 7),
        ("pace", "conn.pipe", 8),
    ]
    classes = Classes([(PACKAGE / "session" / "m.py", tree)])
    assert [(name, call.lineno) for call, name in classes.built(tree)] == [
        ("Opener", 4),
        ("Keeper", 10),
        ("History", 11),
    ]
    daemon = ast.parse("runner = Runner(pool)\n")
    assert classes.parts(daemon) == {"Runner", "Opener"}

"""Resource limits per agent through the kernel's cgroups (docs/limits.md).

Each agent process gets a cgroup of its own below a subtree that belongs to this daemon, named
after a hash of its ``data_dir`` (unique to it among daemons on the host, stable across its
restarts): ``<daemon's cgroup>/rcoder-<hash>/agent-<pid>``. Everything the agent starts is born in
its cgroup and counts against its ``memory_max``, ``pids_max`` and ``cpu_max``.

What holds is found once at start (``Cgroups.probe``):

- ``cgroup2``: the unified hierarchy, where the daemon's own cgroup has the ``memory`` and ``pids``
  controllers (``cpu`` too for ``cpu_max``) delegated to it. The "no internal processes" rule
  forbids giving controllers to the children of a cgroup that holds processes, so where the
  daemon's cgroup holds it, the daemon moves itself into a leaf of its own first.
- ``cgroup1``: the ``memory``, ``pids``, ``cpu`` and ``cpuacct`` hierarchies, each below the
  daemon's own cgroup in it (a hybrid host's unified hierarchy without controllers is one case).
- ``none``: neither; agents run unlimited (``limits = "required"`` refuses to start then).

The pid enters its cgroup right after spawn, written by the daemon, before any ACP request
(docs/limits.md#how-an-agent-enters-its-cgroup): agents fork only in answer to requests, so what
they start is born inside. A leftover of a killed daemon is swept at the next start (every process
in it killed, the cgroup removed); an agent's cgroup is removed once the agent has exited, on every
path, bounded and idempotent.

The cgroup filesystem's root is a parameter (the daemon passes ``/sys/fs/cgroup``), so that the
cgroup2 logic can be tested against a folder laid out as cgroupfs.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import os
import re
import signal
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from rcoder.errors import ConfigError
from rcoder.logs import get_logger

if TYPE_CHECKING:
    from rcoder.config import Settings

log = get_logger(__name__)

CGROUP_ROOT = Path("/sys/fs/cgroup")
Kind = Literal["cgroup2", "cgroup1", "none"]
# the controllers a limit needs: memory and pids always (memory_max, pids_max have defaults), cpu for cpu_max
NEEDED = ("memory", "pids")
V1_HIERARCHIES = ("memory", "pids", "cpu", "cpuacct")
AGENT_PREFIX = "agent-"
# how often, and how far apart, a removal is tried again while the cgroup's last processes are reaped
_REMOVE_TRIES = 20
_REMOVE_PAUSE = 0.05
_CPU_PERIOD_US = 100_000


@dataclass(frozen=True, slots=True)
class Mechanism:
    """What holds on this host: the kind, and which controllers it has."""

    kind: Kind
    controllers: tuple[str, ...] = ()
    why: str = ""  # when "none", or a controller is missing: the kernel's or the filesystem's words

    def holds(self, cpu: bool) -> bool:
        """Whether every limit of a profile holds (``cpu``: it sets ``cpu_max``)."""
        return self.kind != "none" and (not cpu or "cpu" in self.controllers)


@dataclass(frozen=True, slots=True)
class Values:
    """One profile's limits: bytes, processes, cores (None: unbounded)."""

    memory_max: int
    pids_max: int
    cpu_max: float | None = None


@dataclass(frozen=True, slots=True)
class Usage:
    """What an agent's cgroup has used: memory now and at its peak (bytes), CPU seconds."""

    memory_current: int = 0
    memory_peak: int = 0
    cpu_seconds: float = 0.0


def human(size: int) -> str:
    """``268435456`` as "256 MiB", the way a person reads a limit."""
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if size >= 1 << shift:
            value = size / (1 << shift)
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.1f} {unit}"
    return f"{size} bytes"


def subtree_name(data_dir: Path) -> str:
    """The daemon's subtree: unique to its data_dir, the same across its restarts."""
    return "rcoder-" + hashlib.sha256(str(data_dir.absolute()).encode()).hexdigest()[:12]


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _keyed(text: str, key: str) -> int:
    """The number after ``key`` in a "key value" file (memory.events, memory.oom_control, pids.events)."""
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == key and value.strip().isdigit():
            return int(value)
    return 0


def _number(path: Path) -> int:
    text = _read(path).strip()
    return int(text) if text.isdigit() else 0


def _write(path: Path, value: str) -> None:
    with open(path, "w") as file:  # one write(2): cgroupfs takes each write as one command
        file.write(value)


def _own_cgroups(proc_self_cgroup: Path) -> dict[str, str]:
    """The daemon's cgroup path per hierarchy: "" for the unified one (``0::/path``), else each v1
    controller's name (``4:memory:/path``; ``2:cpu,cpuacct:/path`` gives both)."""
    found: dict[str, str] = {}
    for line in _read(proc_self_cgroup).splitlines():
        _, controllers, path = [*line.split(":", 2), "", ""][:3]
        for name in controllers.split(",") if controllers else [""]:
            found[name] = path
    return found


def _mount_roots(proc_self_mountinfo: Path) -> dict[str, str]:
    """Each mount point and the folder of its filesystem mounted there (mountinfo's 5th and 4th
    fields): a cgroup filesystem bind-mounted from one cgroup's folder has that cgroup as its root."""
    roots = {}
    for line in _read(proc_self_mountinfo).splitlines():
        fields = [_OCTAL.sub(lambda m: chr(int(m.group(1), 8)), f) for f in line.split()[3:5]]  # "\040": a space
        if len(fields) == 2:
            roots[fields[1]] = fields[0]
    return roots


_OCTAL = re.compile(r"\\([0-7]{3})")


def _seen_from(roots: Mapping[str, str], mount: Path, path: str) -> str:
    """``path`` (a cgroup, as /proc/self/cgroup names it) as a path below ``mount``. A container in
    the host's cgroup namespace sees its own cgroup's path there while its runtime mounted only that
    cgroup's folder (runc on cgroup v1): the mount's root is that path, and the cgroup is the mount."""
    root = roots.get(str(mount), roots.get(str(mount.resolve()), "/"))
    if root in ("/", "") or not (path == root or path.startswith(root.rstrip("/") + "/")):
        return path
    return "/" + path[len(root) :].lstrip("/")


def _procs(folder: Path) -> list[int]:
    return [int(p) for p in _read(folder / "cgroup.procs").split() if p.isdigit()]


def _parent_of(pid: int) -> int:
    """``pid``'s parent (0 when it is gone or unreadable)."""
    fields = _read(Path(f"/proc/{pid}/stat")).rpartition(")")[2].split()
    return int(fields[1]) if len(fields) > 1 and fields[1].isdigit() else 0


def _self_and_ancestors(procs: set[int]) -> list[int]:
    """The daemon, then each ancestor of it in ``procs`` (its cgroup's), up to the first that is not:
    in a container the init that started it (tini: runc, under podman and Docker, puts an exec'd
    process in the init's cgroup where the container's own refuses it), on a host a wrapper shell."""
    found, pid = [os.getpid()], _parent_of(os.getpid())
    while pid > 0 and pid in procs and pid not in found:
        found.append(pid)
        pid = _parent_of(pid)
    return found


def _kill_all(folder: Path) -> int:
    """SIGKILL every process in the cgroup (v1 has no ``cgroup.kill``); how many were signalled."""
    killed = 0
    for pid in _procs(folder):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
            killed += 1
    return killed


class AgentCgroup:
    """One agent's cgroup: one folder (cgroup2) or one per hierarchy (cgroup1)."""

    def __init__(self, kind: Kind, folders: Mapping[str, Path], values: Values, profile: str, pid: int) -> None:
        self.kind = kind
        self._folders = dict(folders)  # controller -> folder ("" for cgroup2's one)
        self.values = values
        self.profile = profile
        self.pid = pid
        self._removed = False

    def _folder(self, controller: str) -> Path | None:
        return self._folders.get("" if self.kind == "cgroup2" else controller)

    @property
    def folders(self) -> list[Path]:
        return list(dict.fromkeys(self._folders.values()))

    def usage(self) -> Usage:
        """Memory now and at its peak, CPU seconds; 0 for what this kernel does not count."""
        if self.kind == "cgroup2":
            folder = self._folders[""]
            cpu = _keyed(_read(folder / "cpu.stat"), "usage_usec") / 1e6
            return Usage(_number(folder / "memory.current"), _number(folder / "memory.peak"), cpu)
        memory, cpuacct = self._folder("memory"), self._folder("cpuacct")
        current = _number(memory / "memory.usage_in_bytes") if memory else 0
        peak = _number(memory / "memory.max_usage_in_bytes") if memory else 0
        cpu = _number(cpuacct / "cpuacct.usage") / 1e9 if cpuacct else 0.0
        return Usage(current, peak, cpu)

    def oom_kills(self) -> int:
        """How many processes the kernel killed in it for its memory limit."""
        if self.kind == "cgroup2":
            return _keyed(_read(self._folders[""] / "memory.events"), "oom_kill")
        memory = self._folder("memory")
        if memory is None:
            return 0
        kills = _keyed(_read(memory / "memory.oom_control"), "oom_kill")
        # kernels before 4.13 have no oom_kill count: a limit hit at all is the best there is
        return kills or (_number(memory / "memory.failcnt") if "oom_kill" not in _read(memory / "memory.oom_control")
                         else 0)  # fmt: skip

    def forks_refused(self) -> int:
        """How many forks ``pids_max`` refused in it."""
        pids = self._folder("pids")
        return _keyed(_read(pids / "pids.events"), "max") if pids else 0

    def limit_reached(self) -> str:
        """Why the agent was stopped, when its cgroup's limit did it ("" otherwise)."""
        if self.oom_kills():
            return f"the agent was stopped: memory limit {human(self.values.memory_max)} reached"
        return ""

    def _kill(self) -> None:
        kill = self._folders.get("", Path()) / "cgroup.kill"
        if self.kind == "cgroup2" and kill.exists():  # Linux 5.14+: the whole cgroup at once
            with contextlib.suppress(OSError):
                _write(kill, "1")
                return
        for folder in self.folders:
            _kill_all(folder)

    def try_remove(self) -> bool:
        """Kill what is left in it and remove it; whether it is gone (idempotent)."""
        if self._removed:
            return True
        self._kill()
        left = []
        for folder in self.folders:
            try:
                folder.rmdir()
            except FileNotFoundError:
                pass
            except OSError as exc:
                left.append((folder, exc))
        if left:
            return False
        self._removed = True
        return True

    async def remove(self) -> None:
        """``try_remove``, again while its last processes are being reaped: bounded, then left
        to the next start's sweep (logged)."""
        for _ in range(_REMOVE_TRIES):
            if self.try_remove():
                return
            await asyncio.sleep(_REMOVE_PAUSE)  # a bounded retry: the kernel frees a cgroup once its tasks are reaped
        log.warning("agent_cgroup_left", agent=self.profile, pid=self.pid, folders=[str(f) for f in self.folders],
                    effect="removed at the next start's sweep")  # fmt: skip


@dataclass
class _Totals:
    """What a profile's ended agents used, for the metrics (which never label a session)."""

    cpu_seconds: float = 0.0
    oom_kills: int = 0
    live: dict[int, AgentCgroup] = field(default_factory=dict)


class Cgroups:
    """This daemon's cgroup subtree: found at ``probe``, swept of leftovers, one cgroup per agent."""

    def __init__(
        self,
        root: Path,
        data_dir: Path,
        proc_self_cgroup: Path = Path("/proc/self/cgroup"),
        proc_self_mountinfo: Path = Path("/proc/self/mountinfo"),
    ) -> None:
        self.root = root
        self.name = subtree_name(data_dir)
        self._proc_self = proc_self_cgroup
        self._mountinfo = proc_self_mountinfo
        self.mechanism = Mechanism("none", why="not probed")
        self._bases: dict[str, Path] = {}  # controller -> the daemon's subtree ("" for cgroup2)
        self._totals: dict[str, _Totals] = {}

    # ------------------------------------------------------------ at start

    def probe(self) -> Mechanism:
        """Find what holds, making the daemon's subtree (cgroup2 first, then cgroup1)."""
        own = _own_cgroups(self._proc_self)
        roots = _mount_roots(self._mountinfo)
        unified = self.root if (self.root / "cgroup.controllers").is_file() else self.root / "unified"
        own = {name: _seen_from(roots, self.root / name if name else unified, path) for name, path in own.items()}
        why2 = self._probe_v2(own)
        if self.mechanism.kind == "none":
            why1 = self._probe_v1(own)
            if self.mechanism.kind == "none":
                self.mechanism = Mechanism("none", why=f"cgroup2: {why2}; cgroup1: {why1}")
        return self.mechanism

    def _probe_v2(self, own: Mapping[str, str]) -> str:
        unified = next((m for m in (self.root, self.root / "unified") if (m / "cgroup.controllers").is_file()), None)
        if unified is None or "" not in own:
            return f"no unified hierarchy at {self.root}"
        mine = unified / own[""].lstrip("/")
        if mine.name == self.name + ".daemon":  # a leaf this daemon moved into at an earlier start
            mine = mine.parent
        offered = _read(mine / "cgroup.controllers").split()
        missing = [c for c in NEEDED if c not in offered]
        if missing:
            return f"{mine} has no {', '.join(missing)} controller delegated (it has: {' '.join(offered) or 'none'})"
        wanted = [c for c in (*NEEDED, "cpu") if c in offered]
        base = mine / self.name
        try:
            self._enable(mine, wanted)
            base.mkdir(exist_ok=True)
            _write(base / "cgroup.subtree_control", " ".join(f"+{c}" for c in wanted))
        except OSError as exc:
            return f"could not delegate {' '.join(wanted)} below {mine}: {exc}"
        self._bases = {"": base}
        self.mechanism = Mechanism("cgroup2", tuple(wanted))
        return ""

    def _enable(self, mine: Path, wanted: list[str]) -> None:
        """Give ``wanted`` to the children of the daemon's cgroup. Where it holds processes (the
        "no internal processes" rule: EBUSY), the daemon moves itself into a leaf first, with those
        of its ancestors that share its cgroup: in a container, its init (tini) is there too."""
        if all(c in _read(mine / "cgroup.subtree_control").split() for c in wanted):
            return
        command = " ".join(f"+{c}" for c in wanted)
        try:
            _write(mine / "cgroup.subtree_control", command)
        except OSError as exc:
            if exc.errno != errno.EBUSY:
                raise
            leaf = mine / f"{self.name}.daemon"
            leaf.mkdir(exist_ok=True)
            moved = _self_and_ancestors(set(_procs(mine)))
            for pid in moved:
                _write(leaf / "cgroup.procs", str(pid))
            why = "cgroup2 gives controllers only to cgroups without processes of their own"
            log.info("daemon_cgroup_moved", to=str(leaf), pids=moved, why=why)
            _write(mine / "cgroup.subtree_control", command)

    def _probe_v1(self, own: Mapping[str, str]) -> str:
        bases: dict[str, Path] = {}
        problems = []
        for controller in V1_HIERARCHIES:
            mount = self.root / controller
            if controller not in own or not mount.is_dir():
                problems.append(f"no {controller} hierarchy at {mount}")
                continue
            base = mount.resolve() / own[controller].lstrip("/") / self.name
            try:
                base.mkdir(exist_ok=True)
            except OSError as exc:
                problems.append(f"cannot make {base}: {exc.strerror}")
                continue
            bases[controller] = base
        missing = [c for c in NEEDED if c not in bases]
        if missing:
            return "; ".join(problems)
        self._bases = bases
        controllers = tuple(c for c in V1_HIERARCHIES if c in bases)
        self.mechanism = Mechanism("cgroup1", controllers, "; ".join(problems))
        return ""

    def sweep(self) -> int:
        """Kill whatever a killed daemon left in this daemon's agent cgroups, and remove them; how
        many processes were killed. Only this daemon's subtree is looked at: others' are theirs."""
        killed: set[int] = set()  # on cgroup1 each process is in every hierarchy's folder
        for base in dict.fromkeys(self._bases.values()):
            with contextlib.suppress(OSError):
                for folder in base.iterdir():
                    if not folder.is_dir() or not folder.name.startswith(AGENT_PREFIX):
                        continue
                    killed.update(_procs(folder))
                    # one folder at a time: a cgroup1 agent's folders are found in each hierarchy
                    kind = self.mechanism.kind
                    left = AgentCgroup(kind, {"" if kind == "cgroup2" else "memory": folder}, Values(0, 0), "", 0)
                    for _ in range(_REMOVE_TRIES):
                        if left.try_remove():
                            break
                        _pause()
                    else:
                        log.warning("leftover_cgroup_not_removed", folder=str(folder))
        if killed:
            log.warning("leftover_cgroup_processes_killed", processes=len(killed))
        return len(killed)

    # ------------------------------------------------------------ per agent

    def place(self, profile: str, pid: int, values: Values) -> AgentCgroup | None:
        """Make ``pid``'s cgroup with ``values`` and move it in; None where no mechanism holds or
        the kernel refused (logged: the agent runs unlimited)."""
        kind = self.mechanism.kind
        if kind == "none":
            return None
        name = f"{AGENT_PREFIX}{pid}"
        folders = {c: base / name for c, base in self._bases.items()}
        cgroup = AgentCgroup(kind, folders, values, profile, pid)
        try:
            for folder in dict.fromkeys(folders.values()):
                folder.mkdir(exist_ok=True)
            self._set(cgroup, values)
            for folder in dict.fromkeys(folders.values()):
                _write(folder / "cgroup.procs", str(pid))
        except OSError as exc:
            log.warning(
                "agent_cgroup_failed", agent=profile, pid=pid, error=str(exc), effect="the agent runs unlimited"
            )
            cgroup.try_remove()
            return None
        self._totals.setdefault(profile, _Totals()).live[pid] = cgroup
        return cgroup

    def _set(self, cgroup: AgentCgroup, values: Values) -> None:
        if cgroup.kind == "cgroup2":
            folder = cgroup.folders[0]
            _write(folder / "memory.max", str(values.memory_max))
            if (folder / "memory.swap.max").exists():
                _write(folder / "memory.swap.max", "0")  # no escaping the limit by swapping
            _write(folder / "pids.max", str(values.pids_max))
            if values.cpu_max is not None:
                _write(folder / "cpu.max", f"{round(values.cpu_max * _CPU_PERIOD_US)} {_CPU_PERIOD_US}")
            return
        memory, pids, cpu = (cgroup._folder(c) for c in ("memory", "pids", "cpu"))
        assert memory is not None and pids is not None
        _write(memory / "memory.limit_in_bytes", str(values.memory_max))
        if (memory / "memory.memsw.limit_in_bytes").exists():  # memory + swap: no escaping the limit by swapping
            _write(memory / "memory.memsw.limit_in_bytes", str(values.memory_max))
        _write(pids / "pids.max", str(values.pids_max))
        if cpu is not None and values.cpu_max is not None:
            _write(cpu / "cpu.cfs_period_us", str(_CPU_PERIOD_US))
            _write(cpu / "cpu.cfs_quota_us", str(round(values.cpu_max * _CPU_PERIOD_US)))

    def ended(self, cgroup: AgentCgroup) -> None:
        """The agent has exited: what it used is added to its profile's totals."""
        totals = self._totals.setdefault(cgroup.profile, _Totals())
        if totals.live.pop(cgroup.pid, None) is not None:
            totals.cpu_seconds += cgroup.usage().cpu_seconds
            totals.oom_kills += cgroup.oom_kills()

    def per_profile(self) -> dict[str, tuple[int, int, float, int]]:
        """Per profile: its live agents' memory now (summed) and peak (the largest), its agents'
        CPU seconds (ended and live, summed), and how many OOM kills its cgroups saw. Read by the
        metrics thread: it copies what it walks."""
        found: dict[str, tuple[int, int, float, int]] = {}
        for profile, totals in list(self._totals.items()):
            current = peak = 0
            cpu, kills = totals.cpu_seconds, totals.oom_kills
            for cgroup in list(totals.live.values()):
                used = cgroup.usage()
                current, peak = current + used.memory_current, max(peak, used.memory_peak)
                cpu += used.cpu_seconds
                kills += cgroup.oom_kills()
            found[profile] = (current, peak, cpu, kills)
        return found

    def close(self) -> None:
        """The daemon stops with every agent ended: its subtree goes (one still holding a cgroup stays,
        for the next start's sweep)."""
        for base in dict.fromkeys(self._bases.values()):
            with contextlib.suppress(OSError):
                base.rmdir()

    def folders(self) -> Iterable[Path]:
        """The daemon's subtree, per hierarchy."""
        return dict.fromkeys(self._bases.values())


def _pause() -> None:
    """A short bounded pause between two removal tries at start, before the loop serves anything."""
    time.sleep(_REMOVE_PAUSE)


def check_limits(settings: Settings, mechanism: Mechanism) -> None:
    """Say at start what holds (``limits: cgroup2 | cgroup1 | none``, and which controllers), per
    profile; a profile with ``limits = "required"`` whose limits do not all hold is a ConfigError,
    one with "auto" a warning (as ``sandbox`` does: docs/limits.md#what-holds-where)."""
    log.info("limits", mechanism=mechanism.kind, controllers=list(mechanism.controllers),
             reason=mechanism.why or None)  # fmt: skip
    for name, profile in sorted(settings.agents.items()):
        cpu = profile.cpu_max > 0
        if mechanism.holds(cpu):
            log.info("agent_limits", agent=name, limits=mechanism.kind, memory_max=human(profile.memory_max),
                     pids_max=profile.pids_max, cpu_max=profile.cpu_max or None)  # fmt: skip
            continue
        why = mechanism.why if mechanism.kind == "none" else f"no cpu controller for cpu_max ({mechanism.why})"
        if profile.limits == "required":
            raise ConfigError(
                f"agents.{name}.limits",
                f'asks for "required" but {why}; delegate the cgroup controllers to rcoder (docs/limits.md), or set '
                'limits = "auto" to run its agents with what holds, said in a warning',
            )
        log.warning("agent_limits", agent=name, limits=mechanism.kind, reason=why,
                    effect="its agents run without memory and process limits" if mechanism.kind == "none"
                    else "its agents run without a CPU bound")  # fmt: skip

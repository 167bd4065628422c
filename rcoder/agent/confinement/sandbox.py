"""What an agent process may reach (docs/design/trust.md#confinement), as the argv that confines it.

An agent under ``sandbox = "landlock"`` is started by a thread that first confines itself with
the paths below (``rcoder.agent.processes.confined``), or through an exec wrapper (``wrapper_command``: the
C helper ``rcoder-confine``, or ``rcoder/landlock.py`` run by Python); all read the
``Confinement`` as the wrapper's arguments (``wrapper_args``). The confinement is inherited by
everything the agent starts. Read and write: the session's project, the agent's home for that
project (its ``TMPDIR`` inside) and the profile's ``write_paths``. Read and execute: the system,
the toolchains rcoder knows of (the agent's install, the pinned agents, the daemon's Python) and
the profile's ``read_paths``. Nothing else.

What must stay out of reach (``data_dir``, ``workspace_root``, the config file, the TLS files)
stays out even where a granted folder contains it, the project's own included: such a folder is
granted child by child, around it (an ``/opt`` holding ``/opt/rcoder/data`` is granted without
``/opt/rcoder/data``).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from rcoder import landlock
from rcoder.agent.files import ownership
from rcoder.agent.profiles.kinds import kind_of
from rcoder.agent.profiles.profile import connect_ports, sandbox_of
from rcoder.config import AGENTS_DIR, AgentProfile, Settings, checkpoint_root

WRAPPER = Path(landlock.__file__).resolve()
PYTHON_WRAPPER = (sys.executable, "-I", "-S", "-B", str(WRAPPER))  # the wrapper run by rcoder's Python
# The same wrapper in C (rcoder/agent/confinement/confine.c, built by `make`): a bare exec of a static binary
# instead of a Python start-up, for the agents that must confine themselves in their own process.
HELPER = Path(__file__).resolve().parent / "rcoder-confine"


def wrapper_command() -> list[str]:
    """What runs the exec wrapper: the C helper where it is built, else ``landlock.py`` by Python
    (the same arguments, the same confinement)."""
    if os.access(HELPER, os.X_OK):
        return [str(HELPER)]
    return list(PYTHON_WRAPPER)


# The system, read and execute.
SYSTEM_READ = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/opt")
# Of /proc and /sys, what runtimes read about the machine (node's os.cpus() and memory, glibc's
# CPU count), and "/proc/self": the agent process's own /proc/<pid> where the exec
# wrapper resolves it (in the agent's process: not its children's); where a thread of the daemon
# confines itself to start the agent, it resolves to the daemon's and is left out (the agent's
# pid does not exist yet). Never /proc whole: Landlock keeps a confined process from
# ptrace-reading others (their fd, cwd, mem), but /proc/<pid>/environ of every process of the
# same user stays readable where /proc is (Linux 6.18 here) - the daemon's and other projects'
# agents' keys. So the agent's children, and the agent itself when started by a confined thread,
# cannot read their own /proc/self (node's process.memoryUsage() throws EACCES there, `ps` shows
# nothing); a profile that needs it adds "/proc" to read_paths and gives that up.
OWN_PROC = "/proc/self"
PROC_READ = (
    OWN_PROC, "/proc/cpuinfo", "/proc/meminfo", "/proc/stat", "/proc/uptime", "/proc/loadavg",
    "/proc/version", "/proc/filesystems", "/proc/sys", "/sys/devices/system/cpu",
)  # fmt: skip
# Never /sys/fs/cgroup: there every agent's cgroup (rcoder/agent/confinement/limits.py) shows its processes
# (cgroup.procs) and memory figures to any reader, and an agent's own is made after it starts,
# named by its pid, so no rule could grant it alone. What an agent loses: reading its own cgroup's
# limits (memory.max, pids.max); runtimes then size themselves by the machine's /proc/meminfo
# (docs/confinement.md#what-an-agent-can-reach).
# Devices every program expects, read and write (``> /dev/null`` truncates: write rights).
DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")
# /etc entries that are often symlinks out of /etc (systemd-resolved keeps resolv.conf in /run).
ETC_LINKS = ("/etc/resolv.conf", "/etc/hosts", "/etc/localtime")


@dataclass(frozen=True, slots=True)
class Confinement:
    """The paths one agent process may read (and execute) and read and write."""

    read: tuple[Path, ...]
    write: tuple[Path, ...]
    abi: int
    connect: tuple[int, ...] = ()  # the TCP ports it may connect to (ABI 4+: no other)
    bind: tuple[int, ...] = ()  # the TCP ports it may bind

    @property
    def own_proc(self) -> bool:
        """Whether it grants the agent its own ``/proc/<pid>`` ("/proc/self"): only the agent's
        process can resolve that, so the agent must start through the exec wrapper."""
        own = Path(OWN_PROC)
        return any(p == own or own in p.parents for p in (*self.read, *self.write))

    def argv(self, command: Sequence[str], parent: int, user: tuple[int, int] | None = None) -> list[str]:
        """``command`` run through the wrapper (with the daemon's pid for its death signal), which
        switches to ``user`` (uid, gid) first when given."""
        switch = ["--user", f"{user[0]}:{user[1]}"] if user else []
        return [*wrapper_command(), *switch, *self.wrapper_args(command, parent)]

    def wrapper_args(self, command: Sequence[str], parent: int) -> list[str]:
        """The wrapper's arguments: what confines ``command``, as ``landlock.parse`` reads them.
        The spawn helper (``rcoder.agent.spawner``) is sent these same arguments."""
        args = ["--parent", str(parent)]
        for path in self.read:
            args += ["--read", str(path)]
        for path in self.write:
            args += ["--write", str(path)]
        for port in self.connect:
            args += ["--connect", str(port)]
        for port in self.bind:
            args += ["--bind", str(port)]
        return [*args, "--", *command]


def confinement(settings: Settings, profile: AgentProfile, command: str, cwd: Path, home: Path) -> Confinement | None:
    """What an agent of ``profile`` running ``command`` in ``cwd`` may reach; None: unconfined.

    Touches the file system (resolving paths, creating missing ``write_paths`` folders): call it
    off the event loop."""
    if sandbox_of(settings, profile) != "landlock":
        return None
    make_write_paths(settings, profile, None)  # already made, for the agents' uid where they have one (prepare)
    hidden = protected(settings)
    system = [Path(p) for p in (*SYSTEM_READ, *ETC_LINKS)]
    # resolved by the wrapper, in the agent's process (no around()); "/proc/self" only for a kind
    # whose agent needs it (that makes it start through the wrapper: Confinement.own_proc)
    own_proc = kind_of(profile.kind).own_proc
    own = [Path(p) for p in PROC_READ if own_proc or p != OWN_PROC]
    install = install_dirs(command, settings.daemon_env.get("HOME"))
    read = [*system, *install, *python_dirs(), *profile.read_paths]
    # the project too is granted around what is hidden: a workspace_root holding data_dir makes
    # data_dir a project's folder, and that project's agent must not get the store with it
    write = [cwd, home, *profile.write_paths]
    return Confinement(
        read=(*_unique(p for path in read for p in around(path, hidden)), *own),
        write=(*_unique(p for path in write for p in around(path, hidden)), *_devices()),
        abi=settings.landlock_abi,
        connect=connect_ports(profile),
        bind=tuple(sorted(set(profile.bind_ports))),
    )


def make_write_paths(settings: Settings, profile: AgentProfile, owner: tuple[int, int] | None) -> None:
    """The profile's ``write_paths`` made when missing, so that the agent can use them; with
    ``owner`` (the agents' uid and gid) the folders made are theirs, and so is one under
    ``data_dir`` (rcoder's, e.g. the ``echo`` profile's sessions) made before; one elsewhere that
    was there stays as it is: the operator's. Call it off the event loop."""
    data_dir = _real(settings.data_dir)
    for path in profile.write_paths:
        missing = [p for p in (path, *path.parents) if not os.path.lexists(p)]
        with contextlib.suppress(OSError):
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
            if owner is None:
                continue
            for made in reversed(missing):
                os.chown(made, *owner, follow_symlinks=False)
            real = _real(path)
            if data_dir in real.parents and not ownership.owned_by(real, owner):
                ownership.give(real, owner)


def protected(settings: Settings) -> list[Path]:
    """What no grant may contain: the store and homes, every project, the config, defaults and TLS
    files, the relays' key (every relay's secret derives from it), the clients' token files."""
    paths = [settings.data_dir, settings.workspace_root, checkpoint_root(settings)]
    files = (settings.config_file, settings.defaults_file, settings.tls_cert, settings.tls_key,
             settings.relays_key_file)  # fmt: skip
    paths += [Path(p) for p in files if p]
    paths += [client.token_file for client in settings.clients if client.token_file is not None]
    return [_real(p) for p in paths]


def install_dirs(command: str, home: str | None = None) -> list[Path]:
    """The agent's install: the pinned agents, and for ``command`` as named and as resolved, the
    node package it is in, else the folder holding it (the installation above it, for a ``bin``
    folder other than the daemon user's own ``~/bin``)."""
    found = [AGENTS_DIR.parent]  # agents/: node_modules and the package.json node looks up
    for path in {Path(command), _real(Path(command))}:
        found.append(_package_of(path.parent, home))
    return found


def python_dirs() -> list[Path]:
    """The daemon's Python: agents run by ``sys.executable`` (the ``echo`` profile, test agents)
    need its installation and virtual environment."""
    return [Path(sys.prefix), Path(sys.base_prefix), Path(sys.exec_prefix), Path(sys.base_exec_prefix)]


def around(grant: Path, hidden: Sequence[Path]) -> list[Path]:
    """``grant`` resolved, or, when it contains a hidden path, its children granted around it
    (each in turn). A path that does not exist, or is the daemon's own ``/proc/<pid>``, grants
    nothing.

    Only real children are granted, never a link met while expanding: the folder may be the
    agent's own (a project holding ``data_dir``), so it makes such links itself, and one may point
    anywhere (``data_dir/agents``, the daemon's home). Resolving a link and dropping what lands in
    or under a hidden path would not do: the wrapper opens each path again later, and the agent
    can point the link elsewhere in between; and a link's target lies outside the folder the
    operator granted. A link inside a folder granted whole grants nothing either: Landlock
    checks the file a path resolves to."""
    real = _real(grant)
    # compared as text: pathlib's ``parents`` costs ~1 ms over a start's grants (docs/benchmarks.md)
    daemon = f"/proc/{os.getpid()}"  # what "/proc/self" in a profile resolves to here: never the agent's
    if _within(str(real), daemon):
        return []
    inside = [h for h in map(str, hidden) if _within(h, str(real))]
    if not inside:
        return [real] if os.path.exists(real) else []
    if str(real) in inside:
        return []
    try:
        children = [child for child in real.iterdir() if not child.is_symlink()]
    except OSError:
        return []
    return [p for child in children for p in around(child, hidden)]


def _within(path: str, folder: str) -> bool:
    """Whether ``path`` is ``folder`` or beneath it (both absolute and normalised)."""
    return path == folder or path.startswith(folder if folder.endswith("/") else folder + "/")


def _package_of(folder: Path, home: str | None) -> Path:
    parts = folder.parts
    if "node_modules" in parts:  # node_modules/<name> or node_modules/@scope/<name>
        at = len(parts) - parts[::-1].index("node_modules")
        size = 2 if at < len(parts) and parts[at].startswith("@") else 1
        return Path(*parts[: at + size])
    if folder.name == "bin" and str(folder.parent) not in (folder.anchor, home):
        return folder.parent
    return folder


def _devices() -> tuple[Path, ...]:
    return tuple(Path(d) for d in DEVICES if os.path.exists(d))


def _real(path: Path) -> Path:
    return Path(os.path.realpath(path))


def _unique(paths: Iterable[Path]) -> tuple[Path, ...]:
    return tuple(dict.fromkeys(paths))

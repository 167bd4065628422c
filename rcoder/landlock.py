"""Linux Landlock by hand: the kernel's three system calls through ctypes, standard library only.

Three uses. The daemon asks ``abi()`` which Landlock ABI the kernel offers (0: none). A thread
of the daemon confines itself with ``apply()`` before it starts an agent (``rcoder.agent.processes.confined``;
Landlock confines a thread and what it starts). And where that cannot do (an agent that needs
its own ``/proc/<pid>``, or no ``setpriv`` for its death signal), an agent is started through
an exec wrapper: ``rcoder/agent/confinement/confine.c`` built by ``make`` (the same steps in C, a bare
exec), or where it is not built this file run as a script::

    python -I -S -B landlock.py [--parent PID] [--user UID:GID] [--cap NAME]...
                                [--read PATH]... [--write PATH]...
                                [--connect PORT]... [--bind PORT]... -- ARGV...

which, in the new process and before the agent's program runs, builds a Landlock ruleset,
empties the capability bounding set but for the ``--cap`` ones (``CAPABILITIES``: what a
confined git of the checkpoints may keep; none for an agent) and clears the ambient set,
switches to ``UID`` and ``GID`` with no supplementary groups when given
(``rcoder.agent.confinement.agent_user``), sets ``PR_SET_PDEATHSIG=SIGKILL`` (after the switch, which clears
it; and exits if ``PID``, the daemon, is already gone) — the ruleset's ``--read``
paths readable and executable, ``--write`` paths readable and writable (never making a device
node or a device ioctl), nothing else on the file system; from ABI 4 TCP ``connect()`` only to
the ``--connect`` ports and ``bind()`` only to the ``--bind`` ones, on every address — keeps no
capability but the ``--cap`` ones in its permitted and effective sets (the inheritable set
empty), restricts itself with it (``no_new_privs`` first) and execs ``ARGV``. A Landlock
domain is inherited by every process the agent starts and can never be lifted, only narrowed:
shells, MCP servers and language servers live under it too.

Why a script and not ``preexec_fn``: the daemon has threads (grpc, the store's executor), and
Python code between fork and exec in a threaded process can deadlock on a lock another thread
held. ``-I -S`` keeps the interpreter's start-up to ~10-20 ms (no site-packages, no
environment); nothing is imported but ``os``, ``sys`` and ``ctypes``. A failure to confine is
an exit with code 126 and a line on stderr, never an unconfined agent.

Also scoped (ABI 6+): the agent cannot signal, or connect to abstract UNIX sockets of, processes
outside its domain (the daemon, other projects' agents). And from ABI 4, TCP: the agent connects
only to its profile's ports, so never to the store's or the daemon's on any address
(docs/confinement.md#security). UDP and UNIX sockets on disk are not Landlock's to restrict.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
import sys

_SYS_CREATE_RULESET, _SYS_ADD_RULE, _SYS_RESTRICT_SELF = 444, 445, 446  # the same on every architecture
_CREATE_RULESET_VERSION = 1
_RULE_PATH_BENEATH, _RULE_NET_PORT = 1, 2
_PR_SET_PDEATHSIG, _PR_SET_NO_NEW_PRIVS = 1, 38
_PR_CAPBSET_DROP, _PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL = 24, 47, 4
_CAPABILITY_VERSION_3 = 0x20080522
# the capabilities a confined command may keep (``--cap``), by name: the DAC overrides a confined
# git of the checkpoints needs to read or write an agent's files (docs/confinement.md#security)
CAPABILITIES = {"dac_override": 1, "dac_read_search": 2, "fowner": 3}
_SIGKILL = 9

EXECUTE, WRITE_FILE, READ_FILE, READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
_ABI1_FS = (1 << 13) - 1  # EXECUTE .. MAKE_SYM: reading, writing, making and removing files and folders
REFER, TRUNCATE, IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15  # ABI 2, 3, 5
READ = EXECUTE | READ_FILE | READ_DIR
MAKE_CHAR, MAKE_BLOCK = 1 << 6, 1 << 11
DEVICES = MAKE_CHAR | MAKE_BLOCK | IOCTL_DEV  # never granted: no device node made, no device ioctl
# the rights a rule on a file (not a folder) may carry
FILE_RIGHTS = EXECUTE | WRITE_FILE | READ_FILE | TRUNCATE | IOCTL_DEV
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1 << 0, 1 << 1  # ABI 6
BIND_TCP, CONNECT_TCP = 1 << 0, 1 << 1  # ABI 4: handled_access_net

# What a Landlock domain keeps from a confined agent, and the ABI that brought each (the daemon
# says at start and in ListAgents which hold on this kernel). Never at any ABI: connect() to a
# UNIX socket file on disk (the PostgreSQL socket, docker.sock, D-Bus), nor UDP.
TRUNCATE_ABI, NET_ABI, SCOPE_ABI = 3, 4, 6
PROMISES = (
    ("files", 1),  # no reading, writing, making or removing files outside its grants
    ("truncate", TRUNCATE_ABI),  # no truncating files outside its write grants
    ("network", NET_ABI),  # no TCP connect or bind but to its profile's ports
    ("signals", SCOPE_ABI),  # no signal to processes outside its domain (the daemon, other agents)
    ("abstract_unix_sockets", SCOPE_ABI),  # no connecting to abstract UNIX sockets outside it
)


def promises(version: int) -> dict[str, bool]:
    """Which of ``PROMISES`` hold under the Landlock ABI ``version`` (0: none)."""
    return {name: version >= needed for name, needed in PROMISES}


EXIT_NOT_CONFINED = 126  # as a shell says "found but could not run"
EXIT_NOT_FOUND = 127


class _RulesetAttr(ctypes.Structure):
    _fields_ = [
        ("handled_access_fs", ctypes.c_uint64),
        ("handled_access_net", ctypes.c_uint64),
        ("scoped", ctypes.c_uint64),
    ]


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


class _NetPortAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("port", ctypes.c_uint64)]


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    libc.prctl.restype = ctypes.c_int
    return libc


def _syscall(libc: ctypes.CDLL, number: int, *args: object) -> int:
    """``syscall(2)``, every integer argument passed as a C long (as the kernel reads them)."""
    values = [ctypes.c_long(a) if isinstance(a, int) else a for a in args]
    return int(libc.syscall(ctypes.c_long(number), *values))


def _prctl(libc: ctypes.CDLL, option: int, value: int, more: int = 0) -> int:
    return int(
        libc.prctl(
            ctypes.c_int(option), ctypes.c_ulong(value), ctypes.c_ulong(more), ctypes.c_ulong(0), ctypes.c_ulong(0)
        )
    )


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def _capabilities(libc: ctypes.CDLL) -> tuple[_CapHeader, ctypes.Array[_CapData]]:
    header, data = _CapHeader(_CAPABILITY_VERSION_3, 0), (_CapData * 2)()
    _check(libc.capget(ctypes.byref(header), data), "capget")
    return header, data


def bound(keep: int) -> None:
    """Every capability out of this thread's bounding set but ``keep`` (a mask), the ambient set
    cleared. Without ``CAP_SETPCAP`` the bounding set cannot shrink: a thread that holds no
    capability has nothing to lose then (``no_new_privs`` keeps an exec from granting any), one
    that holds some is refused."""
    libc = _libc()
    for cap in range(64):
        if keep & (1 << cap) or _prctl(libc, _PR_CAPBSET_DROP, cap) == 0:
            continue
        code = ctypes.get_errno()
        if code == errno.EINVAL:  # past the kernel's last capability
            break
        if code == errno.EPERM and not any(d.permitted for d in _capabilities(libc)[1]):
            break
        raise OSError(code, f"prctl(PR_CAPBSET_DROP, {cap}): {os.strerror(code)}")
    if _prctl(libc, _PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL) < 0 and ctypes.get_errno() != errno.EINVAL:
        _check(-1, "prctl(PR_CAP_AMBIENT_CLEAR_ALL)")


def hold(keep: int) -> None:
    """This thread's permitted and effective sets: ``keep`` (a mask) as far as still held; its
    inheritable set empty."""
    libc = _libc()
    header, data = _capabilities(libc)
    for word, item in enumerate(data):
        item.permitted &= (keep >> (32 * word)) & 0xFFFFFFFF
        item.effective, item.inheritable = item.permitted, 0
    _check(libc.capset(ctypes.byref(header), data), "capset")


def _check(result: int, what: str) -> int:
    if result < 0:
        code = ctypes.get_errno()
        raise OSError(code, f"{what}: {os.strerror(code)}")
    return result


def abi() -> int:
    """The Landlock ABI version this kernel offers; 0 when it has none (or it is disabled)."""
    if not sys.platform.startswith("linux"):
        return 0
    return max(_syscall(_libc(), _SYS_CREATE_RULESET, None, 0, _CREATE_RULESET_VERSION), 0)


# where abi() is 0, why (the errno of landlock_create_ruleset), so that an operator can act on it
SECCOMP_FIX = (
    "a seccomp filter refuses Landlock's system calls: in a container, a runtime whose default profile "
    "allows them (podman 4.2+, Docker 23+, containerd 1.6+) or a profile that does (docs/container.md)"
)
_WHY_NOT = {
    errno.EOPNOTSUPP: "the kernel has Landlock but it is off: add landlock to the lsm= boot parameter",
    errno.EPERM: SECCOMP_FIX,
}


def why_not() -> str:
    """Why this process cannot use Landlock, in words an operator can act on ("" when it can)."""
    if not sys.platform.startswith("linux"):
        return "Landlock is Linux's"
    if _syscall(_libc(), _SYS_CREATE_RULESET, None, 0, _CREATE_RULESET_VERSION) >= 0:
        return ""
    code = ctypes.get_errno()
    if code in _WHY_NOT:
        return _WHY_NOT[code]
    # ENOSYS: the kernel has no such calls (older than 5.13, or built without Landlock), or a
    # seccomp filter that answers ENOSYS for calls it does not know (podman's before 4.2)
    release = os.uname().release
    try:
        older = tuple(int(part) for part in release.split(".")[:2]) < (5, 13)
    except ValueError:
        older = False
    if older:
        return f"the kernel (Linux {release}) is older than Landlock (5.13)"
    return f"Linux {release} without Landlock built in (CONFIG_SECURITY_LANDLOCK), or {SECCOMP_FIX}"


def fs_rights(version: int) -> int:
    """Every file-system right the kernel of ABI ``version`` can restrict."""
    rights = _ABI1_FS
    if version >= 2:
        rights |= REFER
    if version >= 3:
        rights |= TRUNCATE
    if version >= 5:
        rights |= IOCTL_DEV
    return rights


def restrict(read: list[str], write: list[str], thread: bool = False, net: Ports = ((), ())) -> int:
    """Confine this process (and all it will start) to ``read`` and ``write``; the ABI used.

    A path that does not exist is skipped (it cannot be reached either). ``thread``: only the
    calling thread is confined, for what it starts; this process's own ``/proc/<pid>`` (what
    ``/proc/self`` resolves to here) is then never granted: it is not the agent's. ``net``: the
    TCP ports it may connect to and bind (ABI 4+; none by default)."""
    ruleset, version = build(read, write, thread, net)
    try:
        enforce(ruleset)
    finally:
        os.close(ruleset)
    return version


Ports = tuple[tuple[int, ...], tuple[int, ...]]  # (connect, bind): the TCP ports a ruleset allows


def build(read: list[str], write: list[str], thread: bool = False, net: Ports = ((), ())) -> tuple[int, int]:
    """The ruleset of ``restrict`` (its fd, the caller's to close; the ABI): it confines nothing
    until ``enforce``, and may be enforced by several threads in turn."""
    libc, version = _libc(), abi()
    if version < 1:
        raise OSError(0, "this kernel offers no Landlock")
    handled = fs_rights(version)
    # from ABI 4 TCP is handled too: a connect or bind to a port without a rule is refused (EACCES)
    handled_net = BIND_TCP | CONNECT_TCP if version >= NET_ABI else 0
    attr = _RulesetAttr(handled, handled_net, SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL if version >= 6 else 0)
    size = ctypes.sizeof(attr) if version >= 6 else 2 * ctypes.sizeof(ctypes.c_uint64)
    ruleset = _check(_syscall(libc, _SYS_CREATE_RULESET, ctypes.byref(attr), size, 0), "landlock_create_ruleset")
    try:
        for paths, rights in ((read, READ), (write, handled & ~DEVICES)):
            for path in paths:
                _allow(libc, ruleset, path, rights & handled, thread)
        if handled_net:
            for ports, right in zip(net, (CONNECT_TCP, BIND_TCP), strict=True):
                for port in ports:
                    rule = _NetPortAttr(right, port)
                    _check(_syscall(libc, _SYS_ADD_RULE, ruleset, _RULE_NET_PORT, ctypes.byref(rule), 0),
                           f"add_rule port {port}")  # fmt: skip
    except BaseException:
        os.close(ruleset)
        raise
    return ruleset, version


def enforce(ruleset: int) -> None:
    """Confine the calling thread, and all it will start, by ``ruleset`` (``no_new_privs`` first)."""
    libc = _libc()
    _check(_prctl(libc, _PR_SET_NO_NEW_PRIVS, 1), "prctl(PR_SET_NO_NEW_PRIVS)")
    _check(_syscall(libc, _SYS_RESTRICT_SELF, ruleset, 0), "landlock_restrict_self")


def _allow(libc: ctypes.CDLL, ruleset: int, path: str, rights: int, thread: bool = False) -> None:
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    try:
        if thread and _in_own_proc(fd):
            return
        if not _as_named(fd, path):
            return
        if not stat.S_ISDIR(os.fstat(fd).st_mode):
            rights &= FILE_RIGHTS
        rule = _PathBeneathAttr(rights, fd)
        _check(_syscall(libc, _SYS_ADD_RULE, ruleset, _RULE_PATH_BENEATH, ctypes.byref(rule), 0), f"add_rule {path}")
    finally:
        os.close(fd)


def _as_named(fd: int, path: str) -> bool:
    """Whether ``fd`` was opened at ``path`` itself, no link followed on the way. rcoder grants
    paths it resolved itself (``sandbox.around``); a link there now was put there since, by an
    agent that may write the folder around it, to have the rule bound to what the link points at
    (another project, ``data_dir``): such a path grants nothing. Checked on the opened fd, so no
    swap between the check and the rule is possible. ``/proc`` and ``/dev`` entries are named
    unresolved on purpose (``/proc/self`` is the agent's own, resolved in its process)."""
    named = os.path.normpath(os.path.abspath(path))
    if named.startswith(("/proc/", "/dev/")):
        return True
    return os.readlink(f"/proc/self/fd/{fd}") == named


def _in_own_proc(fd: int) -> bool:
    """Whether ``fd`` (as opened: every link followed, ``/dev/fd`` too) is in this process's own
    ``/proc/<pid>``."""
    where, own = os.readlink(f"/proc/self/fd/{fd}"), f"/proc/{os.getpid()}"
    return where == own or where.startswith(own + "/")


def parse(argv: list[str]) -> tuple[int, list[str], list[str], list[str]]:
    """(parent pid or 0, read paths, write paths, the command)."""
    parent, read, write = 0, list[str](), list[str]()
    args = iter(argv)
    for arg in args:
        if arg == "--":
            command = list(args)
            if not command:
                break
            return parent, read, write, command
        value = next(args, None)
        if value is None or arg not in ("--parent", "--user", "--cap", "--read", "--write", "--connect", "--bind"):
            break
        if arg == "--parent":
            parent = int(value)
        elif arg not in ("--user", "--cap", "--connect", "--bind"):  # read by user_of, kept_of, ports_of
            (read if arg == "--read" else write).append(value)
    raise ValueError(_USAGE)


_USAGE = (
    "usage: landlock.py [--parent PID] [--user UID:GID] [--cap NAME]... [--read PATH]... [--write PATH]... "
    "[--connect PORT]... [--bind PORT]... -- ARGV..."
)


def ports_of(argv: list[str]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The TCP ports (connect, bind) the wrapper's arguments ``argv`` allow (``--connect``, ``--bind``)."""
    head = argv[: argv.index("--")] if "--" in argv else argv
    connect, bind = list[int](), list[int]()
    for arg, value in zip(head[::2], head[1::2], strict=False):
        if arg in ("--connect", "--bind"):
            if not (value.isdigit() and 0 <= int(value) <= 65535):
                raise ValueError(f"{arg} {value}: not a TCP port")
            (connect if arg == "--connect" else bind).append(int(value))
    return tuple(connect), tuple(bind)


def kept_of(argv: list[str]) -> int:
    """The capabilities (a mask) the wrapper's arguments ``argv`` keep (``--cap``)."""
    head = argv[: argv.index("--")] if "--" in argv else argv
    keep = 0
    for arg, value in zip(head[::2], head[1::2], strict=False):
        if arg == "--cap":
            if value not in CAPABILITIES:
                raise ValueError(f"--cap {value}: not one of {', '.join(CAPABILITIES)}")
            keep |= 1 << CAPABILITIES[value]
    return keep


def user_of(argv: list[str]) -> tuple[int, int] | None:
    """The (uid, gid) the wrapper's arguments ``argv`` switch to, or None."""
    head = argv[: argv.index("--")] if "--" in argv else argv
    for arg, value in zip(head[::2], head[1::2], strict=False):
        if arg == "--user":
            uid, sep, gid = value.partition(":")
            if not (sep and uid.isdigit() and gid.isdigit()):
                raise ValueError(_USAGE)
            return int(uid), int(gid)
    return None


def switch_user(uid: int, gid: int) -> None:
    """Become ``uid`` and ``gid`` (real, effective and saved), with no supplementary groups: in
    the process that becomes the agent, never in a thread of the daemon (glibc switches every
    thread of a process)."""
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)


def apply(argv: list[str], thread: bool = False) -> list[str]:
    """Confine the calling thread (and all it will start) as the wrapper's arguments ``argv`` say,
    switching to their ``--user`` and then setting ``PR_SET_PDEATHSIG`` when they name a parent;
    the command they name. Raises ``OSError`` or ``ValueError``.

    The one implementation of "confine": the wrapper runs it in the process that becomes the
    agent, ``rcoder.agent.processes.confined`` (through ``ruleset_of``) in a thread that then starts the
    agent (``thread``; it never switches uid)."""
    parent, user, keep = parse(argv)[0], user_of(argv), kept_of(argv)
    # the rules are bound as the daemon's uid, as a confining thread binds them: the agent's uid
    # may not be able to open a granted path at all (then it cannot reach it either)
    ruleset, command, _ = ruleset_of(argv, thread)
    try:
        bound(keep)  # before the switch: dropping from the bounding set needs CAP_SETPCAP
        if user is not None:
            switch_user(*user)  # before the death signal: a credential change clears it
        hold(keep)
        if parent:
            _check(_prctl(_libc(), _PR_SET_PDEATHSIG, _SIGKILL), "prctl(PR_SET_PDEATHSIG)")
            if os.getppid() != parent:  # the daemon died before the death signal was armed
                raise OSError(0, "the daemon that started this agent is gone")
        enforce(ruleset)
    finally:
        os.close(ruleset)
    return command


def ruleset_of(argv: list[str], thread: bool = False) -> tuple[int, list[str], list[str]]:
    """The ruleset the wrapper's arguments ``argv`` say (its fd, the caller's to close), the
    command they name, and the paths its rules were bound to."""
    _, read, write, command = parse(argv)
    if thread and user_of(argv) is not None:  # would be ignored here: the agent would keep the daemon's uid
        raise ValueError("a thread of the daemon never switches uid: --user is the exec wrapper's")
    return build(read, write, thread, ports_of(argv))[0], command, [*read, *write]


def main(argv: list[str]) -> int:
    """The exec wrapper: confine, then become ``ARGV`` (returns only on failure)."""
    try:
        command = apply(argv)
    except (OSError, ValueError) as exc:
        sys.stderr.write(f"rcoder-landlock: the agent was not started, it could not be confined: {exc}\n")
        return EXIT_NOT_CONFINED
    try:
        os.execv(command[0], command)  # noqa: S606 - the agent, as its profile names it
    except OSError as exc:
        sys.stderr.write(f"rcoder-landlock: cannot run {command[0]}: {exc.strerror}\n")
        return EXIT_NOT_FOUND if isinstance(exc, FileNotFoundError) else EXIT_NOT_CONFINED
    raise AssertionError("execv returned")  # pragma: no cover


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

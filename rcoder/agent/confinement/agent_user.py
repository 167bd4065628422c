"""Which uid and gid agents run as (config ``agent_user``), decided once at the daemon's start.

Where the daemon can switch uid (root, or ``CAP_SETUID`` and ``CAP_SETGID`` in its effective
set) and ``agent_user`` names a user, every process rcoder starts as an agent (its own-delete
commands included) runs as that user's uid and primary gid, with no supplementary groups. Then
what the kernel's file modes and ``/proc`` keep from another uid holds without Landlock too: the
store's files, the ``auth_token`` file and rcoder's folders (the daemon's, 0600/0700) are not the
agent's to read; the daemon's ``/proc/<pid>`` (its environment) is not readable to it; it
cannot signal the daemon; and a PostgreSQL ``peer`` line judges the agent's uid, not the
daemon's.

``agent_user`` left at its default (``rcoder-agent``) on a machine without that user, or a daemon
that cannot switch: agents run as the daemon's user, and the start log (a warning) and
``ListAgents`` say so. Set explicitly (a name, or ``"UID:GID"``), a user that does not resolve
or that the daemon cannot switch to is a ``ConfigError``; ``""`` knowingly runs agents as the
daemon's user.
"""

from __future__ import annotations

import os
import pwd
from dataclasses import dataclass
from pathlib import Path

from rcoder.config import Settings
from rcoder.errors import ConfigError
from rcoder.logs import get_logger

log = get_logger(__name__)

DEFAULT = "rcoder-agent"
CAP_SETGID, CAP_SETUID = 6, 7
FIX_CREATE = f"useradd --system --no-create-home --shell /usr/sbin/nologin {DEFAULT}"


@dataclass(frozen=True, slots=True)
class AgentUser:
    """Who agents run as: a uid of their own (``separate``), or the daemon's (then ``reason``)."""

    uid: int
    gid: int
    name: str  # its passwd name; "" when it has none (a numeric agent_user)
    separate: bool
    reason: str = ""  # why agents run as the daemon's user (when not separate)
    fix: str = ""  # what gives them a uid of their own

    @property
    def switch(self) -> tuple[int, int] | None:
        """The (uid, gid) a spawn switches to; None: the agent runs as the daemon does."""
        return (self.uid, self.gid) if self.separate else None


def can_switch(status: str) -> bool:
    """Whether the process whose ``/proc/<pid>/status`` text is ``status`` may switch uid and gid:
    effective uid 0, or ``CAP_SETUID`` and ``CAP_SETGID`` in its effective capabilities."""
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    uids = fields.get("Uid", "").split()
    if len(uids) > 1 and uids[1] == "0":
        return True
    try:
        effective = int(fields.get("CapEff", "0").strip(), 16)
    except ValueError:
        return False
    needed = (1 << CAP_SETUID) | (1 << CAP_SETGID)
    return effective & needed == needed


def _own_status() -> str:
    try:
        return Path("/proc/self/status").read_text()
    except OSError:
        return f"Uid:\t{os.getuid()}\t{os.geteuid()}\n"  # no /proc: only root counts


def resolve(settings: Settings) -> AgentUser:
    """Who agents of this daemon run as (``agent_user``, set or its default); see ``resolve_value``."""
    return resolve_value(
        settings.agent_user, "agent_user" in settings.model_fields_set, key=settings.key_name("agent_user")
    )


def resolve_value(value: str, explicit: bool, status: str | None = None, key: str = "agent_user") -> AgentUser:
    """Who agents run as for ``agent_user = value`` (``explicit``: set, not the default);
    ``ConfigError`` for an explicit value that does not resolve, that the daemon cannot switch
    to, or for root or the daemon's own uid. ``status``: the ``/proc/<pid>/status`` of the
    process that would switch (this one's when None); ``key``: the setting as the file named it
    (``agent_processes.user``, or ``agent_user`` written flat)."""
    daemon_uid, daemon_gid = os.geteuid(), os.getegid()
    name_of = _name(daemon_uid)

    def as_daemon(reason: str, fix: str) -> AgentUser:
        return AgentUser(daemon_uid, daemon_gid, name_of, separate=False, reason=reason, fix=fix)

    if value == "":
        return as_daemon(f'{key} is set to ""', f'set {key} (e.g. "{DEFAULT}") to give agents a uid')
    target = _lookup(value)
    if target is None:
        if explicit:
            fix = 'a user of this machine, or a numeric "UID:GID"'
            raise ConfigError(key, f"{value!r} is no user of this machine (getent passwd {value}) "
                                            f"and not \"UID:GID\": create it ({FIX_CREATE.replace(DEFAULT, value)}), "
                                            f"or set {fix}, or \"\" to run agents as the daemon's user")  # fmt: skip
        return as_daemon(f"no user {value!r} on this machine", FIX_CREATE)
    uid, gid, name = target
    if uid == 0 or uid == daemon_uid:
        who = "root" if uid == 0 else f"the daemon's own uid ({daemon_uid})"
        raise ConfigError(key, f"{value!r} is {who}: agents must run as a uid of their own, "
                                        "or set \"\" to run them as the daemon's user knowingly")  # fmt: skip
    if not can_switch(_own_status() if status is None else status):
        reason = f"the daemon (uid {daemon_uid}) cannot switch uid (not root, no CAP_SETUID and CAP_SETGID)"
        fix = "run the daemon as root (or with CAP_SETUID and CAP_SETGID)"
        if explicit:
            raise ConfigError(key, f"{value!r} is set but {reason}: {fix}, or set \"\" to run agents "
                                            "as the daemon's user")  # fmt: skip
        return as_daemon(reason, fix)
    return AgentUser(uid, gid, name, separate=True)


def _lookup(value: str) -> tuple[int, int, str] | None:
    """(uid, primary gid, name) of ``value``: a user name, or numeric ``UID:GID``."""
    uid_text, sep, gid_text = value.partition(":")
    if sep:
        if not (uid_text.isdigit() and gid_text.isdigit()):
            return None
        uid, gid = int(uid_text), int(gid_text)
        return uid, gid, _name(uid)
    try:
        entry = pwd.getpwnam(value)
    except KeyError:
        return None
    return entry.pw_uid, entry.pw_gid, entry.pw_name


def _name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return ""


def log_agent_user(user: AgentUser) -> None:
    """Say at start who agents run as; a warning when it is the daemon's user."""
    if user.separate:
        log.info("agents_run_as", uid=user.uid, gid=user.gid, name=user.name or None, separate=True)
    else:
        log.warning("agents_run_as_daemon_user", uid=user.uid, gid=user.gid, name=user.name or None,
                    reason=user.reason, fix=user.fix,
                    effect="only Landlock keeps agents from the store, the auth_token file and the daemon's "
                           "/proc")  # fmt: skip

"""Leftovers of a killed daemon: each agent's process group is recorded, and ended at the next start.

Each agent's process group is recorded as ``<pid_dir>/<pid>`` holding the leader's start time.
``PR_SET_PDEATHSIG`` ends the leader when the daemon dies, but not its children; ``sweep`` at
the next start ends whatever is left of each group.
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

from rcoder.logs import get_logger

log = get_logger("rcoder.agent.process")


def _stat(pid: int | str) -> tuple[int, int] | None:
    """(process group, start time in clock ticks) of a live process, or None."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields[0] == "Z":
        return None
    return int(fields[2]), int(fields[19])


def record(pid_dir: Path, pid: int) -> Path | None:
    stat = _stat(pid)
    if stat is None:
        return None
    pid_dir.mkdir(parents=True, exist_ok=True)
    path = pid_dir / str(pid)
    path.write_text(str(stat[1]))
    return path


def sweep(pid_dir: Path) -> int:
    """SIGKILL what is left of agent groups recorded by an earlier daemon; returns how many processes."""
    if not pid_dir.is_dir():
        return 0
    groups: dict[int, int] = {}
    for path in pid_dir.iterdir():
        with contextlib.suppress(ValueError, OSError):
            groups[int(path.name)] = int(path.read_text() or 0)
        path.unlink(missing_ok=True)
    if not groups:
        return 0
    killed = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        stat = _stat(entry.name)
        # same group, started no earlier than its recorded leader: not a reused pid
        if stat is not None and stat[0] in groups and stat[1] >= groups[stat[0]]:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(int(entry.name), signal.SIGKILL)
                killed += 1
    if killed:
        log.warning("leftover_agents_killed", processes=killed, groups=len(groups))
    return killed

"""Leftovers of a killed daemon: each agent's process group and each daemon run's mark are
recorded, and what is left of them ended at the next start.

Each agent's process group is recorded as ``<pid_dir>/<pid>`` holding the leader's start time, and
each daemon run as ``<pid_dir>/tree-<instance>`` before it starts an agent: its agents' trees carry
``RCODER_AGENT_TREE=<instance>.<n>`` (``rcoder.agent.processes.tree``). ``PR_SET_PDEATHSIG`` ends the leader
when the daemon dies, but not what it started; ``sweep`` at the next start ends whatever is left of
each group, and every process carrying a recorded run's mark, with its descendants (what left the
group with ``setsid``, a double fork or as a daemon, re-parented to init once the daemon died).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from rcoder.agent.processes.tree import end, marked
from rcoder.logs import get_logger

log = get_logger(__name__)


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
    pid_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = pid_dir / str(pid)
    path.write_text(str(stat[1]))
    return path


_INSTANCE = "tree-"


def record_instance(pid_dir: Path, instance: str) -> None:
    """Record a daemon run's mark (``rcoder.agent.processes.tree``), before it starts any agent."""
    pid_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    (pid_dir / f"{_INSTANCE}{instance}").touch()


def forget_instance(pid_dir: Path, instance: str) -> None:
    """A daemon run stopped with every process below it ended: nothing carries its mark to sweep."""
    (pid_dir / f"{_INSTANCE}{instance}").unlink(missing_ok=True)


def sweep(pid_dir: Path) -> int:
    """SIGKILL what is left of agent groups and trees recorded by an earlier daemon; how many processes."""
    if not pid_dir.is_dir():
        return 0
    groups: dict[int, int] = {}
    instances: set[str] = set()
    for path in pid_dir.iterdir():
        if path.name.startswith(_INSTANCE):
            instances.add(path.name.removeprefix(_INSTANCE))
        with contextlib.suppress(ValueError, OSError):
            groups[int(path.name)] = int(path.read_text() or 0)
    if not groups and not instances:
        return 0
    # The leftovers are stopped until no new one is found, and only then killed, so that one that
    # forks meanwhile leaves no child behind.
    killed = end(lambda: _in_groups(groups) | marked(instances))
    for path in pid_dir.iterdir():  # once ended: a sweep cut short finds them again next time
        path.unlink(missing_ok=True)
    if killed:
        log.warning("leftover_agents_killed", processes=killed, groups=len(groups), daemon_runs=len(instances))
    return killed


def _in_groups(groups: dict[int, int]) -> set[int]:
    """Live processes of the recorded groups, started no earlier than their recorded leader (not a reused pid)."""
    if not groups:
        return set()
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        stat = _stat(entry.name)
        if stat is not None and stat[0] in groups and stat[1] >= groups[stat[0]]:
            found.add(int(entry.name))
    return found

"""Each git of the checkpoints confined by the kernel to what its job needs (docs/checkpoints.md#confinement).

A project's files are the agent's: it can make any path in it a link, and swap a folder for a
link while git reads or writes beneath it (``renameat2(RENAME_EXCHANGE)``), so that git, which
opens ``dir/file`` by its path, reads a file outside the project into the store, or writes one
outside it. No check in git or rcoder closes that race; the kernel does. Every git rcoder runs on a
project goes through the exec wrapper the agents use (``rcoder/landlock.py``, or its twin in C),
which execs git under a Landlock domain granting, per command (``grants``):

- a snapshot (``update-index --add``, or ``add``): the project read, the store and the project's
  index folder written (``check-ignore``: the project read);
- a restore (``read-tree``): the project and the index folder written, the store read;
- ``write-tree``, ``commit-tree``, ``hash-object``, ``mktree``, ``update-ref``, ``prune``, ``pack-objects``, ``init``:
  the store written (and the index folder for ``write-tree``; ``ls-files`` reads the index); any
  other command (``diff-tree``, ``rev-parse``,
  ``for-each-ref``...): the store read. A command that does not reach the project runs without
  ``GIT_WORK_TREE`` (and one that does not use the index without ``GIT_INDEX_FILE``): git would
  otherwise read a file of the project where its index says it is the blob it wants (diff). A
  new command that must reach the project is named in ``READS_PROJECT`` or ``WRITES_PROJECT``,
  or it fails (never silently reaches more);
- always: git itself and what it runs on (``system``: its binary, the libraries, the loader's
  cache), read, and ``/dev/null``.

With ``no_new_privs``, the death signal to the daemon (``--parent``), and no capability but the
one DAC capability the job needs when the daemon is root (``CAPABILITIES``: a snapshot reads an
agent's 0600 files, a restore writes into its 0700 folders; Landlock's rules hold whatever
capability the process has). git's environment carries the daemon run's mark (``env``), which the
sweep at the next start looks for (``rcoder.agent.processes.leftovers``): whatever git started (gc's repack)
is ended after a killed daemon too.

Where the kernel offers no Landlock (``wrapper`` None) git runs as before, in its own process
group and marked, and the daemon said so at start (``checkpoint_git_unconfined``).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

# what every git runs on, read: its binary and helpers (/usr/lib/git-core), the libraries, the
# dynamic loader's cache (never the rest of /etc: no system configuration is read), the random
# bytes that name its temporary files
GIT_SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc/ld.so.cache", "/dev/urandom")
GIT_DEVICES = ("/dev/null",)  # hooksPath, attributesFile and the global configuration point there
# a snapshot stores the files rcoder's walk names with ``update-index --add`` (``add`` is kept for
# any caller that still uses it); a restore to a snapshot recorded before rcoder listed files asks
# ``check-ignore`` which files the project's .gitignore files leave out
READS_PROJECT = frozenset({"add", "update-index", "check-ignore"})
WRITES_PROJECT = frozenset({"read-tree"})
WRITES_STORE = frozenset(
    {"add", "update-index", "write-tree", "commit-tree", "update-ref", "gc", "init", "hash-object", "mktree"}
    | {"prune", "pack-objects"}  # gc by pieces (CheckpointRepo.gc)
)
WRITES_INDEX = frozenset({"add", "update-index", "write-tree", "read-tree"})
READS_INDEX = frozenset({"ls-files"})
# the one DAC capability each job needs when the daemon is root and the agent's files are another
# uid's (``agent_user``): reading them (0600 files, 0700 folders) or writing into its folders
CAPABILITIES = {
    "add": ("dac_read_search",),
    "update-index": ("dac_read_search",),
    "check-ignore": ("dac_read_search",),
    "read-tree": ("dac_override",),
}


@dataclass(frozen=True, slots=True)
class Grants:
    """What one git command may reach."""

    read: tuple[str, ...]
    write: tuple[str, ...]
    caps: tuple[str, ...]


def command_of(args: Sequence[str]) -> str:
    """The git command ``args`` run (``-c`` settings and other options before it skipped)."""
    skip = False
    for arg in args:
        if skip:
            skip = False
        elif arg in ("-c", "-C"):
            skip = True
        elif not arg.startswith("-"):
            return arg
    return ""


def narrowed(args: Sequence[str], env: Mapping[str, str]) -> dict[str, str]:
    """``env`` without the project (``GIT_WORK_TREE``) for a command that does not reach it, and
    without the index (``GIT_INDEX_FILE``) for one that does not use it."""
    command = command_of(args)
    dropped = set()
    if command not in READS_PROJECT | WRITES_PROJECT:
        dropped.add("GIT_WORK_TREE")
    if command not in WRITES_INDEX | READS_INDEX:
        dropped.add("GIT_INDEX_FILE")
    return {name: value for name, value in env.items() if name not in dropped}


def grants(args: Sequence[str], env: Mapping[str, str]) -> Grants:
    """What ``git args`` with ``env`` (``GIT_DIR``, ``GIT_WORK_TREE``, ``GIT_INDEX_FILE``) may reach."""
    command = command_of(args)
    if command == "init":  # the store's folder, made before (it names itself as the last argument)
        return Grants((), (args[-1],), ())
    store, project, index = env.get("GIT_DIR", ""), env.get("GIT_WORK_TREE", ""), env.get("GIT_INDEX_FILE", "")
    read: list[str] = []
    write: list[str] = []
    (write if command in WRITES_STORE else read).append(store)
    if command in WRITES_PROJECT:
        write.append(project)
    elif command in READS_PROJECT:
        read.append(project)
    if command in WRITES_INDEX and index:
        # its folder: git writes ``<index>.lock`` and renames it over the index
        write.append(str(Path(index).parent))
    elif command in READS_INDEX and index:
        read.append(index)
    return Grants(tuple(p for p in read if p), tuple(p for p in write if p), CAPABILITIES.get(command, ()))


class GitJail:
    """How each git command is run: through ``wrapper`` (the exec wrapper's argv; None where the
    kernel has no Landlock), reading ``system``, with ``env`` (the daemon run's mark) added."""

    def __init__(self, wrapper: Sequence[str] | None, system: Sequence[str | Path], env: Mapping[str, str]) -> None:
        self.wrapper = list(wrapper) if wrapper is not None else None
        self._system = [str(p) for p in system]
        self._env = dict(env)
        self._git = shutil.which("git") or "git"  # the wrapper execs a path, it does not search PATH

    def command(self, args: Sequence[str], env: Mapping[str, str]) -> tuple[list[str], dict[str, str]]:
        """The argv and environment that run ``git args`` with ``env``, confined."""
        env = {**narrowed(args, env), **self._env}
        if self.wrapper is None:
            return ["git", *args], env
        granted = grants(args, env)
        jail = ["--parent", str(os.getpid())]
        jail += [a for cap in granted.caps for a in ("--cap", cap)]
        jail += [a for path in (*self._system, *granted.read) for a in ("--read", path)]
        jail += [a for path in (*GIT_DEVICES, *granted.write) for a in ("--write", path)]
        return [*self.wrapper, *jail, "--", self._git, *args], env

"""An agent's home the relay prepares (``StartSpec.home``): a home on a volume of the project, which
the daemon does not reach (docs/relay.md#a-named-volume-per-project).

Before the agent starts: the home made if missing (mode 0700), the kind's folders made and its
config files written (each replaced atomically, mode 0600), the agent's own TMPDIR made in the
home's ``tmp/``, and the home marked as one (``.rcoder-home``, as the daemon marks its own). After
the agent's exit, its TMPDIR removed. At the first agent of a home in this relay's life, whatever
earlier agents left in that ``tmp/`` is removed first: no agent of this relay runs there yet, and
one of an earlier relay's ended with it (a container's processes end with it), so this is the
sweep the daemon does of its own homes at its start (``rcoder.agent.prepare.sweep_tmpdirs``).

The daemon's own code does each step, so a home on a volume is made as one on the daemon's disk:
no link in the home followed (``safe_fs``: an agent may write its home and plant one), and what is
made in a folder given to that folder's owner.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from rcoder.agent.files import safe_fs
from rcoder.agent.prepare import remove_tmpdir
from rcoder.agent.profiles.homes import HOME_MARK
from rcoder.logs import get_logger

log = get_logger("rcoder.relay.agent_home")


@dataclass(frozen=True, slots=True)
class AgentHome:
    """What the relay prepares in one agent's home (checked by ``rcoder.relay.service``)."""

    path: Path  # absolute
    files: Mapping[str, str]  # relative path: text
    folders: tuple[str, ...]  # relative paths
    tmpdir: str  # the agent's TMPDIR's name in ``tmp/``

    @property
    def own_tmp(self) -> Path:
        return self.path / "tmp" / self.tmpdir


class Homes:
    """The homes this relay prepared: each swept once, at its first agent, under a lock of its own
    (two agents of one home starting at once: the second never finds its TMPDIR swept)."""

    def __init__(self) -> None:
        self._swept: set[Path] = set()
        self._locks: dict[Path, asyncio.Lock] = {}

    async def prepare(self, home: AgentHome) -> None:
        """``home`` ready for its agent (off the event loop); ``OSError`` or ``UnsafePath`` when it
        cannot be."""
        async with self._locks.setdefault(home.path, asyncio.Lock()):
            sweep = home.path not in self._swept
            await asyncio.to_thread(_prepare, home, sweep)
            self._swept.add(home.path)

    @staticmethod
    async def ended(home: AgentHome) -> None:
        """The agent of ``home`` has ended: its TMPDIR removed (what cannot be is said, and left to
        the home's next sweep)."""
        await asyncio.to_thread(remove_tmpdir, home.path, home.own_tmp)


def _prepare(home: AgentHome, sweep: bool) -> None:
    root = home.path
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    if root.stat().st_uid == os.geteuid():  # a volume's root is made by its driver, mode 0755
        os.chmod(root, 0o700)
    if sweep:
        left = safe_fs.listdir(root, root / "tmp")
        for entry in left:
            remove_tmpdir(root, root / "tmp" / entry)
        if left:
            log.info("relay_home_tmp_swept", home=str(root), entries=len(left))
    for folder in home.folders:
        safe_fs.makedirs(root, root / folder)
    for path, text in home.files.items():
        safe_fs.write_text(root, root / path, text)
    safe_fs.makedirs(root, home.own_tmp)
    if not safe_fs.exists(root, root / HOME_MARK):
        safe_fs.write_text(root, root / HOME_MARK, "per-project home of rcoder, on a volume (docs/relay.md)\n")

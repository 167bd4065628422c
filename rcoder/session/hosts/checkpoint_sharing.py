"""Whether this host's ``checkpoint_root`` is the other hosts' (docs/design/hosts.md#checkpoint-roots).

A project's checkpoints live under ``checkpoint_root``; a turn's snapshots are in the store of
the host that ran it. Hosts that share a PostgreSQL store but each keep a host-local
``checkpoint_root`` (the default, ``<data_dir>/checkpoints``) cannot read each other's: another
host answers ``NO_CHECKPOINT`` for every run of the first. Nothing in the configuration says
whether a folder is shared storage, so each host leaves a **mark** in its ``checkpoint_root``
(``.rcoder-hosts/<sha256 of its host_id>``, holding the id) and looks for the other hosts' marks
there: a live host of the store whose mark is missing does not share this host's
``checkpoint_root``.

Said at start (``checkpoint_root_not_shared``, once per such host, with what it costs), again
when a host that does not share it shows up later (checked every ``CHECK_EVERY`` lease_ttl),
in ``ListHosts`` (``shares_checkpoint_root``) and in the ``NO_CHECKPOINT`` answer for a run that
ran on such a host (it names that host). Not refused: one host of several serving its own
projects' checkpoints is a working, if partial, setup. With SQLite (one host) or checkpoints
off, nothing is marked or checked.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
from pathlib import Path

from rcoder.errors import NoCheckpoint, StoreError
from rcoder.logs import get_logger
from rcoder.session.hosts.leases import LeaseKeeper
from rcoder.store.cluster import HostRecord

log = get_logger(__name__)
MARKS = ".rcoder-hosts"  # never a project's store: those are <project_id>.git
CHECK_EVERY = 10  # lease_ttl: how often the hosts are looked at again for one that does not share
COST = (
    "GetRunChanges and RewindSession answer NO_CHECKPOINT here for every run made there, and there for every run "
    "made here; set one checkpoints.root on storage every host shares (docs: Checkpoints, Several hosts)"
)


def mark_name(host_id: str) -> str:
    """A host's mark: a file name whatever its id holds (a ``host:port``, a pod's name)."""
    return hashlib.sha256(host_id.encode()).hexdigest()[:32]


class CheckpointSharing:
    def __init__(self, root: Path, enabled: bool, leases: LeaseKeeper) -> None:
        self._root = root
        self._leases = leases
        self.active = enabled and leases.shared  # several hosts may share the store, and checkpoints are on
        self._told: set[str] = set()  # the hosts already said not to share it
        self._checking: asyncio.Task[None] | None = None

    def _marks(self) -> Path:
        return self._root / MARKS

    def mark(self) -> None:
        """Leave this host's mark (at start, before the first check; the folder made as the
        checkpoint stores are: 0700)."""
        marks = self._marks()
        marks.mkdir(mode=0o700, parents=True, exist_ok=True)
        path = marks / mark_name(self._leases.host_id)
        if not path.is_file():
            temp = path.with_suffix(".tmp")
            temp.write_text(self._leases.host_id + "\n")
            os.replace(temp, path)

    def shares(self, host_id: str) -> bool:
        """Whether ``host_id``'s mark is in this host's ``checkpoint_root`` (this host: yes)."""
        if not self.active or host_id == self._leases.host_id:
            return True
        return (self._marks() / mark_name(host_id)).is_file()

    async def start(self) -> None:
        """Mark, say which live hosts do not share it, and look again every ``CHECK_EVERY`` lease_ttl."""
        if not self.active:
            return
        try:
            await asyncio.to_thread(self.mark)
            await self.check()
        except OSError as exc:  # no checkpoint store can be written there either: its snapshots say so
            log.warning("checkpoint_sharing_unchecked", checkpoint_root=str(self._root), error=str(exc)[:300])
        self._checking = asyncio.get_running_loop().create_task(self._check_forever(), name="checkpoint-sharing")

    async def _check_forever(self) -> None:
        while True:
            await asyncio.sleep(self._leases.lease_ttl * CHECK_EVERY)  # a period, not synchronisation
            try:
                await self.check()
            except (StoreError, OSError) as exc:  # the next round may fare better
                log.warning("checkpoint_sharing_unchecked", error=str(exc)[:300])
            except Exception as exc:  # a bug, not the store: logged, and looked at again next round
                log.exception("checkpoint_sharing_crashed", error=repr(exc))

    async def check(self) -> list[HostRecord]:
        """The live hosts that do not share this host's ``checkpoint_root``; each said once."""
        hosts = await self._leases.coordination.hosts()
        strangers = [h for h in hosts if h.live and not await asyncio.to_thread(self.shares, h.host_id)]
        for host in strangers:
            if host.host_id not in self._told:
                self._told.add(host.host_id)
                log.warning("checkpoint_root_not_shared", checkpoint_root=str(self._root), host=host.host_id,
                            address=host.advertise_address, effect=COST)  # fmt: skip
        return strangers

    async def explained(self, error: NoCheckpoint, run_id: str) -> NoCheckpoint:
        """``error`` naming the host that ran ``run_id`` when that host does not share this host's
        ``checkpoint_root``: its snapshots are there, not here."""
        if not self.active or not run_id:
            return error
        try:
            owner = await self._leases.coordination.run_owner(run_id)
        except StoreError:
            return error
        if owner is None or await asyncio.to_thread(self.shares, owner.host_id):
            return error
        where = f" ({owner.advertise_address})" if owner.advertise_address else ""
        return NoCheckpoint(
            run_id,
            error.metadata.get("which", "before"),
            f"it ran on host {owner.host_id}{where}, whose checkpoints.root is not this host's ({self._root} has no "
            f"mark of it): its snapshots are in that host's store. Set one checkpoints.root on storage every host "
            f"shares",
            host_id=owner.host_id,
        )

    async def aclose(self) -> None:
        checking, self._checking = self._checking, None
        if checking is not None:
            checking.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await checking

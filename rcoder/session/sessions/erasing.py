"""``DeleteSession`` on the host that serves the session (its owner, or any when none holds it).

In order, while no new turn may claim the session (``LiveSessions.deleting``):

1. every turn queued for the session is refused (``SessionDeleting``: its stream ends ``ABORTED``),
   then a running turn is cancelled, and waited for (bounded) until it has ended ``CANCELLED``;
2. the session's live agent is ended (its lease released with it);
3. the store erases its runs, their events, its transcript and record (and, with several hosts,
   its lease and signals), in one transaction: a turn another host might start meanwhile finds
   no lease and no record, and its writes are refused;
4. this host forgets the runs it kept for ``Subscribe``;
5. the agent's own copy of the conversation is removed from its home here: its files, where
   rcoder knows the kind's layout (``rcoder.agent.profiles.erase``), or by the agent's own delete command
   where the kind keeps a store of its own (OpenCode: ``rcoder.agent.own_delete``, bounded by
   ``agent_erase_timeout``, run only now that the session's agent has ended): what could not be
   is said, never hidden. It comes last so that nothing it does can keep the store's erasure
   from happening.

A fork is a session of its own and is left as it is. When another session names the same agent
session (it adopted it), the agent's files are left for it.
"""

from __future__ import annotations

import asyncio

from rcoder.agent.launcher import AgentLauncher
from rcoder.agent.pool import AgentPool
from rcoder.config import Settings
from rcoder.domain import RunRecord, SessionErased, SessionRecord
from rcoder.errors import NotFound, RcoderError, SessionBusy, SessionDeleting, UnsafePath
from rcoder.logs import get_logger
from rcoder.session.runs.run import RunRegistry
from rcoder.session.turns.checkpoints import Checkpoints
from rcoder.session.turns.live_sessions import LiveSessions
from rcoder.store.base import SessionStore

log = get_logger(__name__)
TURN_END_MARGIN = 5.0  # seconds past a cancelled turn's own bounds before the delete gives up


class SessionEraser:
    def __init__(
        self,
        settings: Settings,
        store: SessionStore,
        launcher: AgentLauncher,
        pool: AgentPool,
        runs: RunRegistry,
        live: LiveSessions,
        checkpoints: Checkpoints,
    ) -> None:
        self._settings = settings
        self._store = store
        self._launcher = launcher
        self._pool = pool
        self._runs = runs
        self._live = live  # the session's owner: its running turn is cancelled, its waiting ones refused
        self._checkpoints = checkpoints

    async def erase(self, session_id: str) -> SessionErased:
        record = await self._store.get_session(session_id)
        if record is None:
            raise NotFound("session", session_id, "no session with this id (it may have been deleted)")
        with self._live.deleting(session_id):
            # The waiting turns are refused before the running one is cancelled, so that none of them
            # takes the session over when the running turn lets go of it.
            refused = self._live.refuse_waiting(session_id, SessionDeleting(session_id))
            cancelled = await self._end_turn(session_id)
            # The cancelled turn may have opened a new agent session (a fallback), so the record is
            # read again as the turn left it.
            if cancelled:
                record = await self._store.get_session(session_id) or record
            stopped = await self._pool.close(session_id)
            runs = await self._runs_of(session_id)
            deleted = await self._store.delete_session(session_id)
            if deleted is None:
                raise NotFound("session", session_id, "deleted meanwhile by another request")
            self._runs.forget_session(session_id)
            removed, left = await self._erase_agent_copy(record)
            left += await self._erase_checkpoints(record, runs)
        log.info("session_deleted", session_id=session_id, runs=deleted.runs, agent_stopped=stopped,
                 turn_cancelled=cancelled, queued_refused=refused, agent_files=len(removed),
                 left=len(left))  # fmt: skip
        return SessionErased(deleted, stopped, cancelled, tuple(removed), tuple(left))

    async def _end_turn(self, session_id: str) -> bool:
        """Cancel the session's running turn, if any, and wait until it has ended."""
        holder = self._live.holder(session_id)
        if holder is None:
            return False
        if self._live.phase(holder.run_id) is None:  # not a turn: a rewind holds it, and is not cancelled
            raise SessionBusy(session_id, holder.run_id)
        ended = asyncio.Event()
        holder.add_done_callback(lambda _: ended.set())
        self._live.cancel(holder.run_id)
        settings = self._settings
        bound = settings.cancel_grace + 4 * settings.agent_stop_grace + TURN_END_MARGIN
        try:
            async with asyncio.timeout(bound):
                await ended.wait()
        except TimeoutError:
            raise SessionBusy(session_id, holder.run_id) from None
        return True

    async def _runs_of(self, session_id: str) -> list[RunRecord]:
        """Every run of the session (their snapshots go with it)."""
        runs: list[RunRecord] = []
        after = None
        while True:
            page = await self._store.list_runs(session_id, 1000, after)
            runs += page
            if len(page) < 1000:
                return runs
            after = (page[-1].started_at, page[-1].run_id)

    async def _erase_checkpoints(self, record: SessionRecord, runs: list[RunRecord]) -> list[str]:
        """The session's snapshots (docs/checkpoints.md#lifetime): the refs of its commits that
        no other session of the project names, or the project's whole checkpoint store with its
        last session. What could not be is said."""
        commits = {c for r in runs for c in (r.checkpoint_before, r.checkpoint_after) if c}
        try:
            await self._store.delete_run_checkpoints(record.session_id)
            left = not await self._store.list_sessions(record.project_id, limit=1)
            run_ids = [r.run_id for r in runs]
            await self._checkpoints.forget_runs(record.project_id, run_ids, commits, left, record.agent)
        except (RcoderError, OSError) as exc:
            log.warning("checkpoints_not_erased", session_id=record.session_id, error=str(exc)[:300])
            return [f"the session's checkpoints could not be removed: {exc}"]
        return []

    async def _erase_agent_copy(self, record: SessionRecord) -> tuple[list[str], list[str]]:
        provider_id = record.provider_session_id
        if not provider_id:
            return [], []
        sharer = await self._store.find_session_by_provider_id(record.agent, provider_id)
        if sharer is not None:
            why = f"session {sharer.session_id} continues the agent's session {provider_id}: its files were left"
            return [], [why]
        profile = self._settings.profile(record.agent)
        if profile is None:
            why = f"no agent profile {record.agent!r} is configured: its files of session {provider_id} were left"
            return [], [why]
        try:
            erased = await self._launcher.erase_conversation(profile, record.cwd, provider_id)
        except (UnsafePath, OSError) as exc:
            why = exc.message if isinstance(exc, UnsafePath) else f"{type(exc).__name__}: {exc}"
            log.warning("agent_files_not_erased", provider_session_id=provider_id, error=why[:300])
            return [], [f"the agent's files of session {provider_id} could not be removed: {why}"]
        return erased.removed, erased.left

"""What a turn writes to the store besides its events: its start (and a new session's record),
the session's options and commands as its agent reports them, and an end the store refused,
retried later."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace
from datetime import datetime

from tenacity import AsyncRetrying, retry_if_exception, stop_after_delay, wait_exponential

from rcoder.agent.pool import AgentPool
from rcoder.domain import ChatTurn, RunRecord, RunStarted, RunStatus, SessionRecord
from rcoder.errors import LeaseLost, StoreError
from rcoder.logs import get_logger
from rcoder.session.hosts.leases import LeaseKeeper
from rcoder.session.resume import options
from rcoder.session.resume.opening import TurnPlan
from rcoder.session.turns.agent_handle import AgentHandle
from rcoder.store.base import RunEnd, SessionStore
from rcoder.store.cluster import Lease

log = get_logger(__name__)
# How long the end of a turn that the store refused is retried.
END_RETRY_FOR = 60.0


def session_state(record: SessionRecord, turn: ChatTurn, conn: AgentHandle | None) -> SessionRecord | None:
    """``record`` with the options and commands its agent reports now, and the turn's choices;
    None when nothing of them changed."""
    if conn is None:
        return None
    offered = conn.options
    chosen = options.chosen_after(record.chosen_options, turn.config_options, offered)
    state = options.state_of(offered, chosen, conn.commands, record.commands)
    if state == (record.config_options, record.chosen_options, record.commands):
        return None
    return replace(record, config_options=state[0], chosen_options=state[1], commands=state[2])


class TurnRecords:
    def __init__(
        self, store: SessionStore, pool: AgentPool, clock: Callable[[], datetime], leases: LeaseKeeper
    ) -> None:
        self._store = store
        self._pool = pool
        self._clock = clock
        self._leases = leases  # an end retried is written under its lease: kept until then
        self._late: set[asyncio.Task[None]] = set()  # ends of turns the store refused, retried

    async def record_start(
        self, plan: TurnPlan, body: RunStarted, conn: AgentHandle | None, checkpoint: str = ""
    ) -> None:
        """Record the run as started (with ``checkpoint``, the commit of its before snapshot:
        docs/checkpoints.md), and the session first when it is new."""
        now = self._clock()
        if plan.record is None:
            record = SessionRecord(
                session_id=plan.session_id,
                project_id=plan.turn.project_id,
                cwd=plan.cwd,
                agent=plan.profile.name,
                provider_session_id=body.provider_session_id,
                created_at=now,
                updated_at=now,
            )
            changed = session_state(record, plan.turn, conn)
            record = changed or record
            await self._store.create_session(record, lease=plan.lease)
            plan.record = record
            if conn is not None:
                conn.state_stored(conn.state_version)
        else:
            if body.provider_session_id and plan.record.provider_session_id != body.provider_session_id:
                # The provider's id is written only from this session's own agent's answer.
                await self._store.set_provider_session_id(
                    plan.session_id, body.provider_session_id, now, lease=plan.lease
                )
                plan.record = replace(plan.record, provider_session_id=body.provider_session_id, updated_at=now)
            await self.store_state(plan, conn, now)
        await self._store.start_run(
            RunRecord(
                run_id=plan.run_id,
                session_id=plan.session_id,
                status=RunStatus.RUNNING,
                started_at=now,
                resume=body.resume,
                resume_method=body.resume_method.value,
                fallback_reason=body.fallback_reason,
                request_id=plan.turn.request_id,
                prompt=plan.turn.prompt,
                client=plan.turn.client,
                checkpoint_before=checkpoint,
            ),
            lease=plan.lease,
        )
        # The next live turn plans from this record without reading the store: it is what the
        # store holds now.
        plan.record = replace(plan.record, last_run_id=plan.run_id)
        self._pool.remember(plan.record)

    @staticmethod
    def state_unchanged(plan: TurnPlan, conn: AgentHandle | None) -> bool:
        """Whether ``store_state`` has nothing to write, known without any I/O: the record holds
        what this agent reported, and this turn chose no option."""
        if conn is None:
            return True
        return conn.state_version == conn.stored_state_version and not plan.turn.config_options

    async def store_state(self, plan: TurnPlan, conn: AgentHandle | None, now: datetime) -> None:
        """Store the session's options and commands where this turn changed them (rarely: a
        turn that sets no option on an agent that lists nothing new writes nothing)."""
        assert plan.record is not None
        if conn is None or self.state_unchanged(plan, conn):
            return
        version = conn.state_version
        changed = session_state(plan.record, plan.turn, conn)
        if changed is not None:
            changed = replace(changed, updated_at=now)
            await self._store.set_session_state(changed, lease=plan.lease)
            plan.record = changed
            self._pool.remember(changed)
        conn.state_stored(version)

    async def run_recorded(self, run_id: str) -> bool:
        return await self._store.get_run(run_id) is not None

    def finish_later(self, run_id: str, end: RunEnd, lease: Lease | None) -> None:
        """Retry storing an end the store refused, in a task of its own that shutdown does not
        wait for (``aclose`` cancels it). Its lease is kept until then, from now on: the turn lets
        go of its agent next, and of the lease with it, and the late write would be refused as
        another host's (docs/design/hosts.md#leases)."""
        task = asyncio.create_task(self._finish_later(run_id, end, lease), name=f"record-end-{run_id}")
        self._late.add(task)
        task.add_done_callback(self._late.discard)
        if lease is not None:
            self._leases.keep(lease)
            task.add_done_callback(lambda _: self._leases.kept_done(lease))  # stored, given up or cancelled

    async def _finish_later(self, run_id: str, end: RunEnd, lease: Lease | None) -> None:
        """Retry (bounded) storing the end the stream already published, so the store comes to
        say the same; a daemon stopped meanwhile leaves it to the next start (``interrupted``)."""
        retrying = AsyncRetrying(
            retry=retry_if_exception(lambda exc: isinstance(exc, StoreError) and not exc.closed),
            wait=wait_exponential(multiplier=0.2, max=5),
            stop=stop_after_delay(END_RETRY_FOR),
            reraise=True,
        )
        try:
            async for attempt in retrying:
                with attempt:
                    await self._store.finish_run(run_id, replace(end, ended_at=self._clock(), transcript=None), lease)
        except (StoreError, LeaseLost) as exc:
            log.error("run_end_never_stored", run_id=run_id, error=exc.message)  # noqa: TRY400
            return
        log.info("run_end_stored_late", run_id=run_id)

    async def aclose(self) -> None:
        """Stop retrying late writes of ends (the next start marks those runs ``interrupted``)."""
        tasks = list(self._late)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)

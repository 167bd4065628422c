"""Homes of the old layout (one per profile, shared by every project) are migrated to one per
project, and the real agents still resume their sessions from them; OpenCode, whose sessions
rcoder does not split, falls back to a new session reseeded from rcoder's transcript.

The old layout is made the way the old daemon left it: sessions are created, the daemon is
stopped, and each project's home is folded back into ``<data_dir>/agents/<profile>``.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest

from rcoder.agent.profiles.homes import HOME_MARK, LAYOUT_MARK, SHARED
from rcoder.v1 import agent_runner_pb2 as pb
from tests.conftest import DaemonFactory
from tests.harness import started, text_of
from tests.real_agents.conftest import AGENT_TIMEOUTS, AUTO_ROUTE, ModelServers, turn

# (Gemini's load may wait up to a minute, for the one after its session's creation: the launcher
# reads that from the migrated home)
MIGRATED = ("claude", "codex", "gemini")
NOT_SPLIT = ("opencode",)


def fold_into_the_old_layout(data_dir: Path, profile: str) -> None:
    homes = data_dir / "agents" / profile
    (homes / LAYOUT_MARK).unlink()
    for home in [p for p in homes.iterdir() if p.is_dir()]:
        for entry in home.iterdir():
            if entry.name not in (HOME_MARK, "tmp") and not (homes / entry.name).exists():
                entry.rename(homes / entry.name)
        shutil.rmtree(home)


@pytest.mark.timeout(300)
async def test_sessions_in_an_old_shared_home_resume_from_their_projects_new_home(
    make_daemon: DaemonFactory, servers: ModelServers, tmp_path: Path
) -> None:
    agents = (*MIGRATED, *NOT_SPLIT)
    settings = {**AGENT_TIMEOUTS, "default_agent": "claude"}
    daemon, client = await make_daemon(servers.profiles(*agents), **settings)
    firsts = await asyncio.gather(*(turn(client, agent, "remember 42") for agent in agents))
    assert await daemon.stop() == 0
    data_dir = tmp_path / "data"
    for agent in agents:
        fold_into_the_old_layout(data_dir, agent)

    daemon, client = await make_daemon(servers.profiles(*agents), **settings)
    after = await asyncio.gather(
        *(
            turn(client, agent, "which number?", first[0].session_id)
            for agent, first in zip(agents, firsts, strict=True)
        )
    )

    for agent, first, events in zip(agents, firsts, after, strict=True):
        begin = started(events)
        assert text_of(events) == "I remember: 42", agent
        if agent in MIGRATED:
            assert begin.resume == pb.RESUME_OUTCOME_RESUMED, (agent, begin)
            assert begin.resume_method == AUTO_ROUTE[agent]
            assert begin.provider_session_id == started(first).provider_session_id
        else:
            assert begin.resume == pb.RESUME_OUTCOME_FALLBACK_RESEEDED, (agent, begin)
        assert (data_dir / "agents" / agent / SHARED).is_dir(), "the old home, set aside"
        assert (data_dir / "agents" / agent / f"proj-{agent}" / HOME_MARK).is_file()
    migrated = {row["kind"] for row in daemon.logs("agent_home_migrated")}
    assert migrated == set(MIGRATED)

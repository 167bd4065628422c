"""Every stream ends at a SIGTERM drain, whatever state the session's turns are in (issue 39).

One daemon (SQLite, the fake agent) holds six sessions, one in each state of ``tests/lifecycle.py``,
when it gets one SIGTERM. Its ``shutdown_grace`` is short, so the drain cancels what still runs.
The test asserts that the daemon exits 0 within its bound, that every stream gets the end
``TABLE`` says (``completed``, or a status that is not UNKNOWN), that no agent process is left,
and that after a restart on the same ``data_dir`` each session's next turn works (it resumes).

Columns: the state; how the turn that ran (or was starting) ends; how each queued turn ends
(``*2``: both, alike). ``-``: nothing there.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from tests.conftest import assert_stores_consistent, base_settings, exited
from tests.harness import Client, Daemon, FakeAgentSetup, processes_mentioning, write_config
from tests.lifecycle import GATE, STATES, TELL, Teller, agent_pids, end_of, make_scenes, next_turn_works
from tests.test_lifecycle import together

TABLE = """
idle        -                    -
starting    completed:CANCELLED  -
running     completed:CANCELLED  -
permission  completed:CANCELLED  -
queued1     completed:CANCELLED  UNAVAILABLE:SHUTTING_DOWN
queued2     completed:CANCELLED  UNAVAILABLE:SHUTTING_DOWN*2
"""
ENDS = {row[0]: tuple(row[1:]) for row in (line.split() for line in TABLE.strip().splitlines())}
DRAIN_BOUND = 15.0  # seconds: shutdown_grace, then cancel_grace and the agents' stop, with room


async def test_a_sigterm_ends_every_stream_of_every_state_and_each_session_resumes_after_a_restart(
    tmp_path: Path,
) -> None:
    assert sorted(ENDS) == sorted(STATES)
    fake = FakeAgentSetup(tmp_path)
    gate, tell = fake.folder / GATE, fake.folder / TELL
    profile = fake.profile("--hang-if-exists", str(gate), "--tell", str(tell))
    config = write_config(tmp_path / "rcoder.toml", {"fake": profile}, **base_settings(tmp_path),
                          max_queued_turns=2, shutdown_grace=0.3, cancel_grace=3)  # fmt: skip
    async with Teller(tell) as teller:
        daemon = await Daemon(config).start()
        client = Client(daemon.channel())
        try:
            scenes = await make_scenes(daemon, client, teller, gate, "sigterm")
            async with asyncio.timeout(DRAIN_BOUND):
                assert await daemon.stop() == 0
            got = {}
            for scene in scenes:  # each stream ended as the daemon went: read at once
                ends = [together([await end_of(s, 0.5) for s in scene.of(role)]) for role in ("running", "queued")]
                got[scene.state] = tuple(ends)
        finally:
            await client.channel.close()
            await daemon.kill()
        assert got == ENDS
        assert agent_pids(daemon) == set()
        assert processes_mentioning(str(fake.state_dir)) == []

        again = await Daemon(config).start()
        client = Client(again.channel())
        try:
            for scene in scenes:  # the same sessions, on the daemon started anew on the same data_dir
                scene.daemon, scene.client = again, client
            await asyncio.gather(*(next_turn_works(scene) for scene in scenes))
            async with asyncio.timeout(DRAIN_BOUND):
                assert await again.stop() == 0
        finally:
            await client.channel.close()
            await again.kill()
        for pid in agent_pids(again):
            await exited(pid)
        assert processes_mentioning(str(fake.state_dir)) == []
        assert_stores_consistent(tmp_path)

"""An agent's home the relay prepares (``StartSpec.home``, docs/relay.md#a-named-volume-per-project):
the kind's files and folders written before the agent starts, its TMPDIR made and removed after its
exit, what earlier agents left in the home's ``tmp/`` swept at the home's first agent, no link in the
home followed, and a home that names a path out of it refused.

A real relay (tests/relay/relay_kit.py), a real gRPC client on its unix socket, the scripted fake
agent (tests/fakes/fake_agent.py) spawned confined through it.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from rcoder.relay.v1 import relay_pb2 as pb
from rcoder.relay.v1 import relay_pb2_grpc as pb_grpc
from tests.harness import eventually
from tests.relay.conftest import RelayFactory
from tests.relay.relay_kit import AcpOverAttach, chunks, fake_agent_spec
from tests.relay.test_relay import open_session, prompt, spawn

SETTINGS = '{"general": {"enableAutoUpdate": false}}\n'


def with_home(spec: pb.StartSpec, home: str, own: str, **fields: object) -> pb.StartSpec:
    """``spec`` with a home the relay prepares at ``home`` (its HOME and TMPDIR in the agent's env, the
    home granted): a kind's file and folder, the agent's TMPDIR ``own``; ``fields`` replace those."""
    made = pb.StartSpec()
    made.CopyFrom(spec)
    made.env["HOME"], made.env["TMPDIR"] = home, f"{home}/tmp/{own}"
    made.confinement.write_paths.append(home)
    given = {"path": home, "files": [pb.HomeFile(path=".gemini/settings.json", text=SETTINGS)],
             "folders": ["cache/deep"], "tmpdir": own, **fields}  # fmt: skip
    made.home.CopyFrom(pb.AgentHome(**given))  # type: ignore[arg-type]
    return made


async def test_the_relay_writes_an_agents_home_before_it_starts_and_removes_its_tmpdir_after_its_exit(
    make_relay: RelayFactory, tmp_path: Path
) -> None:
    relay = await make_relay()
    home = tmp_path / "home"
    left = home / "tmp" / "agent-left-by-an-earlier-relay"
    left.mkdir(parents=True)
    (left / "scratch").write_text("old")
    base = fake_agent_spec(tmp_path / "agent", tmp_path / "project")
    async with relay.channel() as channel:
        stub = pb_grpc.RelayServiceStub(channel)
        first = await spawn(stub, relay.metadata, with_home(base, str(home), "agent-first"))
        # the sweep came before the first agent's TMPDIR, and the files before its start
        assert sorted(p.name for p in (home / "tmp").iterdir()) == ["agent-first"]
        settings = home / ".gemini" / "settings.json"
        assert settings.read_text() == SETTINGS
        assert (settings.stat().st_mode & 0o777, home.stat().st_mode & 0o777) == (0o600, 0o700)
        assert (home / "cache" / "deep").is_dir() and (home / ".rcoder-home").is_file()
        acp = AcpOverAttach(stub, relay.metadata, first.agent_id)
        await acp.open()
        session_id = await open_session(acp, tmp_path / "project")
        turn = 'shell grep -q enableAutoUpdate "$HOME/.gemini/settings.json"\nshell test -d "$TMPDIR"\nhello'
        await acp.call(3, "session/prompt", prompt(session_id, turn))
        assert "shell=exit 0 shell=exit 0" in "".join(chunks(acp.messages()))

        # a second agent of the same home: no sweep, the first one's TMPDIR stays while it runs
        second = await spawn(stub, relay.metadata, with_home(base, str(home), "agent-second"), session_id="s2")
        assert sorted(p.name for p in (home / "tmp").iterdir()) == ["agent-first", "agent-second"]
        await stub.Signal(pb.SignalRequest(agent_id=second.agent_id, generation=1, signal=9), metadata=relay.metadata)

        acp.close_stdin()
        await acp.until(lambda: acp.exit is not None)
        await acp.close()
        await eventually(lambda: list((home / "tmp").iterdir()) == [], timeout=30)
        assert settings.read_text() == SETTINGS, "the home stays; only the TMPDIRs go"


async def test_a_home_out_of_bounds_or_through_a_link_is_refused_and_nothing_written(
    make_relay: RelayFactory, tmp_path: Path
) -> None:
    relay = await make_relay()
    home = tmp_path / "home"
    base = fake_agent_spec(tmp_path / "agent", tmp_path / "project")
    outside = tmp_path / "outside"
    outside.mkdir()
    async with relay.channel() as channel:
        stub = pb_grpc.RelayServiceStub(channel)
        for fields, said in (
            ({"files": [pb.HomeFile(path="../escaped", text="x")]}, "spec.home.files.path"),
            ({"files": [pb.HomeFile(path="/etc/escaped", text="x")]}, "spec.home.files.path"),
            ({"folders": ["a/../../b"]}, "spec.home.folders"),
            ({"tmpdir": "a/b"}, "spec.home.tmpdir"),
            ({"tmpdir": ""}, "spec.home.tmpdir"),
            ({"path": "relative/home"}, "spec.home.path"),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await spawn(stub, relay.metadata, with_home(base, str(home), "agent-x", **fields))
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (fields, refused.value)
            assert said in (refused.value.details() or ""), refused.value.details()
        assert not home.exists() and not (tmp_path / "escaped").exists()

        # an agent may write its home: a link it planted there is never followed
        home.mkdir(mode=0o700)
        (home / ".gemini").symlink_to(outside)
        with pytest.raises(grpc.aio.AioRpcError) as linked:
            await spawn(stub, relay.metadata, with_home(base, str(home), "agent-x"))
        assert linked.value.code() == grpc.StatusCode.UNAVAILABLE, linked.value
        assert "could not be prepared" in (linked.value.details() or "")
        assert list(outside.iterdir()) == []
        assert (await stub.ListAgents(pb.ListAgentsRequest(), metadata=relay.metadata)).agents == []

"""docs/design/trust.md#no-calls-back, an agent cannot use rcoder: every RPC but health, and /metrics, ask a token no
agent can read (made in data_dir when the operator sets none); a store an agent could log into
is refused at start; ``open_to_agents`` opens it all, by name, with a warning; the log and
``ListAgents`` say what each profile reaches. (Real agents trying it from their shells:
tests/real_agents/test_agent_reach.py.)"""

from __future__ import annotations

import asyncio
import os
import stat
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2

from rcoder import landlock
from rcoder.api.access import kept_token
from rcoder.client.token import find_token, local_target
from rcoder.config import load_settings
from rcoder.errors import ConfigError
from rcoder.v1 import agent_runner_pb2 as pb
from tests.conftest import DaemonFactory
from tests.harness import Daemon, FakeAgentSetup, completed, text_of, write_config
from tests.pg import PgCluster

# what a confined profile's agents reach besides rcoder and the store: from Landlock ABI 4 only
# its TCP ports (connect_ports, 443 by default; docs/confinement.md#security)
CONFINED_OTHER = "tcp ports 443" if landlock.abi() >= landlock.NET_ABI else "open"


def bare(daemon: Daemon) -> grpc.aio.Channel:
    """A channel whose calls carry no token unless given one: what an agent could open."""
    return grpc.aio.insecure_channel(daemon.address)


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


def get_metrics(address: str, token: str = "") -> int:
    """The HTTP status of a scrape of ``/metrics`` (with ``token``, when given)."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(f"http://{address}/metrics", headers=headers), timeout=10):
            return 200
    except urllib.error.HTTPError as exc:
        return exc.code


async def reflection_answers(channel: grpc.aio.Channel, metadata: tuple[tuple[str, str], ...] = ()) -> str:
    """ "listed" (rcoder's service among the names: the descriptors are public, a caller without
    the token sees them too), or the status code's name reflection answered with."""
    # One request sent as a unary-stream call (the same bytes on the wire): a stream's separate
    # write can race the server's refusal, and grpc's client then reports its own INTERNAL
    # ("Internal error from Core") in place of the status the server sent.
    info = channel.unary_stream(
        f"/{reflection.SERVICE_NAME}/ServerReflectionInfo",
        request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
        response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
    )
    call = info(reflection_pb2.ServerReflectionRequest(list_services=""), metadata=metadata)
    try:
        names = {s.name for s in (await call.read()).list_services_response.service}
    except grpc.aio.AioRpcError as exc:
        return str(exc.code().name)
    if "rcoder.v1.AgentRunner" in names:
        return "listed"
    return "health only" if names == {"grpc.health.v1.Health"} else f"other: {sorted(names)}"


async def test_with_no_auth_token_the_daemon_makes_one_in_data_dir_keeps_it_and_asks_it_of_every_rpc_but_health(
    make_daemon: DaemonFactory, tmp_path: Path
) -> None:
    daemon, client = await make_daemon(channel=bare, metrics_listen="127.0.0.1:0")
    path = tmp_path / "data" / "auth_token"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    token = path.read_text().strip()
    assert len(token) >= 40

    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await client.stub.ListSessions(pb.ListSessionsRequest())
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert (await client.chat_error(prompt="hi", project_id="beta")).code() == grpc.StatusCode.UNAUTHENTICATED
    assert await reflection_answers(client.channel) == "listed"
    assert await reflection_answers(client.channel, bearer("wrong")) == "UNAUTHENTICATED"
    assert not list((tmp_path / "workspace").glob("beta")), "no turn started for a caller without the token"
    health = await health_pb2_grpc.HealthStub(client.channel).Check(health_pb2.HealthCheckRequest())
    assert health.status == health_pb2.HealthCheckResponse.SERVING

    assert (
        completed(await client.chat(prompt="remember 1", metadata=bearer(token))).stop_reason == pb.STOP_REASON_END_TURN
    )
    assert await reflection_answers(client.channel, bearer(token)) == "listed"
    (metrics,) = await daemon.wait_log("metrics_serving")
    assert await asyncio.to_thread(get_metrics, metrics["address"]) == 401
    assert await asyncio.to_thread(get_metrics, metrics["address"], "wrong") == 401
    assert await asyncio.to_thread(get_metrics, metrics["address"], token) == 200
    (serving,) = daemon.logs("serving")
    assert (serving["auth"], serving["auth_file"]) == ("file", str(path))
    assert token not in "\n".join(daemon.log_lines)

    assert await daemon.stop() == 0
    again, _ = await make_daemon()  # the same data_dir
    assert again.token == token == path.read_text().strip(), "kept across restarts"


async def test_an_agent_reads_neither_the_token_nor_the_config_that_holds_one(
    make_daemon: DaemonFactory, tmp_path: Path
) -> None:
    daemon, client = await make_daemon()
    token_file = tmp_path / "data" / "auth_token"
    events = await client.chat(prompt=f"readfile {token_file} child-readfile {token_file} readfile {daemon.config}")
    answer = text_of(events)
    assert f"readfile[{token_file}]=EACCES" in answer and f"child-readfile[{token_file}]=EACCES" in answer, answer
    assert f"readfile[{daemon.config}]=EACCES" in answer, answer
    assert token_file.read_text().strip() not in answer


async def test_open_to_agents_asks_no_token_and_warns_that_agents_can_drive_the_daemon(
    make_daemon: DaemonFactory, tmp_path: Path
) -> None:
    daemon, client = await make_daemon(channel=bare, open_to_agents=True, metrics_listen="127.0.0.1:0")
    agents = (await client.stub.ListAgents(pb.ListAgentsRequest())).agents
    # the token no longer asked; TCP still only to the profile's ports where Landlock filters them
    opened = pb.NetworkReach(rcoder="open", metrics="open", store="none", other=CONFINED_OTHER)
    assert [a.network for a in agents] == [opened] * len(agents)
    assert completed(await client.chat(prompt="hi")).stop_reason == pb.STOP_REASON_END_TURN
    (metrics,) = await daemon.wait_log("metrics_serving")
    assert await asyncio.to_thread(get_metrics, metrics["address"]) == 200
    assert not (tmp_path / "data" / "auth_token").exists(), "no token made"
    (warning,) = daemon.logs("open_to_agents")
    assert warning["level"] == "warning" and "agents can drive this daemon" in warning["effect"]
    (reach,) = [row for row in daemon.logs("agent_network") if row["agent"] == "fake"]
    assert (reach["level"], reach["rcoder"], reach["metrics"]) == ("warning", "open", "open")


async def test_list_agents_and_the_start_log_say_what_each_profiles_agents_reach(
    make_daemon: DaemonFactory, fake: FakeAgentSetup
) -> None:
    profiles = {"fake": fake.profile(), "loose": fake.profile(sandbox="none")}
    daemon, client = await make_daemon(profiles, metrics_listen="127.0.0.1:0")
    agents = {a.name: a.network for a in (await client.stub.ListAgents(pb.ListAgentsRequest())).agents}
    assert agents["fake"] == pb.NetworkReach(rcoder="refused", metrics="refused", store="none", other=CONFINED_OTHER)
    # unconfined, it reads the token file like the daemon: nothing is refused to it
    assert agents["loose"] == pb.NetworkReach(rcoder="open", metrics="open", store="none", other="open")
    logged = {row["agent"]: row for row in daemon.logs("agent_network")}
    assert (logged["fake"]["level"], logged["fake"]["rcoder"], logged["fake"]["other"]) == (
        "info", "refused", CONFINED_OTHER
    )  # fmt: skip
    assert (logged["loose"]["level"], logged["loose"]["rcoder"]) == ("warning", "open")
    assert not daemon.logs("open_to_agents")


async def test_a_store_that_lets_its_user_in_without_the_password_is_refused_unless_opened_by_name(
    pg_cluster: PgCluster, fake: FakeAgentSetup, tmp_path: Path
) -> None:
    url = pg_cluster.trusting_url()
    settings: dict[str, Any] = {
        "data_dir": str(tmp_path / "data"),
        "workspace_root": str(tmp_path / "ws"),
        "default_agent": "fake",
    }
    config = write_config(
        tmp_path / "trusting.toml", {"fake": fake.profile()}, store_url=url, auth_token="t", **settings
    )
    refused = Daemon(config)
    with pytest.raises(RuntimeError, match="daemon exited before serving") as caught:
        await refused.start()
    assert refused.proc is not None and await refused.proc.wait() == 2
    assert "lets its user in without the password" in str(caught.value) and "scram-sha-256" in str(caught.value)
    assert "never-asked" not in str(caught.value), "the URL's password stays out of the message"

    opened = write_config(
        tmp_path / "opened.toml", {"fake": fake.profile()}, store_url=url, open_to_agents=True, **settings
    )
    daemon = await Daemon(opened).start()
    try:
        (warning,) = daemon.logs("open_to_agents")
        assert "reach the store" in warning["store"]
        (reach,) = [row for row in daemon.logs("agent_network") if row["agent"] == "fake"]
        assert reach["store"] == "open" and reach["level"] == "warning"
    finally:
        await daemon.stop()


async def test_a_store_that_asks_the_password_starts_and_its_agents_are_said_refused(
    make_daemon: DaemonFactory, pg_url: str
) -> None:
    daemon, client = await make_daemon(store_url=pg_url)
    (reach,) = [row for row in daemon.logs("agent_network") if row["agent"] == "fake"]
    assert (reach["level"], reach["store"], reach["rcoder"]) == ("info", "refused", "refused")
    agents = {a.name: a for a in (await client.stub.ListAgents(pb.ListAgentsRequest())).agents}
    assert agents["fake"].network.store == "refused"


def test_a_postgresql_store_needs_the_hosts_shared_auth_token(tmp_path: Path) -> None:
    environ = {"RCODER_STORE_URL": "postgresql://u:p@127.0.0.1/db"}
    with pytest.raises(ConfigError) as caught:
        load_settings(None, environ, landlock_abi=0)
    assert caught.value.key == "auth_token" and "every host" in str(caught.value)
    assert load_settings(None, {**environ, "RCODER_AUTH_TOKEN": "s"}, landlock_abi=0).auth_token == "s"
    assert load_settings(None, {**environ, "RCODER_OPEN_TO_AGENTS": "true"}, landlock_abi=0).open_to_agents


def test_the_token_file_is_never_followed_through_a_link_nor_taken_when_others_can_read_it(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_text("planted\n")
    link = tmp_path / "data" / "auth_token"
    link.parent.mkdir()
    link.symlink_to(elsewhere)
    with pytest.raises(ConfigError, match="cannot read"):
        kept_token(link)
    assert elsewhere.read_text() == "planted\n", "not written through"

    loose = tmp_path / "loose" / "auth_token"
    loose.parent.mkdir()
    loose.write_text("readable\n")
    loose.chmod(0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        kept_token(loose)

    made = tmp_path / "made" / "auth_token"
    assert kept_token(made) == kept_token(made) == made.read_text().strip()
    assert os.listdir(made.parent) == ["auth_token"], "no scratch file left"


def test_a_client_finds_the_token_in_the_environment_the_config_or_the_daemons_data_dir(tmp_path: Path) -> None:
    config = tmp_path / "conf" / "rcoder.toml"
    config.parent.mkdir()
    (tmp_path / "conf" / "state").mkdir()
    (tmp_path / "conf" / "state" / "auth_token").write_text("from-data-dir\n")
    config.write_text('data_dir = "state"\n')  # relative to the file, as the daemon reads it
    assert find_token({}, config) == "from-data-dir"
    assert find_token({"RCODER_CONFIG": str(config)}) == "from-data-dir"
    assert find_token({"RCODER_TOKEN": "env"}, config) == "env"
    assert find_token({"RCODER_AUTH_TOKEN": "daemon-env"}, config) == "daemon-env"
    config.write_text('auth_token = "set"\ndata_dir = "state"\n')
    assert find_token({}, config) == "set"
    assert find_token({"RCODER_DATA_DIR": str(tmp_path / "none")}) == ""


def test_a_client_reads_the_defaults_file_below_the_config_and_the_environment(tmp_path: Path) -> None:
    """RCODER_DEFAULTS, as the container image sets it: `rcoder chat` and `rcoder health` inside
    find the daemon where it listens and its token, whichever layer set them."""
    (tmp_path / "image" / "state").mkdir(parents=True)
    (tmp_path / "image" / "state" / "auth_token").write_text("from-defaults\n")
    defaults = tmp_path / "image" / "defaults.toml"
    defaults.write_text('listen = "0.0.0.0:1"\ndata_dir = "state"\n')
    env = {"RCODER_DEFAULTS": str(defaults)}
    assert (find_token(env), local_target(env)) == ("from-defaults", "127.0.0.1:1")

    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "auth_token").write_text("from-config\n")
    config = tmp_path / "rcoder.toml"
    config.write_text('listen = "127.0.0.1:2"\ndata_dir = "mine"\n')
    assert (find_token(env, config), local_target(env, config)) == ("from-config", "127.0.0.1:2")
    env |= {"RCODER_CONFIG": str(config), "RCODER_LISTEN": "127.0.0.1:3"}
    assert (find_token(env), local_target(env)) == ("from-config", "127.0.0.1:3")

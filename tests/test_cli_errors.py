"""Errors a person can act on (docs/clients.md#the-token): a refused call says where the token
was looked for, or which one was sent, and how to give one; the local daemon's token goes to no
other daemon. Against a real daemon, ``rcoder`` run as a person runs it."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import grpc
import pytest

from rcoder.client_cli import target_and_token
from tests.conftest import DaemonFactory
from tests.harness import FakeAgentSetup, error_info
from tests.test_client_cli import rcoder

# no RCODER_* variable of the machine running the tests leaks into the command
CLEAN = {name: "" for name in os.environ if name.startswith("RCODER_")}


async def test_with_no_token_found_the_refusal_says_where_rcoder_looked_and_how_to_give_one(
    make_daemon: DaemonFactory, tmp_path: Path
) -> None:
    daemon, _ = await make_daemon()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()

    code, _, err = await rcoder("sessions", "--target", daemon.address, env=CLEAN, cwd=str(elsewhere))
    assert code == 1
    first, hint = err.splitlines()
    assert first.startswith("rcoder: UNAUTHENTICATED")
    assert f"none found in $RCODER_TOKEN, $RCODER_AUTH_TOKEN, {elsewhere}/.rcoder/auth_token" in hint
    assert "--token TOKEN or RCODER_TOKEN=TOKEN" in hint


async def test_the_local_daemons_token_goes_only_to_the_address_its_daemon_recorded(
    make_daemon: DaemonFactory, tmp_path: Path
) -> None:
    daemon, _ = await make_daemon()
    here = tmp_path / "here"
    (here / ".rcoder").mkdir(parents=True)
    (here / ".rcoder" / "auth_token").write_text(daemon.token)  # the right token, for the wrong daemon
    record = here / ".rcoder" / "daemon.lock"  # as a live daemon holding that data_dir records itself
    record.write_text(json.dumps({"pid": os.getpid(), "listen": "127.0.0.1:1", "serving": True}))

    code, _, err = await rcoder("sessions", "--target", daemon.address, env=CLEAN, cwd=str(here))
    assert code == 1, "the token of the daemon at 127.0.0.1:1 went to another daemon"
    hint = err.splitlines()[1]
    assert f"the one in {here}/.rcoder/auth_token is this host's daemon's (127.0.0.1:1), and {daemon.address}" in hint
    # the address that daemon recorded, or its listen as this host's config says: the token goes
    record.write_text(json.dumps({"pid": os.getpid(), "listen": daemon.address, "serving": True}))
    localhost = daemon.address.replace("127.0.0.1", "localhost")
    assert (await rcoder("sessions", "--target", localhost, env=CLEAN, cwd=str(here)))[0] == 0
    record.unlink()
    listen = {**CLEAN, "RCODER_LISTEN": daemon.address}
    assert (await rcoder("sessions", env=listen, cwd=str(here)))[0] == 0
    # no daemon recorded there (none runs, or one from before records): an address of this host
    record.write_text(json.dumps({"pid": 2**22 + 1, "listen": "127.0.0.1:1"}))  # a pid no process has
    assert (await rcoder("sessions", "--target", daemon.address, env=CLEAN, cwd=str(here)))[0] == 0


@pytest.mark.fast
def test_another_host_never_gets_the_local_token(tmp_path: Path) -> None:
    (tmp_path / ".rcoder").mkdir()
    (tmp_path / ".rcoder" / "auth_token").write_text("local")
    env = {"RCODER_DATA_DIR": str(tmp_path / ".rcoder")}

    def sent(target: str | None, config: Path | None = None) -> str:
        args = argparse.Namespace(target=target, token=None, config=config)
        return target_and_token(args, env)[1].token

    assert sent(None) == "local"
    assert sent("127.0.0.1:50051") == sent("[::1]:7") == sent("localhost:7") == "local"
    assert sent("10.1.2.3:50051") == sent("rcoder.example:50051") == ""
    config = tmp_path / "rcoder.toml"
    config.write_text("")
    assert sent("rcoder.example:50051", config) == "local", "its config named: the daemon is the one meant"


async def test_a_refused_token_is_named_by_where_it_came_from(make_daemon: DaemonFactory) -> None:
    daemon, _ = await make_daemon()

    code, _, err = await rcoder("sessions", "--target", daemon.address, "--token", "wrong", env=CLEAN)
    assert code == 1
    assert f"rcoder: {daemon.address} refused the token from --token; give the daemon's token" in err
    code, _, err = await rcoder("sessions", "--target", daemon.address, env={**CLEAN, "RCODER_TOKEN": "wrong"})
    assert code == 1 and "refused the token from $RCODER_TOKEN" in err


async def test_an_agent_refusing_its_key_names_the_variable_its_profile_reads_without_its_stderr(
    make_daemon: DaemonFactory, fake: FakeAgentSetup
) -> None:
    profile = fake.profile("--auth-required", "open", provider_env={"api_key": "FAKE_MODEL_KEY"})
    _, client = await make_daemon({"fake": profile})

    exc = await client.chat_error(prompt="hi")
    assert exc.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert error_info(exc).reason == "AGENT_AUTH_REQUIRED"
    assert "set FAKE_MODEL_KEY in the daemon's environment or the profile's model_api_key" in exc.details()
    assert "agent stderr" not in exc.details()
    assert error_info(exc).metadata["key_variable"] == "FAKE_MODEL_KEY"

"""``ListAgents`` says whether each profile can run here (its command found, the model key its kind
reads present, confined or not, placement), and the start's log warns when the default profile
cannot run (docs/configuration.md#can-a-profile-run-here). A real daemon, its real config."""

from __future__ import annotations

from pathlib import Path

from rcoder.client import RcoderClient
from tests.conftest import DaemonFactory
from tests.harness import FakeAgentSetup

KEY = "RCODER_TEST_MODEL_KEY"  # a variable no machine sets


async def test_list_agents_says_which_profiles_can_run_here_and_why_not(
    make_daemon: DaemonFactory, fake: FakeAgentSetup
) -> None:
    profiles = {
        "fake": fake.profile(),
        "gone": fake.profile(command="/nonexistent/agent"),
        "keyless": fake.profile(provider_env={"api_key": KEY}),
        "keyed": fake.profile(provider_env={"api_key": KEY}, env={KEY: "k"}),
        "inherits": fake.profile(provider_env={"api_key": KEY + "_2"}, inherit_env=[KEY + "_2"]),
    }
    daemon, _ = await make_daemon(profiles, env={"ANTHROPIC_API_KEY": "", KEY + "_2": "k2"})

    async with RcoderClient(daemon.address, token=daemon.token) as client:
        agents = {agent.name: agent for agent in await client.agents()}

    assert agents["fake"].runnable and agents["fake"].not_runnable == ()
    assert (agents["fake"].command_found, agents["fake"].key_variable, agents["fake"].key_present) == (True, "", True)
    assert agents["fake"].placement == "local"
    assert agents["fake"].sandbox in ("landlock", "none")  # confined or not, as before

    gone = agents["gone"]
    assert not gone.runnable and not gone.command_found and gone.key_present
    (why,) = gone.not_runnable
    assert "'/nonexistent/agent' not found" in why
    keyless = agents["keyless"]
    assert not keyless.runnable and keyless.command_found
    assert (keyless.key_variable, keyless.key_present) == (KEY, False)
    assert keyless.not_runnable == (
        f"{KEY} is not set: set it in the daemon's environment (the profile passes it through) or the profile's "
        "model_api_key, or send model_provider.api_key",
    )
    assert agents["keyed"].runnable and agents["keyed"].key_present
    assert agents["inherits"].runnable, agents["inherits"].not_runnable
    claude = agents["claude"]  # built in: its kind reads ANTHROPIC_API_KEY, set empty here
    assert (claude.key_variable, claude.key_present, claude.runnable) == ("ANTHROPIC_API_KEY", False, False)


async def test_the_start_log_warns_when_the_default_profile_cannot_run(
    make_daemon: DaemonFactory, fake: FakeAgentSetup, tmp_path: Path
) -> None:
    daemon, _ = await make_daemon({"fake": fake.profile()})
    keyless = {"keyless": fake.profile(provider_env={"api_key": KEY})}
    # a data_dir of its own: one daemon per data_dir (docs/operating.md#one-daemon-per-data_dir)
    serving = await make_daemon(keyless, default_agent="keyless", data_dir=str(tmp_path / "data-keyless"))

    (warning,) = await serving[0].wait_log("default_agent_cannot_run")
    assert warning["agent"] == "keyless" and f"{KEY} is not set" in warning["why"][0]
    await daemon.wait_log("serving")
    assert not daemon.logs("default_agent_cannot_run")

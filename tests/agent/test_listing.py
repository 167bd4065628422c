"""No doomed resumes: where the agent advertises ``session/list``, a session it does not list is
not resumed (the launch goes straight to a new session, and says why); a list that could be
incomplete never skips a resume.

The launches run the real fake agent, which lists the sessions it stored; the launcher's
session lists get a clock the test moves (``SessionLists(clock=...)``).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from rcoder.agent.acp.listing import SessionLists, Verdict
from rcoder.agent.acp.start_config import AgentStartConfig
from rcoder.agent.launcher import AgentLauncher, Launched
from rcoder.agent.processes.tree import Trees
from rcoder.config import AgentProfile, load_settings
from rcoder.domain import OpenMethod
from rcoder.errors import AgentProtocolError
from tests.conftest import base_settings
from tests.harness import FakeAgentSetup, write_config
from tests.processes import START_BOUND, close_all, drain

NOT_LISTED = "is not in the agent's session list"


class Clock:
    """Monotonic seconds that move only when the test says."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


Make = Callable[..., tuple[AgentLauncher, AgentProfile]]


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
async def make(tmp_path: Path, fake: FakeAgentSetup, clock: Clock) -> AsyncIterator[Make]:
    """A launcher of one fake-agent profile (its flags), with session lists on the test's clock;
    on teardown no agent process may be left."""

    def build(
        *flags: str, timeout: float = 5.0, max_pages: int = 20, **keys: Any
    ) -> tuple[AgentLauncher, AgentProfile]:
        config = write_config(
            tmp_path / "rcoder.toml", {"fake": fake.profile(*flags, **keys)}, **base_settings(tmp_path)
        )
        settings = load_settings(config, environ={})
        lists = SessionLists(timeout=timeout, max_pages=max_pages, clock=clock)
        return AgentLauncher(settings, Trees(), lists=lists), settings.agents["fake"]

    yield build
    assert not await drain(str(fake.state_dir)), "agent processes left behind"


@pytest.fixture
def cwd(tmp_path: Path) -> str:
    path = tmp_path / "workspace" / "proj"
    path.mkdir(parents=True)
    return str(path.resolve())


async def launch(launcher: AgentLauncher, profile: AgentProfile, cwd: str, resume: str = "") -> Launched:
    async with asyncio.timeout(START_BOUND):
        return await launcher.launch(profile, AgentStartConfig(cwd=cwd, resume_session_id=resume))


async def close(*launched: Launched) -> None:
    await close_all(launched)


async def stored_sessions(launcher: AgentLauncher, profile: AgentProfile, cwd: str, count: int) -> list[str]:
    """``count`` sessions the fake agent stored (each opened on an agent, which is then closed)."""
    opened = [await launch(launcher, profile, cwd) for _ in range(count)]
    await close(*opened)
    return [each.connection.provider_session_id for each in opened]


def requests_with_pids(fake: FakeAgentSetup, method: str) -> list[tuple[int, dict[str, Any]]]:
    rows = [json.loads(line) for line in fake.record.read_text().splitlines() if line.strip()]
    return [(row["pid"], row["message"]) for row in rows if row["message"].get("method") == method]


def resume_requests(fake: FakeAgentSetup) -> list[dict[str, Any]]:
    """Every request that tried to resume a session: session/resume, session/load, meta session/new."""
    meta = [r for r in fake.requests("session/new") if "claudeCode" in r["params"].get("_meta", {})]
    return fake.requests("session/resume") + fake.requests("session/load") + meta


# ---------------------------------------------------------------- listed, or not


@pytest.mark.parametrize(("caps", "route"), [("resume", OpenMethod.RESUME), ("load", OpenMethod.LOAD),
                                             ("meta", OpenMethod.META)])  # fmt: skip
async def test_a_listed_session_is_resumed_as_before(
    make: Make, fake: FakeAgentSetup, cwd: str, caps: str, route: OpenMethod
) -> None:
    launcher, profile = make("--caps", f"{caps},list")
    (known,) = await stored_sessions(launcher, profile, cwd, 1)

    resumed = await launch(launcher, profile, cwd, known)
    try:
        assert (resumed.method, resumed.fallback_reason) == (route, "")
        assert resumed.connection.provider_session_id == known
        (listing,) = fake.requests("session/list")
        assert listing["params"]["cwd"] == cwd
        assert len(resume_requests(fake)) == 1
    finally:
        await close(resumed)


@pytest.mark.parametrize("caps", ["resume", "load", "meta", "resume,load,meta"])
async def test_a_session_the_agent_does_not_list_goes_straight_to_a_new_one_without_a_resume(
    make: Make, fake: FakeAgentSetup, cwd: str, caps: str
) -> None:
    launcher, profile = make("--caps", f"{caps},list")
    await stored_sessions(launcher, profile, cwd, 1)  # the agent lists something, not that one

    launched = await launch(launcher, profile, cwd, "fake-lost")
    try:
        assert launched.method is OpenMethod.NEW
        assert NOT_LISTED in launched.fallback_reason and "'fake-lost'" in launched.fallback_reason
        assert cwd in launched.fallback_reason
        assert launched.connection.provider_session_id not in {"", "fake-lost"}
        assert not resume_requests(fake), "no resume was spent on a session the agent does not list"
        # the fallback opened on the agent already started: no second process
        ((listed_on, _),) = requests_with_pids(fake, "session/list")
        assert requests_with_pids(fake, "session/new")[-1][0] == listed_on == launched.connection.process.pid
        assert len(fake.requests("initialize")) == 2  # the stored session's agent, and this one
    finally:
        await close(launched)


async def test_an_agent_that_does_not_advertise_list_is_never_asked_and_the_resume_is_tried(
    make: Make, fake: FakeAgentSetup, cwd: str
) -> None:
    launcher, profile = make("--caps", "resume")

    launched = await launch(launcher, profile, cwd, "fake-lost")
    try:
        assert launched.method is OpenMethod.NEW and "-32002" in launched.fallback_reason
        assert not fake.requests("session/list")
        assert [r["params"]["sessionId"] for r in fake.requests("session/resume")] == ["fake-lost"]
    finally:
        await close(launched)


async def test_a_session_on_a_later_page_of_the_list_is_found_and_resumed(
    make: Make, fake: FakeAgentSetup, cwd: str
) -> None:
    # five made-up sessions first, two a page: the stored one is on page 3
    launcher, profile = make("--caps", "resume,list", "--list-page", "2", "--list-padding", "5")
    (known,) = await stored_sessions(launcher, profile, cwd, 1)

    resumed = await launch(launcher, profile, cwd, known)
    try:
        assert (resumed.method, resumed.fallback_reason) == (OpenMethod.RESUME, "")
        cursors = [r["params"].get("cursor") for r in fake.requests("session/list")]
        assert cursors[0] is None and len(cursors) == 3 and len(set(cursors)) == 3
    finally:
        await close(resumed)


# ---------------------------------------------------------------- a list that could be incomplete


@pytest.mark.parametrize(
    ("flags", "bounds", "pages"),
    [
        (["--list-fail"], {}, 1),
        (["--list-delay", "3000"], {"timeout": 0.5}, 1),
        (["--list-page", "1", "--list-padding", "5"], {"max_pages": 3}, 3),
    ],
    ids=["list-error", "list-too-slow", "list-longer-than-the-bound"],
)
async def test_a_list_that_fails_or_is_not_had_whole_never_skips_the_resume(
    make: Make, fake: FakeAgentSetup, cwd: str, flags: list[str], bounds: dict[str, float], pages: int
) -> None:
    launcher, profile = make("--caps", "resume,list", *flags, **bounds)
    (known,) = await stored_sessions(launcher, profile, cwd, 1)

    resumed = await launch(launcher, profile, cwd, known)
    try:
        assert (resumed.method, resumed.fallback_reason) == (OpenMethod.RESUME, "")
        assert resumed.connection.provider_session_id == known
        assert len(fake.requests("session/list")) == pages
        assert [r["params"]["sessionId"] for r in fake.requests("session/resume")] == [known]
    finally:
        await close(resumed)


async def test_an_unknown_id_with_a_failing_list_is_tried_and_falls_back_the_usual_way(
    make: Make, fake: FakeAgentSetup, cwd: str
) -> None:
    launcher, profile = make("--caps", "resume,list", "--list-fail")

    launched = await launch(launcher, profile, cwd, "fake-lost")
    try:
        assert launched.method is OpenMethod.NEW
        assert "-32002" in launched.fallback_reason and NOT_LISTED not in launched.fallback_reason
        assert [r["params"]["sessionId"] for r in fake.requests("session/resume")] == ["fake-lost"]
    finally:
        await close(launched)


# ---------------------------------------------------------------- kept 10 s per agent home


async def test_resumes_within_the_ttl_list_once_and_after_it_list_again(
    make: Make, fake: FakeAgentSetup, cwd: str, clock: Clock
) -> None:
    launcher, profile = make("--caps", "resume,list")
    first, second = await stored_sessions(launcher, profile, cwd, 2)

    a = await launch(launcher, profile, cwd, first)
    clock.now += 9.0
    b = await launch(launcher, profile, cwd, second)
    gone = await launch(launcher, profile, cwd, "fake-lost")
    await close(a, b, gone)
    assert (a.method, b.method, gone.method) == (OpenMethod.RESUME, OpenMethod.RESUME, OpenMethod.NEW)
    assert NOT_LISTED in gone.fallback_reason
    assert len(fake.requests("session/list")) == 1, "three resumes within 10 s, one list"

    clock.now += 1.0  # the listing is 10 s old
    again = await launch(launcher, profile, cwd, first)
    await close(again)
    assert again.method is OpenMethod.RESUME
    assert len(fake.requests("session/list")) == 2


async def test_a_burst_of_doomed_resumes_lists_once_and_spends_no_resume(
    make: Make, fake: FakeAgentSetup, cwd: str
) -> None:
    launcher, profile = make("--caps", "resume,list")

    async with asyncio.timeout(START_BOUND):
        burst = await asyncio.gather(*(launch(launcher, profile, cwd, f"fake-lost-{i}") for i in range(3)))
    await close(*burst)
    assert all(each.method is OpenMethod.NEW and NOT_LISTED in each.fallback_reason for each in burst)
    assert len(fake.requests("session/list")) == 1
    assert not resume_requests(fake)


async def test_a_session_opened_after_the_listing_was_kept_is_listed_afresh_never_skipped(
    make: Make, fake: FakeAgentSetup, cwd: str, clock: Clock
) -> None:
    launcher, profile = make("--caps", "resume,list")
    (old,) = await stored_sessions(launcher, profile, cwd, 1)
    kept = await launch(launcher, profile, cwd, old)  # listed: the listing is kept
    await close(kept)

    clock.now += 1.0
    (new,) = await stored_sessions(launcher, profile, cwd, 1)  # not in the kept listing
    clock.now += 1.0
    resumed = await launch(launcher, profile, cwd, new)
    await close(resumed)

    assert (resumed.method, resumed.fallback_reason) == (OpenMethod.RESUME, "")
    assert len(fake.requests("session/list")) == 2


async def test_homes_are_listed_apart(make: Make, fake: FakeAgentSetup, cwd: str, tmp_path: Path) -> None:
    launcher, profile = make("--caps", "resume,list")
    other = tmp_path / "workspace" / "other"
    other.mkdir()
    first = await launch(launcher, profile, cwd, "fake-lost")
    second = await launch(launcher, profile, str(other), "fake-lost")
    await close(first, second)
    assert [r["params"]["cwd"] for r in fake.requests("session/list")] == [cwd, str(other)]


# ---------------------------------------------------------------- the lists alone


async def test_a_cursor_that_repeats_makes_the_list_unknown() -> None:
    calls: list[str | None] = []

    async def looping(cursor: str | None, left: float) -> tuple[list[str], str | None]:
        calls.append(cursor)
        return ["a"], "same"

    answer = await SessionLists().check(("home", "/cwd"), "b", looping)
    assert answer.verdict is Verdict.UNKNOWN and "repeated a cursor" in answer.listing.why
    assert calls == [None, "same"]


async def test_concurrent_checks_of_one_home_share_one_listing_and_other_homes_do_not() -> None:
    pages: list[str] = []
    both_listing, release = asyncio.Event(), asyncio.Event()

    async def slow(cursor: str | None, left: float) -> tuple[list[str], str | None]:
        pages.append("page")
        if len(pages) == 2:
            both_listing.set()
        await release.wait()
        return ["a"], None

    lists = SessionLists()
    checks = [asyncio.create_task(lists.check(("home", "/cwd"), sid, slow)) for sid in ("a", "b", "c")]
    other = asyncio.create_task(lists.check(("home-2", "/cwd"), "a", slow))
    async with asyncio.timeout(5):
        await both_listing.wait()  # the first check of each home is listing; the rest wait on it
        release.set()
        answers = await asyncio.gather(*checks, other)
    assert [a.verdict for a in answers] == [Verdict.LISTED, Verdict.NOT_LISTED, Verdict.NOT_LISTED, Verdict.LISTED]
    assert [a.cached for a in answers] == [False, True, True, False]
    assert len(pages) == 2


async def test_an_agent_error_while_listing_is_unknown_with_its_reason() -> None:
    async def failing(cursor: str | None, left: float) -> tuple[list[str], str | None]:
        raise AgentProtocolError("agent 'x' answered session/list with error -32603", agent="x")

    answer = await SessionLists().check(("home", "/cwd"), "a", failing)
    assert answer.verdict is Verdict.UNKNOWN and "-32603" in answer.listing.why

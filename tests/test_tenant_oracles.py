"""No existence oracle between tenants (docs/access.md#tenants): on every RPC of AgentRunner, and
whatever else the request names, an id of another tenant's answers exactly as an id that does not
exist: the same code, the same message and ErrorInfo with the ids taken out.

The RPCs are read from the service's descriptor: a new RPC fails this test until it is given a
request here (or named as one that carries no id)."""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rcoder.v1 import agent_runner_pb2 as pb
from tests.conftest import DaemonFactory
from tests.harness import FakeAgentSetup, call_rpc
from tests.test_tenants import ACME, BETA, answer, as_, chat, tenants

SERVICE = pb.DESCRIPTOR.services_by_name["AgentRunner"]
Build = Callable[[str, str, str], Any]  # (session_id, run_id, project_id) -> the request

# each RPC that names a session or a run, and which of the three its request carries
NAMED_BY_ID: dict[str, tuple[Build, set[str]]] = {
    # an unconfined profile, which the caller may not name: a check that does not depend on the id
    "Chat": (
        lambda s, r, p: pb.ChatRequest(session_id=s, project_id=p, prompt="hi", agent="open"),
        {"session", "project"},
    ),
    "Subscribe": (lambda s, r, p: pb.SubscribeRequest(run_id=r), {"run"}),
    "Cancel": (lambda s, r, p: pb.CancelRequest(session_id=s, run_id=r), {"session", "run"}),
    "ResolvePermission": (
        lambda s, r, p: pb.ResolvePermissionRequest(run_id=r, permission_id="p1", option_id="allow"),
        {"run"},
    ),
    "GetSession": (lambda s, r, p: pb.GetSessionRequest(session_id=s), {"session"}),
    "CloseSession": (lambda s, r, p: pb.CloseSessionRequest(session_id=s), {"session"}),
    "ForkSession": (
        lambda s, r, p: pb.ForkSessionRequest(session_id=s, project_id=p, agent="open"),
        {"session", "project"},
    ),
    "ListRuns": (lambda s, r, p: pb.ListRunsRequest(session_id=s), {"session"}),
    "DeleteSession": (lambda s, r, p: pb.DeleteSessionRequest(session_id=s), {"session"}),
    "GetRunChanges": (lambda s, r, p: pb.GetRunChangesRequest(run_id=r), {"run"}),
    "RewindSession": (lambda s, r, p: pb.RewindSessionRequest(session_id=s, run_id=r), {"session", "run"}),
}
# the RPCs that name no session or run: a project (checked by its name against the caller's
# patterns, whether it exists or not) or nothing
NAMES_NO_ID = {"ListSessions", "ListAgents", "ListHosts", "ListFiles", "ReadFile", "WriteFile", "DeleteFile"}


def test_every_rpc_is_walked() -> None:
    assert set(NAMED_BY_ID) | NAMES_NO_ID == {m.name for m in SERVICE.methods}
    assert not set(NAMED_BY_ID) & NAMES_NO_ID


async def test_another_tenants_id_answers_as_a_missing_one_on_every_rpc_and_every_order_of_checks(
    make_daemon: DaemonFactory, tmp_path: Path, fake: FakeAgentSetup
) -> None:
    profiles = {"fake": fake.profile(), "open": fake.profile(sandbox="none")}
    daemon, client = await tenants(make_daemon, tmp_path, profiles=profiles)
    theirs = await chat(client, ACME, "acme-1")
    own = await chat(client, BETA, "beta-1")
    missing = (str(uuid.uuid4()), str(uuid.uuid4()))
    beta = as_(BETA)

    differences, walked = [], 0
    async with daemon.channel() as channel:
        for method, (build, slots) in NAMED_BY_ID.items():
            # the id under test in one slot or both; every other slot the caller's own, or (a
            # project) another tenant's: each order in which the checks could run
            ids = [slot for slot in ("session", "run") if slot in slots]
            projects = ["beta-1", "acme-1"] if "project" in slots else ["beta-1"]
            for probed in (s for n in range(1, len(ids) + 1) for s in itertools.combinations(ids, n)):
                for project in projects:

                    def request(
                        session: str, run: str, b: Build = build, probed: tuple[str, ...] = probed, p: str = project
                    ) -> Any:
                        return b(
                            session if "session" in probed else own.session_id,
                            run if "run" in probed else own.run_id,
                            p,
                        )

                    their = await call_rpc(channel, method, request(theirs.session_id, theirs.run_id), beta)
                    nobody = await call_rpc(channel, method, request(*missing), beta)
                    walked += 1
                    assert their is not None and nobody is not None, (method, probed, project)
                    seen = answer(their, theirs.session_id, theirs.run_id)
                    expected = answer(nobody, *missing)
                    if seen != expected:
                        differences.append((method, probed, project, seen, expected))
    assert not differences, "\n".join(map(str, differences))
    assert walked >= len(NAMED_BY_ID)

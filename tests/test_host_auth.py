"""A forward's signature (rcoder.api.host_auth): good at the host it was made for, once, for 30
seconds, for one method and one session or run; worth nothing anywhere else."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from rcoder.api.callers import ADMIN, Caller, Role
from rcoder.api.host_auth import CALLER_KEY, HEADER, WINDOW, HostAuth
from rcoder.errors import Unauthenticated
from rcoder.v1 import agent_runner_pb2 as pb

pytestmark = pytest.mark.fast  # starts no process: `make check` (tests/process_guard.py)

SECRET = "the-hosts-token"
A, B = "127.0.0.1:7001", "127.0.0.1:7002"
CHAT = "/rcoder.v1.AgentRunner/Chat"


class Clock:
    def __init__(self, now: float = 1_700_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def host(audience: str, clock: Clock, secret: str = SECRET, host_id: str = "host-b") -> HostAuth:
    return HostAuth(secret, host_id, lambda: audience, clock=clock)


def signed(
    signer: HostAuth, address: str = A, method: str = CHAT, session_id: str = "s1", caller: Caller = ADMIN
) -> Sequence[tuple[str, str]]:
    return signer.sign(method, pb.ChatRequest(session_id=session_id, prompt="hi"), address, caller)


def test_a_forward_signed_for_a_host_verifies_there_and_its_request_matches() -> None:
    clock = Clock()
    metadata = signed(host(B, clock))
    receiver = host(A, clock, host_id="host-a")
    assert receiver.verify(CHAT, metadata) == ADMIN
    receiver.check_request(CHAT, pb.ChatRequest(session_id="s1"), metadata)
    assert SECRET not in str(metadata), "the token itself never travels"


def test_a_forward_carries_its_caller_signed_with_it() -> None:
    clock = Clock()
    tenant = Caller.of("sub with spaces, commas", Role.READER, ("acme-*", "b?"), "jwt")
    metadata = signed(host(B, clock), caller=tenant)
    assert host(A, clock).verify(CHAT, metadata) == tenant
    for forged in ("admin admin admin %2A", "operator x x acme-%2A", ""):
        edited = [(k, forged if k == CALLER_KEY else v) for k, v in signed(host(B, clock), caller=tenant)]
        with pytest.raises(Unauthenticated, match="does not verify"):
            host(A, clock).verify(CHAT, edited)


def test_a_signature_made_for_another_address_is_refused_by_every_host() -> None:
    clock = Clock()
    captured = signed(host(B, clock), address="127.0.0.1:6666")  # where the store pointed
    for audience in (A, B):
        with pytest.raises(Unauthenticated, match="does not verify"):
            host(audience, clock).verify(CHAT, captured)


def test_a_replayed_signature_is_refused_until_it_expires() -> None:
    clock = Clock()
    metadata = signed(host(B, clock))
    receiver = host(A, clock)
    receiver.verify(CHAT, metadata)
    clock.now += WINDOW - 1
    with pytest.raises(Unauthenticated, match="replayed"):
        receiver.verify(CHAT, metadata)
    clock.now += 2
    with pytest.raises(Unauthenticated, match="expired"):
        receiver.verify(CHAT, metadata)


@pytest.mark.parametrize("skew", [-WINDOW - 1, WINDOW + 1])
def test_a_signature_from_a_clock_more_than_the_window_away_is_refused(skew: float) -> None:
    metadata = signed(host(B, Clock(1_700_000_000.0 + skew)))
    with pytest.raises(Unauthenticated, match="expired"):
        host(A, Clock()).verify(CHAT, metadata)


def test_a_signature_is_good_for_its_method_and_its_session_only() -> None:
    clock = Clock()
    metadata = signed(host(B, clock))
    receiver = host(A, clock)
    with pytest.raises(Unauthenticated, match="does not verify"):
        receiver.verify("/rcoder.v1.AgentRunner/DeleteSession", metadata)
    with pytest.raises(Unauthenticated, match="forwarded method"):
        receiver.verify("/rcoder.v1.AgentRunner/ListSessions", metadata)
    receiver.verify(CHAT, metadata)
    with pytest.raises(Unauthenticated, match="signed for 'session_id=s1'"):
        receiver.check_request(CHAT, pb.ChatRequest(session_id="s2"), metadata)


def test_a_signature_under_another_secret_or_edited_is_refused() -> None:
    clock = Clock()
    with pytest.raises(Unauthenticated, match="does not verify"):
        host(A, clock).verify(CHAT, signed(host(B, clock, secret="another")))
    metadata = dict(signed(host(B, clock)))
    version, stamp, nonce, subject, mac = metadata[HEADER].split(" ")
    edits = {
        "subject": f"{version} {stamp} {nonce} session_id=s2 {mac}",
        "time": f"{version} {int(stamp) + 1} {nonce} {subject} {mac}",
        "nonce": f"{version} {stamp} other {subject} {mac}",
    }
    for edited in edits.values():
        with pytest.raises(Unauthenticated, match="does not verify"):
            host(A, clock).verify(CHAT, [("rcoder-forwarded-by", "host-b"), (HEADER, edited)])
    with pytest.raises(Unauthenticated, match="does not verify"):
        host(A, clock).verify(CHAT, [("rcoder-forwarded-by", "host-c"), (HEADER, metadata[HEADER])])
    with pytest.raises(Unauthenticated, match="malformed"):
        host(A, clock).verify(CHAT, [(HEADER, metadata[HEADER])])


def test_cancel_by_run_or_by_session_signs_the_field_it_names() -> None:
    clock = Clock()
    cancel = "/rcoder.v1.AgentRunner/Cancel"
    by_run = host(B, clock).sign(cancel, pb.CancelRequest(run_id="r1"), A, ADMIN)
    receiver = host(A, clock)
    receiver.verify(cancel, by_run)
    receiver.check_request(cancel, pb.CancelRequest(run_id="r1"), by_run)
    with pytest.raises(Unauthenticated, match="signed for 'run_id=r1'"):
        receiver.check_request(cancel, pb.CancelRequest(session_id="r1"), by_run)

"""JWT callers end to end (docs/access.md#jwts-from-the-platforms-identity-provider): a daemon configured with
a JWKS file takes bearer JWTs its keys signed, scoped by their claims, named by their subject in
the audit trail and counted as "jwt"; every bad token is UNAUTHENTICATED saying what is wrong; the
file rotated while the daemon runs takes effect at the next call."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import os
import time
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from jwt.algorithms import ECAlgorithm, RSAAlgorithm

from rcoder.v1 import agent_runner_pb2 as pb
from tests.conftest import DaemonFactory
from tests.harness import Client, error_info
from tests.test_tenants import ADMIN, as_, chat, refusal

ISSUER, AUDIENCE = "https://idp.test", "rcoder-tests"


def write_jwks(path: Path, **keys: rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey) -> None:
    """The file replaced whole (a new inode), as a rotation writes it: one public key per kid."""
    entries = []
    for kid, key in keys.items():
        public = key.public_key()
        entry = (
            RSAAlgorithm.to_jwk(public, as_dict=True)
            if isinstance(public, rsa.RSAPublicKey)
            else ECAlgorithm.to_jwk(public, as_dict=True)
        )
        entries.append({**entry, "kid": kid})
    scratch = path.with_name(path.name + ".new")
    scratch.write_text(json.dumps({"keys": entries}))
    os.replace(scratch, path)


def claims(**changes: Any) -> dict[str, Any]:
    now = time.time()
    base = {"iss": ISSUER, "aud": AUDIENCE, "sub": "user-42@acme", "exp": now + 600, "nbf": now - 5,
            "rcoder_projects": ["acme-*"], "rcoder_role": "operator"}  # fmt: skip
    return {name: value for name, value in {**base, **changes}.items() if value is not None}  # None: left out


def signed(key: Any, alg: str, kid: str, **changes: Any) -> str:
    return jwt.encode(claims(**changes), key, algorithm=alg, headers={"kid": kid})


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def handmade(header: dict[str, Any], secret: bytes | None) -> str:
    start = f"{b64(json.dumps(header).encode())}.{b64(json.dumps(claims()).encode())}"
    signature = b"" if secret is None else hmac.digest(secret, start.encode(), hashlib.sha256)
    return f"{start}.{b64(signature)}"


@pytest.fixture(scope="module")
def keys() -> tuple[rsa.RSAPrivateKey, rsa.RSAPrivateKey, ec.EllipticCurvePrivateKey]:
    return (
        rsa.generate_private_key(public_exponent=65537, key_size=2048),
        rsa.generate_private_key(public_exponent=65537, key_size=2048),
        ec.generate_private_key(ec.SECP256R1()),
    )


async def unauthenticated(client: Client, token: str) -> str:
    exc = await refusal(client.stub.ListSessions(pb.ListSessionsRequest(), metadata=as_(token)))
    assert exc.code() == grpc.StatusCode.UNAUTHENTICATED, exc.details()
    return exc.details() or ""


async def test_a_jwt_caller_is_scoped_by_its_claims_and_bad_tokens_say_what_is_wrong(
    make_daemon: DaemonFactory, tmp_path: Path, keys: tuple[Any, Any, Any]
) -> None:
    first, other, second = keys
    jwks = tmp_path / "jwks.json"
    write_jwks(jwks, k1=first)
    daemon, client = await make_daemon(
        auth_token=ADMIN, jwt_jwks_file=str(jwks), jwt_issuer=ISSUER, jwt_audience=AUDIENCE,
        metrics_listen="127.0.0.1:0",
    )  # fmt: skip
    (serving,) = await daemon.wait_log("metrics_serving")
    good = signed(first, "RS256", "k1")
    mine = await chat(client, good, "acme-web")
    theirs = await chat(client, ADMIN, "beta-web")
    listed = await client.stub.ListSessions(pb.ListSessionsRequest(), metadata=as_(good))
    assert [s.session_id for s in listed.sessions] == [mine.session_id]
    exc = await refusal(client.stub.GetSession(pb.GetSessionRequest(session_id=theirs.session_id), metadata=as_(good)))
    assert exc.code() == grpc.StatusCode.NOT_FOUND
    denied = await client.chat_error(prompt="hi", project_id="beta-web", metadata=as_(good))
    assert denied.code() == grpc.StatusCode.PERMISSION_DENIED and "user-42@acme" in (denied.details() or "")
    reader = signed(first, "RS256", "k1", rcoder_role="reader")
    exc = await refusal(
        client.stub.DeleteSession(pb.DeleteSessionRequest(session_id=mine.session_id), metadata=as_(reader))
    )
    assert exc.code() == grpc.StatusCode.PERMISSION_DENIED and error_info(exc).reason == "ROLE_LACKS_METHOD"

    # every bad token: UNAUTHENTICATED, saying which problem it has
    pem = first.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    bad = {
        "expired": (signed(first, "RS256", "k1", exp=time.time() - 3600), "expired"),
        "not yet valid": (signed(first, "RS256", "k1", nbf=time.time() + 3600), "not valid before"),
        "wrong issuer": (signed(first, "RS256", "k1", iss="https://evil.test"), "iss"),
        "wrong audience": (signed(first, "RS256", "k1", aud="someone-else"), "aud"),
        "wrong signature": (signed(other, "RS256", "k1"), "signature"),
        "alg none": (handmade({"alg": "none", "typ": "JWT", "kid": "k1"}, None), "'none'"),
        "HS256 with the public key": (handmade({"alg": "HS256", "typ": "JWT", "kid": "k1"}, pem), "'HS256'"),
        "unknown kid": (signed(second, "ES256", "k2"), "'k2'"),
        "missing claim": (signed(first, "RS256", "k1", rcoder_projects=None), "rcoder_projects"),
        "unknown role": (signed(first, "RS256", "k1", rcoder_role="root"), "rcoder_role"),
    }
    for name, (token, says) in bad.items():
        message = await unauthenticated(client, token)
        assert says in message, (name, message)
        assert all(part not in message for part in token.split(".") if part), "never the token itself"

    # the JWKS file rotated while the daemon runs: k2's tokens verify, k1's are refused, cached or not
    write_jwks(jwks, k2=second)
    rotated = signed(second, "ES256", "k2", sub="user-43@acme")
    assert (await chat(client, rotated, "acme-web", mine.session_id, "after the rotation")).session_id
    assert "'k1'" in await unauthenticated(client, good)

    # named by its subject in the audit trail; counted as "jwt", never by subject
    lines = await daemon.wait_log("audit", count=5)
    assert [(r["client"], r["method"], r["code"]) for r in lines] == [
        ("jwt:user-42@acme", "Chat", "OK"),
        ("admin", "Chat", "OK"),
        ("jwt:user-42@acme", "Chat", "PERMISSION_DENIED"),
        ("jwt:user-42@acme", "DeleteSession", "PERMISSION_DENIED"),
        ("jwt:user-43@acme", "Chat", "OK"),
    ]
    scrape = urllib.request.Request(
        f"http://{serving['address']}/metrics", headers={"Authorization": f"Bearer {ADMIN}"}
    )
    text = (await asyncio.to_thread(lambda: urllib.request.urlopen(scrape, timeout=10).read())).decode()
    assert 'rcoder_requests_total{client="jwt",code="OK",method="Chat"} 2.0' in text
    assert "user-42" not in text and "user-43" not in text


async def test_no_jwt_poses_as_the_admin_or_a_client_and_an_emptied_jwks_refuses_every_jwt(
    make_daemon: DaemonFactory, tmp_path: Path, keys: tuple[Any, Any, Any]
) -> None:
    first, _, _ = keys
    jwks = tmp_path / "jwks.json"
    write_jwks(jwks, k1=first)
    daemon, client = await make_daemon(
        auth_token=ADMIN, jwt_jwks_file=str(jwks), jwt_issuer=ISSUER, jwt_audience=AUDIENCE,
        clients=[{"name": "acme-chat", "token_sha256": hashlib.sha256(b"acme").hexdigest(),
                  "projects": ["acme-*"], "role": "operator"}],
    )  # fmt: skip
    posers = {sub: signed(first, "RS256", "k1", sub=sub) for sub in ("admin", "acme-chat")}
    started = {sub: await chat(client, token, "acme-web") for sub, token in posers.items()}

    for sub, event in started.items():
        runs = await client.stub.ListRuns(pb.ListRunsRequest(session_id=event.session_id), metadata=as_(ADMIN))
        assert [r.client for r in runs.runs] == [f"jwt:{sub}"]
    lines = await daemon.wait_log("audit", count=2)
    assert sorted(r["client"] for r in lines) == ["jwt:acme-chat", "jwt:admin"]

    # the file emptied: every JWT is refused at once, cached ones too, naming no path
    jwks.write_text("")
    message = await unauthenticated(client, posers["admin"])
    assert message == "JWT kid 'k1' is not a key this daemon verifies with"
    jwks.unlink()
    assert await unauthenticated(client, posers["acme-chat"]) == message
    (warned, *_) = await daemon.wait_log("jwt_jwks_unreadable")
    assert warned["path"] == str(jwks)
    assert (await client.stub.ListAgents(pb.ListAgentsRequest(), metadata=as_(ADMIN))).agents  # the admin still works

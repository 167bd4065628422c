"""JWT bearer tokens (rcoder.api.jwt_tokens): RS256, ES256 and EdDSA under a key of the JWKS file
chosen by kid and used only for its own algorithm; every other token refused as Unauthenticated
with a message naming its problem, whatever it holds; the file followed as it is rotated."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeAlias

import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from hypothesis import given, settings
from hypothesis import strategies as st
from jwt.algorithms import ECAlgorithm, OKPAlgorithm, RSAAlgorithm
from structlog.testing import capture_logs

from rcoder.api import jwt_tokens
from rcoder.api.jwt_tokens import JwtClaims, JwtVerifier, looks_like_jwt
from rcoder.errors import ConfigError, Unauthenticated

pytestmark = pytest.mark.fast  # starts no process: `make check` (tests/process_guard.py)

NOW = 1_800_000_000.0  # 2027-01-15T08:00:00Z
ISSUER = "https://idp.example"
AUDIENCE = "rcoder"
DROP = object()  # a claim left out of the token

# aliases: the fields of Keys are named like the modules
RsaKey: TypeAlias = rsa.RSAPrivateKey
EcKey: TypeAlias = ec.EllipticCurvePrivateKey
EdKey: TypeAlias = ed25519.Ed25519PrivateKey
PrivateKey: TypeAlias = RsaKey | EcKey | EdKey


@dataclass(frozen=True)
class Keys:
    rsa: RsaKey
    rsa_other: RsaKey
    ec: EcKey
    ed: EdKey


@pytest.fixture(scope="module")
def keys() -> Keys:
    return Keys(
        rsa.generate_private_key(public_exponent=65537, key_size=2048),
        rsa.generate_private_key(public_exponent=65537, key_size=2048),
        ec.generate_private_key(ec.SECP256R1()),
        ed25519.Ed25519PrivateKey.generate(),
    )


class Clock:
    def __init__(self, now: float = NOW) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def jwk(key: PrivateKey, kid: str | None, **extra: Any) -> dict[str, Any]:
    """The public JWK of ``key``, with ``kid`` (left out when None) and any other members."""
    public = key.public_key()
    if isinstance(public, rsa.RSAPublicKey):
        entry = RSAAlgorithm.to_jwk(public, as_dict=True)
    elif isinstance(public, ec.EllipticCurvePublicKey):
        entry = ECAlgorithm.to_jwk(public, as_dict=True)
    else:
        entry = OKPAlgorithm.to_jwk(public, as_dict=True)
    if kid is not None:
        entry["kid"] = kid
    return {**entry, **extra}


def write_jwks(path: Path, *entries: dict[str, Any]) -> Path:
    """The JWKS file at ``path``, replaced whole (a new inode), as a rotation writes it."""
    scratch = path.with_name(path.name + ".new")
    scratch.write_text(json.dumps({"keys": list(entries)}))
    os.replace(scratch, path)
    return path


def payload(**changes: Any) -> dict[str, Any]:
    claims: dict[str, Any] = {
        "iss": ISSUER,
        "aud": AUDIENCE,
        "sub": "client-7",
        "exp": NOW + 600,
        "rcoder_projects": ["web-*", "docs"],
        "rcoder_role": "developer",
    }
    claims.update(changes)
    return {name: value for name, value in claims.items() if value is not DROP}


def token(key: PrivateKey, alg: str, kid: str | None = "k1", **changes: Any) -> str:
    """A token signed by ``key`` (PyJWS: jwt.encode itself refuses some of the claims tests send)."""
    claims = json.dumps(payload(**changes)).encode()
    return jwt.PyJWS().encode(claims, key, algorithm=alg, headers={"kid": kid} if kid is not None else None)


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def seg(data: bytes | dict[str, Any] | list[Any]) -> str:
    """One base64url segment: of ``data``, or of a header or payload as JSON."""
    return b64(data if isinstance(data, bytes) else json.dumps(data).encode())


def handmade(header: dict[str, Any], claims: dict[str, Any], sign: Callable[[bytes], bytes]) -> str:
    signing_input = f"{b64(json.dumps(header).encode())}.{b64(json.dumps(claims).encode())}"
    return f"{signing_input}.{b64(sign(signing_input.encode()))}"


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def jwks_path(tmp_path: Path, keys: Keys) -> Path:
    return write_jwks(tmp_path / "jwks.json", jwk(keys.rsa, "k1"), jwk(keys.ec, "k2"), jwk(keys.ed, "k3"))


@pytest.fixture(scope="module")
def shared_jwks(tmp_path_factory: pytest.TempPathFactory, keys: Keys) -> Path:
    """The same file as jwks_path, for the property tests (which take no function-scoped fixture)."""
    path = tmp_path_factory.mktemp("jwks") / "jwks.json"
    return write_jwks(path, jwk(keys.rsa, "k1"), jwk(keys.ec, "k2"), jwk(keys.ed, "k3"))


@pytest.fixture
def verifier(jwks_path: Path, clock: Clock) -> JwtVerifier:
    return JwtVerifier(jwks_path, ISSUER, AUDIENCE, clock=clock)


def refused(verifier: JwtVerifier, text: str) -> str:
    """The message ``verifier`` refuses ``text`` with (never naming the token)."""
    with pytest.raises(Unauthenticated) as caught:
        verifier.verify(text)
    message = caught.value.message
    assert message.startswith("JWT ")
    for part in (text, *text.split(".")):
        assert len(part) < 8 or part not in message
    return message


EXPECTED = JwtClaims(subject="client-7", projects=("web-*", "docs"), role="developer", expires_at=NOW + 600)


# ---------------------------------------------------------------- good tokens


@pytest.mark.parametrize(
    ("which", "alg", "kid"), [("rsa", "RS256", "k1"), ("ec", "ES256", "k2"), ("ed", "EdDSA", "k3")]
)
def test_a_token_of_each_algorithm_verifies_with_the_key_its_kid_names(
    verifier: JwtVerifier, keys: Keys, which: str, alg: str, kid: str
) -> None:
    claims = verifier.verify(token(getattr(keys, which), alg, kid))
    assert claims == EXPECTED
    assert looks_like_jwt(token(getattr(keys, which), alg, kid))


def test_an_aud_list_that_names_the_audience_is_accepted_and_one_that_does_not_is_refused(
    verifier: JwtVerifier, keys: Keys
) -> None:
    assert verifier.verify(token(keys.rsa, "RS256", aud=["other", AUDIENCE])).subject == "client-7"
    message = refused(verifier, token(keys.rsa, "RS256", aud=["other", "another"]))
    assert message == "JWT aud ['other', 'another'] does not name the configured jwt.audience 'rcoder'"


def test_a_token_without_kid_takes_the_one_key_of_a_file_that_holds_one(
    tmp_path: Path, keys: Keys, clock: Clock
) -> None:
    path = write_jwks(tmp_path / "jwks.json", jwk(keys.ec, None))
    assert JwtVerifier(path, ISSUER, AUDIENCE, clock=clock).verify(token(keys.ec, "ES256", kid=None)) == EXPECTED


# ---------------------------------------------------------------- time


def test_an_expired_token_is_refused_naming_when_it_expired(verifier: JwtVerifier, keys: Keys) -> None:
    message = refused(verifier, token(keys.rsa, "RS256", exp=NOW - 61))
    assert message == "JWT expired at 2027-01-15T07:58:59Z (60 s of clock skew allowed)"


def test_a_token_expired_within_the_leeway_is_accepted(verifier: JwtVerifier, keys: Keys) -> None:
    assert verifier.verify(token(keys.ec, "ES256", "k2", exp=NOW - 59)).expires_at == NOW - 59


def test_a_token_not_yet_valid_is_refused_and_one_valid_within_the_leeway_accepted(
    verifier: JwtVerifier, keys: Keys
) -> None:
    message = refused(verifier, token(keys.ed, "EdDSA", "k3", nbf=NOW + 120))
    assert message == "JWT is not valid before 2027-01-15T08:02:00Z (nbf; 60 s of clock skew allowed)"
    assert verifier.verify(token(keys.ed, "EdDSA", "k3", nbf=NOW + 30)) == EXPECTED


@pytest.mark.parametrize("exp", ["soon", True, 10**400, -1, float("nan"), float("inf"), [NOW]])
def test_an_exp_that_is_no_time_is_refused(verifier: JwtVerifier, keys: Keys, exp: Any) -> None:
    assert "JWT claim exp is not a time in unix seconds" in refused(verifier, token(keys.rsa, "RS256", exp=exp))


# ---------------------------------------------------------------- claims


def test_a_token_of_another_issuer_is_refused_naming_both(verifier: JwtVerifier, keys: Keys) -> None:
    message = refused(verifier, token(keys.rsa, "RS256", iss="https://evil.example"))
    assert message == "JWT iss 'https://evil.example' is not the configured jwt.issuer 'https://idp.example'"


def test_a_token_for_another_audience_is_refused_naming_both(verifier: JwtVerifier, keys: Keys) -> None:
    message = refused(verifier, token(keys.rsa, "RS256", aud="billing"))
    assert message == "JWT aud 'billing' does not name the configured jwt.audience 'rcoder'"


@pytest.mark.parametrize("claim", ["exp", "iss", "aud", "sub", "rcoder_projects", "rcoder_role"])
def test_a_token_missing_a_required_claim_is_refused_naming_it(verifier: JwtVerifier, keys: Keys, claim: str) -> None:
    left_out: dict[str, Any] = {claim: DROP}
    message = refused(verifier, token(keys.rsa, "RS256", **left_out))
    assert message.startswith(f"JWT claim {claim} is missing")


@pytest.mark.parametrize(
    ("claim", "value", "problem"),
    [
        ("rcoder_projects", "web-*", "JWT claim rcoder_projects is not a non-empty list of non-empty strings"),
        ("rcoder_projects", [], "JWT claim rcoder_projects is not a non-empty list of non-empty strings"),
        ("rcoder_projects", ["web", ""], "JWT claim rcoder_projects is not a non-empty list of non-empty strings"),
        ("rcoder_projects", ["web", 7], "JWT claim rcoder_projects is not a non-empty list of non-empty strings"),
        ("rcoder_projects", {"web": 1}, "JWT claim rcoder_projects is not a non-empty list of non-empty strings"),
        ("rcoder_role", ["admin"], "JWT claim rcoder_role is not a string"),
        ("rcoder_role", 1, "JWT claim rcoder_role is not a string"),
        ("sub", 42, "JWT claim sub is not a non-empty string"),
        ("sub", "", "JWT claim sub is not a non-empty string"),
        ("aud", [AUDIENCE, 3], "JWT claim aud is not a string or a list of strings"),
        ("iss", 5, "JWT iss 5 is not the configured jwt.issuer 'https://idp.example'"),
    ],
)
def test_a_claim_of_the_wrong_type_is_refused_naming_it(
    verifier: JwtVerifier, keys: Keys, claim: str, value: Any, problem: str
) -> None:
    assert refused(verifier, token(keys.rsa, "RS256", **{claim: value})) == problem


# ---------------------------------------------------------------- signatures, algorithms, keys


def test_a_token_signed_by_another_key_under_the_same_kid_is_refused(
    verifier: JwtVerifier, keys: Keys, jwks_path: Path
) -> None:
    message = refused(verifier, token(keys.rsa_other, "RS256", "k1"))
    assert message == (
        "JWT signature does not verify with the key its kid names: it was signed by another key, or altered"
    )
    assert str(jwks_path) not in message


def test_a_token_whose_claims_were_altered_is_refused(verifier: JwtVerifier, keys: Keys) -> None:
    header, _, signature = token(keys.ec, "ES256", "k2").split(".")
    forged = f"{header}.{b64(json.dumps(payload(rcoder_role='admin')).encode())}.{signature}"
    assert "JWT signature does not verify" in refused(verifier, forged)


@pytest.mark.parametrize("alg", ["none", "None", "NONE", ""])
def test_an_unsigned_token_is_refused(verifier: JwtVerifier, alg: str) -> None:
    unsigned = f"{b64(json.dumps({'alg': alg, 'kid': 'k1'}).encode())}.{b64(json.dumps(payload()).encode())}."
    assert looks_like_jwt(unsigned)  # so it gets a JWT's refusal, not a static token's
    assert refused(verifier, unsigned) == f"JWT alg {alg!r} is not accepted: use RS256, ES256 or EdDSA"


def test_an_unsigned_token_without_alg_is_refused(verifier: JwtVerifier) -> None:
    unsigned = f"{b64(b'{}')}.{b64(json.dumps(payload()).encode())}."
    assert refused(verifier, unsigned) == "JWT alg None is not accepted: use RS256, ES256 or EdDSA"


@pytest.mark.parametrize("secret_of", ["pem", "jwk"])
def test_hs256_signed_with_the_public_key_as_the_secret_is_refused(
    verifier: JwtVerifier, keys: Keys, secret_of: str
) -> None:
    """Key confusion: a verifier that let the token's alg pick how the key is used would check this
    HMAC with the public key's bytes as the secret, which anyone has."""
    pem = keys.rsa.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    secret = pem if secret_of == "pem" else json.dumps(jwk(keys.rsa, "k1")).encode()
    forged = handmade(
        {"alg": "HS256", "typ": "JWT", "kid": "k1"}, payload(), lambda data: hmac.digest(secret, data, hashlib.sha256)
    )
    assert refused(verifier, forged) == "JWT alg 'HS256' is not accepted: use RS256, ES256 or EdDSA"


@pytest.mark.parametrize("alg", ["RS384", "RS512", "PS256", "ES384", "HS512", "ES256K", "Ed25519"])
def test_other_algorithms_are_refused_naming_the_alg(verifier: JwtVerifier, keys: Keys, alg: str) -> None:
    forged = handmade({"alg": alg, "kid": "k1"}, payload(), lambda data: b"\x01" * 64)
    assert refused(verifier, forged) == f"JWT alg {alg!r} is not accepted: use RS256, ES256 or EdDSA"


def test_a_token_cannot_use_a_key_for_another_algorithm(verifier: JwtVerifier, keys: Keys, jwks_path: Path) -> None:
    """ES256 under the kid of the RSA key: the key is used for RS256 only, whatever the token says."""
    with capture_logs() as logged:
        message = refused(verifier, token(keys.ec, "ES256", "k1"))
    assert message == "JWT alg 'ES256' does not fit the key its kid names"
    (line,) = [e for e in logged if e["event"] == "jwt_refused"]  # the operator reads the rest
    assert line["problem"] == "alg 'ES256' does not fit key 'k1' (it is RSA for RS256 only)"
    assert line["path"] == str(jwks_path)


def test_an_unknown_kid_is_refused_naming_no_path_and_no_kid_of_the_file_which_are_logged(
    verifier: JwtVerifier, keys: Keys, jwks_path: Path
) -> None:
    with capture_logs() as logged:
        message = refused(verifier, token(keys.rsa, "RS256", "k9"))
    assert message == "JWT kid 'k9' is not a key this daemon verifies with"
    (line,) = [e for e in logged if e["event"] == "jwt_refused"]
    assert (line["path"], line["keys"]) == (str(jwks_path), "k1, k2, k3")


def test_a_token_without_kid_is_refused_when_the_file_holds_several_keys(
    tmp_path: Path, keys: Keys, clock: Clock
) -> None:
    path = write_jwks(tmp_path / "jwks.json", jwk(keys.rsa, "k1"), jwk(keys.ec, "k2"))
    message = refused(JwtVerifier(path, ISSUER, AUDIENCE, clock=clock), token(keys.rsa, "RS256", kid=None))
    assert message == "JWT has no kid: the token's header must name its key"


@pytest.mark.parametrize(
    ("entry_of", "problem"),
    [
        (lambda k: jwk(k.rsa, "bad", alg="RS512"), "alg 'RS512': rcoder verifies RS256 only with an RSA key"),
        (lambda k: jwk(k.rsa, "bad", alg="HS256"), "alg 'HS256': rcoder verifies RS256 only with an RSA key"),
        (lambda k: jwk(k.rsa, "bad", use="enc"), "use 'enc': not a signing key"),
        (
            lambda k: jwk(ec.generate_private_key(ec.SECP384R1()), "bad"),
            "an EC key on curve 'P-384': rcoder takes P-256 only (for ES256)",
        ),
        (
            lambda k: {"kty": "oct", "kid": "bad", "k": b64(b"s" * 32)},
            "kty 'oct': rcoder takes RSA, EC (P-256) and OKP (Ed25519) keys",
        ),
        (
            lambda k: jwk(rsa.generate_private_key(public_exponent=65537, key_size=1024), "bad"),
            "an RSA key of 1024 bits: rcoder takes 2048 or more",
        ),
        (
            lambda k: {**jwk(k.ec, "bad"), "x": "AAAA"},
            "not a valid EC key",
        ),
        (
            lambda k: {**jwk(k.ed, "bad"), "d": b64(b"\x00" * 32)},
            "it holds a private key ('d'): the JWKS file is for public keys only",
        ),
    ],
)
def test_a_kid_naming_a_key_rcoder_cannot_use_is_refused_saying_why(
    tmp_path: Path, keys: Keys, clock: Clock, entry_of: Callable[[Keys], dict[str, Any]], problem: str
) -> None:
    path = write_jwks(tmp_path / "jwks.json", jwk(keys.rsa, "k1"), entry_of(keys))
    with capture_logs() as logged:
        verifier = JwtVerifier(path, ISSUER, AUDIENCE, clock=clock)
    assert [(e["kid"], e["problem"][: len(problem)]) for e in logged if e["event"] == "jwt_jwks_key_unusable"] == [
        ("bad", problem)
    ]
    with capture_logs() as logged:
        message = refused(verifier, token(keys.rsa, "RS256", "bad"))
    assert message == "JWT kid 'bad' is not a key this daemon verifies with"  # as a kid the file lacks
    (line,) = [e for e in logged if e["event"] == "jwt_refused"]
    assert line["problem"].startswith(f"kid 'bad': {problem}")
    assert verifier.verify(token(keys.rsa, "RS256", "k1")) == EXPECTED  # the rest of the file is used


# ---------------------------------------------------------------- whatever a client sends


RS256_K1 = seg({"alg": "RS256", "kid": "k1"})
GARBAGE = [
    "",
    "a.b.c",
    "A" * 65536,
    "A" * 8000 + "." + "A" * 8000 + "." + "A" * 300,
    "ünïcödé.ünïcödé.ünïcödé",
    "\udcff.\udcff.\udcff",
    "\x00",
    "Bearer x",
    "a.b",
    "a.b.c.d",
    "....",
    ".e30.",
    "e30..",
    f"{seg(b'not json')}.{seg({})}.",
    f"{seg(b'[1]')}.{seg({})}.",
    f"{seg(b'{}' * 3)}.{seg({})}.",
    f"{seg({'alg': 'RS256', 'kid': 7})}.{seg({})}.AAAA",
    f"{seg({'alg': 'RS256', 'kid': 'k1', 'crit': ['exp'], 'exp': 1})}.{seg({})}.AAAA",
    f"{seg({'alg': 'RS256', 'kid': 'k1', 'b64': False, 'crit': ['b64']})}.{seg({})}.AAAA",
    f"{RS256_K1}.{seg(b'[]')}.AAAA",
    f"{RS256_K1}.{seg(b'not json')}.AAAA",
    RS256_K1 + "." + seg(b"\xff\xfe") + ".AAAA",
    f"{RS256_K1}.{seg({})}.A",
    f"{RS256_K1}.{seg({})}.",
    f"{RS256_K1}.{seg({})}.AAAA====",
    f"{seg({'alg': 'ES256', 'kid': 'k2'})}.{seg({})}.{seg(b'x' * 64)}",
    f"{seg({'alg': 'ES256', 'kid': 'k2'})}.{seg({})}.{seg(b'x' * 7)}",
    f"{seg({'alg': 'EdDSA', 'kid': 'k3'})}.{seg({})}.{seg(b'x' * 3)}",
    f"{seg({'alg': ['RS256']})}.{seg({})}.",
    f"{seg({'alg': {}})}.{seg({})}.",
    f"{seg(b'[' * 10000)}.{seg({})}.",
    seg(b'{"alg": ' * 3000) + "." + seg({}) + ".",
]


@pytest.mark.parametrize("text", GARBAGE, ids=range(len(GARBAGE)))
def test_garbage_is_only_ever_refused_as_unauthenticated(verifier: JwtVerifier, text: str) -> None:
    message = refused(verifier, text)
    assert len(message) < 400


def test_a_long_token_is_refused_saying_how_long(verifier: JwtVerifier) -> None:
    assert refused(verifier, "A" * 65536) == "JWT is 65536 characters long: rcoder takes at most 16384"


def test_a_token_that_is_no_jwt_is_refused_saying_so(verifier: JwtVerifier) -> None:
    assert refused(verifier, "a.b") == "JWT is not three base64url segments joined by '.'"
    assert refused(verifier, "a.b.c").startswith("JWT header is not base64url-encoded JSON (Invalid base64")
    assert refused(verifier, f"{seg([1])}.e30.") == "JWT header is not a JSON object"
    assert refused(verifier, "ünï") == "JWT holds characters that are not ASCII: it is base64url and '.' only"


@settings(max_examples=300, deadline=None)
@given(text=st.text(max_size=300) | st.from_regex(r"[A-Za-z0-9_-]{0,40}\.[A-Za-z0-9_-]{0,40}\.[A-Za-z0-9_=-]{0,40}"))
def test_any_text_is_only_ever_refused_as_unauthenticated(shared_jwks: Path, text: str) -> None:
    verifier = JwtVerifier(shared_jwks, ISSUER, AUDIENCE, clock=Clock())
    with pytest.raises(Unauthenticated):
        verifier.verify(text)


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_any_one_character_changed_in_a_good_token_makes_it_refused(shared_jwks: Path, keys: Keys, data: Any) -> None:
    verifier = JwtVerifier(shared_jwks, ISSUER, AUDIENCE, clock=Clock())
    good = token(keys.ed, "EdDSA", "k3")
    at = data.draw(st.integers(0, len(good) - 1))
    replacement = data.draw(st.sampled_from("AQgwz09-_.=+/ ").filter(lambda c: c != good[at]))
    with pytest.raises(Unauthenticated):
        verifier.verify(good[:at] + replacement + good[at + 1 :])


def test_looks_like_jwt_is_three_base64url_segments() -> None:
    assert looks_like_jwt("eyJh.eyJi.c2ln") and looks_like_jwt("a.b.")
    for text in ["", "abc", "a.b", "a.b.c.d", ".b.c", "a..c", "a b.c.d", "a.b.c\n", "a.b.c=", "a+b.c.d"]:
        assert not looks_like_jwt(text), text


# ---------------------------------------------------------------- the JWKS file


def test_a_rotated_jwks_file_is_followed_without_a_new_verifier(
    verifier: JwtVerifier, jwks_path: Path, keys: Keys
) -> None:
    old = token(keys.rsa, "RS256", "k1")
    assert verifier.verify(old) == EXPECTED  # cached now: the rotation must empty the cache too
    write_jwks(jwks_path, jwk(keys.rsa_other, "k4"))
    assert refused(verifier, old) == "JWT kid 'k1' is not a key this daemon verifies with"
    assert verifier.verify(token(keys.rsa_other, "RS256", "k4")) == EXPECTED


def test_a_jwks_file_rewritten_in_place_is_followed(verifier: JwtVerifier, jwks_path: Path, keys: Keys) -> None:
    old = token(keys.ec, "ES256", "k2")
    assert verifier.verify(old) == EXPECTED
    jwks_path.write_text(json.dumps({"keys": [jwk(keys.ed, "k3")]}))  # same inode, another size
    assert refused(verifier, old) == "JWT kid 'k2' is not a key this daemon verifies with"
    assert verifier.verify(token(keys.ed, "EdDSA", "k3")) == EXPECTED


def test_a_key_replaced_under_the_same_kid_stops_its_cached_tokens(
    verifier: JwtVerifier, jwks_path: Path, keys: Keys
) -> None:
    old = token(keys.rsa, "RS256", "k1")
    assert verifier.verify(old) == EXPECTED
    write_jwks(jwks_path, jwk(keys.rsa_other, "k1"))
    assert "JWT signature does not verify" in refused(verifier, old)
    assert verifier.verify(token(keys.rsa_other, "RS256", "k1")) == EXPECTED


@pytest.mark.parametrize("broken", ["{not json", '{"keys": "k1"}', "[]", "", None, "unreadable"])
def test_a_broken_rewrite_refuses_every_token_until_mended_and_is_logged_once(
    verifier: JwtVerifier, jwks_path: Path, keys: Keys, broken: str | None
) -> None:
    """Fail closed: an operator who empties or deletes the file to revoke every key gets that,
    cached tokens included (before, the keys read last stayed in force)."""
    good = token(keys.rsa, "RS256", "k1")
    assert verifier.verify(good) == EXPECTED  # cached
    with capture_logs() as logged:
        if broken is None:
            jwks_path.unlink()
        elif broken == "unreadable":
            # a file this process cannot open (the daemon runs as root, which reads any mode: a
            # folder in its place is unreadable as a file to anyone)
            jwks_path.unlink()
            jwks_path.mkdir()
        else:
            jwks_path.write_text(broken)
        assert refused(verifier, good) == "JWT kid 'k1' is not a key this daemon verifies with"
        assert refused(verifier, token(keys.ec, "ES256", "k2")) == "JWT kid 'k2' is not a key this daemon verifies with"
    warnings = [e for e in logged if e["event"] == "jwt_jwks_unreadable"]
    assert len(warnings) == 1
    assert warnings[0]["path"] == str(jwks_path) and warnings[0]["keys"] == "none: every JWT refused"
    assert warnings[0]["problem"]
    if jwks_path.is_dir():
        jwks_path.rmdir()
    write_jwks(jwks_path, jwk(keys.ed, "k5"))  # mended: read again
    assert verifier.verify(token(keys.ed, "EdDSA", "k5")) == EXPECTED
    assert "is not a key this daemon verifies with" in refused(verifier, good)


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (None, "No such file or directory"),
        ("{not json", "not JSON"),
        ('{"keys": {}}', 'not a JWKS document: it is {"keys": [...]}'),
        ('{"keys": []}', "holds no key rcoder can use (none)"),
        ('{"keys": [{"kty": "oct", "kid": "s", "k": "c2VjcmV0"}]}', "holds no key rcoder can use (s: kty 'oct'"),
    ],
)
def test_a_jwks_file_that_cannot_be_used_at_start_is_a_config_error(
    tmp_path: Path, content: str | None, problem: str
) -> None:
    path = tmp_path / "jwks.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError) as caught:
        JwtVerifier(path, ISSUER, AUDIENCE)
    assert caught.value.key == "jwt_jwks_file"
    assert str(path) in caught.value.message and problem in caught.value.message


# ---------------------------------------------------------------- the cache


class CountingDecoder:
    """PyJWT's decoder, counting the signatures it checks."""

    def __init__(self) -> None:
        self.calls = 0

    def decode(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return jwt.PyJWT().decode(*args, **kwargs)


@pytest.fixture
def decoder(monkeypatch: pytest.MonkeyPatch) -> CountingDecoder:
    counting = CountingDecoder()
    monkeypatch.setattr(jwt_tokens, "_DECODER", counting)
    return counting


def test_a_cached_token_gives_the_same_claims_until_it_expires(
    verifier: JwtVerifier, keys: Keys, clock: Clock, decoder: CountingDecoder
) -> None:
    good = token(keys.rsa, "RS256", "k1", exp=NOW + 100)
    first = verifier.verify(good)
    clock.now = NOW + 159  # past exp, within the leeway
    assert verifier.verify(good) is first
    assert decoder.calls == 1
    clock.now = NOW + 160
    assert refused(verifier, good) == "JWT expired at 2027-01-15T08:01:40Z (60 s of clock skew allowed)"
    assert refused(verifier, good) == "JWT expired at 2027-01-15T08:01:40Z (60 s of clock skew allowed)"
    assert decoder.calls == 2  # the second refusal checked it again: nothing expired stays cached


def test_the_cache_holds_at_most_cache_size_tokens(
    jwks_path: Path, keys: Keys, clock: Clock, decoder: CountingDecoder
) -> None:
    verifier = JwtVerifier(jwks_path, ISSUER, AUDIENCE, clock=clock, cache_size=2)
    a, b, c = (token(keys.ed, "EdDSA", "k3", sub=sub) for sub in "abc")
    for text in (a, b, a, c):  # c pushes out b, the least recently used
        verifier.verify(text)
    assert decoder.calls == 3
    verifier.verify(a)
    assert decoder.calls == 3
    assert verifier.verify(b).subject == "b"
    assert decoder.calls == 4


def test_a_refused_token_is_not_cached(verifier: JwtVerifier, keys: Keys, decoder: CountingDecoder) -> None:
    bad = token(keys.rsa, "RS256", "k1", iss="https://evil.example")
    refused(verifier, bad)
    refused(verifier, bad)
    assert decoder.calls == 2

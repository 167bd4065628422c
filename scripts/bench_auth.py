"""``auth_check_us``: what checking a caller costs a call (rcoder.api.gate's ``BearerToken.check``
and the scope's check of its project), in microseconds, in this process.

Three callers against the same gate: the admin (one constant-time comparison: the baseline),
one of ``CLIENTS`` configured clients (a SHA-256 and a dict lookup), and a JWT signed by a key of
a JWKS (RS256, verified once, then from the cache until it expires). Each is checked
``ROUNDS`` times; the line is the median per check. Nothing here is on the network: the cost is
the check's alone, which a call pays before its request is read.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_common import Bench, Result, judged

from rcoder.api.callers import ClientTable, jwt_callers
from rcoder.api.gate import BearerToken
from rcoder.config import ClientKeys

CLIENTS = 1000
ROUNDS = 20000
BATCHES = 7


class _Context:
    """What ``BearerToken.check`` reads of a grpc call."""

    def __init__(self, token: str) -> None:
        self._metadata = (("authorization", f"Bearer {token}"), ("user-agent", "grpc-python"))

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def peer(self) -> str:
        return "ipv4:127.0.0.1:5555"


def _per_check_us(token: BearerToken, context: Any, project: str) -> float:
    """The median over ``BATCHES`` of the time per check (the caller, then its project)."""
    batches = []
    for _ in range(BATCHES):
        began = time.perf_counter()
        for _ in range(ROUNDS):
            caller = token.check(context, "/rcoder.v1.AgentRunner/Chat")
            if not caller.sees(project):
                raise RuntimeError(f"{caller.name} does not see {project}")
        batches.append((time.perf_counter() - began) / ROUNDS * 1e6)
    return statistics.median(batches)


def _jwt_setup(folder: Path) -> tuple[str, str]:
    """A JWKS file of one RSA key, and a token it signed: (jwks path, token)."""
    import jwt
    from cryptography.hazmat.primitives.asymmetric import rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    public = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(key.public_key()))
    path = folder / "jwks.json"
    path.write_text(json.dumps({"keys": [{**public, "kid": "k1", "alg": "RS256", "use": "sig"}]}))
    claims = {"iss": "https://id.bench", "aud": "rcoder", "sub": "bench", "exp": int(time.time()) + 3600,
              "rcoder_projects": ["acme-*"], "rcoder_role": "operator"}  # fmt: skip
    return str(path), jwt.encode(claims, key, algorithm="RS256", headers={"kid": "k1"})


async def auth_check(bench: Bench) -> list[Result]:
    clients = [
        ClientKeys(name=f"tenant-{n}", token_sha256=hashlib.sha256(f"token-{n}".encode()).hexdigest(),
                   projects=(f"tenant-{n}-*",), role="operator")
        for n in range(CLIENTS)
    ]  # fmt: skip
    with tempfile.TemporaryDirectory(dir=bench.root) as tmp:
        jwks, signed = _jwt_setup(Path(tmp))
        jwt = jwt_callers(jwks, "https://id.bench", "rcoder")
        gate = BearerToken("admin-token", clients=ClientTable(clients), jwt=jwt)
        admin = _per_check_us(gate, _Context("admin-token"), "anything")
        client = _per_check_us(gate, _Context(f"token-{CLIENTS // 2}"), f"tenant-{CLIENTS // 2}-web")
        began = time.perf_counter()
        gate.check(_Context(signed), "/rcoder.v1.AgentRunner/Chat")
        first_jwt = (time.perf_counter() - began) * 1e6
        cached_jwt = _per_check_us(gate, _Context(signed), "acme-web")
    details = {"admin_us": admin, "client_us": client, "clients": CLIENTS, "jwt_first_us": first_jwt,
               "jwt_cached_us": cached_jwt}  # fmt: skip
    what = f"checking a caller and its project, per call, in µs: a configured token among {CLIENTS}"
    results: list[Result] = [judged("auth_check_us", what, client, "<= 30", dict(details))]
    what = "the same for a JWT (RS256, verified once, then from the cache until it expires), in µs"
    results.append(judged("auth_check_jwt_us", what, cached_jwt, "<= 150", dict(details)))
    return results

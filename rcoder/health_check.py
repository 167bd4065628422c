"""``rcoder health``: ask a daemon's ``grpc.health.v1.Health`` whether it serves; exit 0 if so.

The container image's HEALTHCHECK (no grpcurl there). Health asks no token. The daemon asked is
``--target``, else ``RCODER_TARGET``, else this host's daemon (``rcoder.client.token.local_target``).
"""

from __future__ import annotations

from typing import TextIO

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

SERVING, NOT_SERVING, UNREACHABLE = 0, 1, 2


def check(target: str, timeout: float, out: TextIO, err: TextIO) -> int:
    """Print the status of ``target`` (the whole server: service ""); 0 when SERVING."""
    with grpc.insecure_channel(target) as channel:
        try:
            answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
        except grpc.RpcError as exc:
            err.write(f"rcoder health: {target}: {exc.code().name}: {exc.details()}\n")
            return UNREACHABLE
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status)
    out.write(f"{target}: {status}\n")
    return SERVING if answer.status == health_pb2.HealthCheckResponse.SERVING else NOT_SERVING

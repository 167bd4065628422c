"""The grpc.aio server: AgentRunner, health and reflection."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from rcoder.api.service import AgentRunnerService
from rcoder.v1 import agent_runner_pb2 as pb
from rcoder.v1 import agent_runner_pb2_grpc as pb_grpc

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["AgentRunner"].full_name
MAX_MESSAGE_BYTES = 64 << 20


class GrpcServer:
    """Owns the grpc.aio server; ``stop()`` is safe to call twice."""

    def __init__(self, service: AgentRunnerService, listen: str) -> None:
        self._server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                ("grpc.so_reuseport", 0),
            ]
        )
        pb_grpc.add_AgentRunnerServicer_to_server(service, self._server)
        self.health = HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        reflection.enable_server_reflection(
            (
                SERVICE_NAME,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ),
            self._server,
        )
        self.port = self._server.add_insecure_port(listen)
        if self.port == 0:
            raise OSError(f"could not listen on {listen}")
        self._stopped = False

    async def start(self) -> None:
        await self._server.start()
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)

    async def not_serving(self) -> None:
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)

    async def stop(self, grace: float | None) -> None:
        if self._stopped:
            return
        self._stopped = True
        await self.not_serving()
        await self._server.stop(grace)

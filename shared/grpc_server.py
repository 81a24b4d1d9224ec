"""Common set-up of the services' gRPC servers: health, reflection, message limits."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

# Plans for large batches carry full token lists of new sequences; 64 MiB leaves room.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024

CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


def create_server() -> grpc.aio.Server:
    """An asyncio gRPC server with the project's message limits."""
    return grpc.aio.server(options=CHANNEL_OPTIONS)


def add_health_and_reflection(server: grpc.aio.Server, service_names: list[str]) -> health.aio.HealthServicer:
    """Registers grpc.health.v1 (all services SERVING) and server reflection."""
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    names = [*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME]
    reflection.enable_server_reflection(names, server)
    return servicer


async def mark_serving(servicer: health.aio.HealthServicer, service_names: list[str]) -> None:
    """Marks the overall server and each named service SERVING."""
    for name in ["", *service_names]:
        await servicer.set(name, health_pb2.HealthCheckResponse.SERVING)

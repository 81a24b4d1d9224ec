"""Common set-up of the services' gRPC servers: health, reflection, message limits, malformed requests."""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

# Plans for large batches carry full token lists of new sequences; 64 MiB leaves room.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# Largest request the public API reads: far more than any prompt within a context limit needs
# (1M token ids are ~5 MiB); a bigger message is refused by gRPC with RESOURCE_EXHAUSTED.
PUBLIC_MAX_REQUEST_BYTES = 16 * 1024 * 1024

CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


@dataclass(frozen=True)
class _Malformed:
    """Stands in for a request that did not parse, so that the RPC can end with INVALID_ARGUMENT."""

    reason: str


def _tolerant(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None

    def parse(data: bytes) -> Any:
        try:
            return deserializer(data)
        except DecodeError as exc:
            return _Malformed(str(exc))

    return parse


def _malformed_message(request: _Malformed) -> str:
    return (f"the request is not a valid protobuf message ({request.reason}); "
            "string fields must be valid UTF-8, send arbitrary bytes as token ids instead")


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    """A request that fails to parse (e.g. a string field with invalid UTF-8) gets INVALID_ARGUMENT.

    Without this, grpc's Python server answers UNKNOWN ("Unexpected DecodeError").
    Only RPCs with a single request message are covered (every RPC of this project).
    """

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming:
            return handler
        if handler.unary_unary is not None:
            behavior = handler.unary_unary

            async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                if isinstance(request, _Malformed):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _malformed_message(request))
                result = behavior(request, context)
                return await result if inspect.isawaitable(result) else result

            return handler._replace(unary_unary=unary, request_deserializer=_tolerant(handler.request_deserializer))
        if handler.unary_stream is not None:
            stream_behavior = handler.unary_stream

            async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                if isinstance(request, _Malformed):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _malformed_message(request))
                async for msg in stream_behavior(request, context):
                    yield msg

            return handler._replace(unary_stream=stream, request_deserializer=_tolerant(handler.request_deserializer))
        return handler


def create_server(max_receive_bytes: int = MAX_MESSAGE_BYTES, public: bool = False,
                  interceptors: Sequence[grpc.aio.ServerInterceptor] = ()) -> grpc.aio.Server:
    """An asyncio gRPC server with the project's message limits.

    public: the server faces clients, so a request that does not parse gets INVALID_ARGUMENT.
    interceptors: run first, in order (e.g. shared.auth.BearerTokenInterceptor: a refused call is
      never parsed).
    """
    options = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
               ("grpc.max_receive_message_length", max_receive_bytes)]
    chain = [*interceptors, *([MalformedRequestInterceptor()] if public else [])]
    return grpc.aio.server(options=options, interceptors=chain or None)


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

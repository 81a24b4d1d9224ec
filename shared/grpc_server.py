"""Common set-up of the services' gRPC servers: health, reflection, message limits, errors as statuses."""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import _async as reflection_aio
from grpc_reflection.v1alpha import reflection, reflection_pb2

from shared.errors import abort_with

# Plans for large batches carry full token lists of new sequences; 64 MiB leaves room.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# Largest request the public API reads: far more than any prompt within a context limit needs
# (1M token ids are ~5 MiB); a bigger message is refused by gRPC with RESOURCE_EXHAUSTED.
PUBLIC_MAX_REQUEST_BYTES = 16 * 1024 * 1024
# New calls the public server lets wait to be picked up before gRPC starts cancelling them (see create_server).
MAX_PENDING_CALLS = 1 << 16
# grpc.reflection.v1 (what current grpcurl and Postman ask first) has v1alpha's messages under a new package
# name; grpcio-reflection serves v1alpha only, so v1 is the same servicer under the v1 name.
REFLECTION_V1_SERVICE_NAME = "grpc.reflection.v1.ServerReflection"

CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]

# HTTP/2 keepalive between the public API and its clients. A replica (or a client) that vanishes without closing
# its connection (its node lost, a partition, a stopped process) sends no FIN or RST, and a server-streaming call
# sends nothing after its request: without pings the other end waited for the call's deadline, or for ever. A
# client's channel (llmserve/resume.py) pings an open call every CLIENT_KEEPALIVE_MS and breaks it (UNAVAILABLE,
# on which streams re-attach) when an ack takes longer than CLIENT_PING_TIMEOUT_MS; the public server accepts
# pings that often and pings its callers more gently (a caller gone for good has its request aborted). The
# engine loop's calls to workers keep gRPC's defaults: their deadlines (--step-timeout) find a silent worker, and
# a false alarm there would cost a reset.
CLIENT_KEEPALIVE_MS = 20_000
CLIENT_PING_TIMEOUT_MS = 10_000
_SERVER_KEEPALIVE_MS = 60_000
_SERVER_PING_TIMEOUT_MS = 20_000


def keepalive_options(every_ms: int, ack_within_ms: int) -> list[tuple[str, int]]:
    """Pings an open call every `every_ms`; no ack within `ack_within_ms` breaks its connection."""
    return [("grpc.keepalive_time_ms", every_ms), ("grpc.keepalive_timeout_ms", ack_within_ms),
            # gRPC 1.85 waits this long for any ping's ack (60 s by default), the keepalive's included.
            ("grpc.http2.ping_timeout_ms", ack_within_ms),
            # A queued request's stream carries no data for minutes: ping it all the same.
            ("grpc.http2.max_pings_without_data", 0)]


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


async def _statuses(messages: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
    """A streaming handler's messages; the exception that ends it becomes the call's status."""
    try:
        async for msg in messages:
            yield msg
    except grpc.aio.AbortError:
        raise  # the handler chose its status itself
    except Exception as exc:  # noqa: BLE001 - every error becomes a status, the server stays up
        await abort_with(context, exc)


class EdgeInterceptor(grpc.aio.ServerInterceptor):
    """Every RPC's edge: exceptions become statuses (shared.errors, in one place), bad bytes INVALID_ARGUMENT.

    A handler raises; this maps the exception to its status (status_for): the client's mistakes
    (InvalidRequestError, AlreadyExistsError, ...) get their codes, and anything else is INTERNAL,
    logged with its traceback. With `tolerate_malformed` (public servers), a request that fails to
    parse (e.g. a string field with invalid UTF-8) gets INVALID_ARGUMENT; grpc's Python server would
    answer UNKNOWN ("Unexpected DecodeError"). A stream of requests (the worker's StreamSteps, an
    internal API) gets its errors mapped, not that tolerance.
    """

    def __init__(self, tolerate_malformed: bool = False) -> None:
        self._tolerate_malformed = tolerate_malformed

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        if handler.stream_stream is not None:
            streams = handler.stream_stream

            async def bidi(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                async for msg in _statuses(streams(requests, context), context):
                    yield msg

            return handler._replace(stream_stream=bidi)
        if handler.request_streaming:
            return handler
        deserializer = _tolerant(handler.request_deserializer) if self._tolerate_malformed else handler.request_deserializer
        if handler.unary_unary is not None:
            behavior = handler.unary_unary

            async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                if isinstance(request, _Malformed):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _malformed_message(request))
                try:
                    result = behavior(request, context)
                    return await result if inspect.isawaitable(result) else result
                except grpc.aio.AbortError:
                    raise  # the handler chose its status itself
                except Exception as exc:  # noqa: BLE001 - every error becomes a status, the server stays up
                    await abort_with(context, exc)

            return handler._replace(unary_unary=unary, request_deserializer=deserializer)
        if handler.unary_stream is not None:
            stream_behavior = handler.unary_stream

            async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                if isinstance(request, _Malformed):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _malformed_message(request))
                async for msg in _statuses(stream_behavior(request, context), context):
                    yield msg

            return handler._replace(unary_stream=stream, request_deserializer=deserializer)
        return handler


def create_server(max_receive_bytes: int = MAX_MESSAGE_BYTES, public: bool = False,
                  interceptors: Sequence[grpc.aio.ServerInterceptor] = ()) -> grpc.aio.Server:
    """An asyncio gRPC server with the project's message limits.

    public: the server faces clients, so a request that does not parse gets INVALID_ARGUMENT.
    interceptors: run first, in order (e.g. shared.auth.BearerTokenInterceptor: a refused call is
      never parsed); the EdgeInterceptor, last, maps every handler's exceptions to statuses.
    """
    options = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
               ("grpc.max_receive_message_length", max_receive_bytes),
               # gRPC sets SO_REUSEPORT by default: a second worker (or scheduler) on a port already served would
               # bind it too, and the kernel would share the connections between two processes, two KV caches.
               ("grpc.so_reuseport", 0)]
    if public:
        options += [*keepalive_options(_SERVER_KEEPALIVE_MS, _SERVER_PING_TIMEOUT_MS),
                    # Clients' pings as often as ours: gRPC's default allows one in 5 minutes while the server
                    # sends nothing (a queued request, a long prefill) and answers the third one sooner with
                    # GOAWAY "too_many_pings", which broke such a stream after a minute. The name is the one gRPC
                    # reads (GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS); it ignores unknown names.
                    ("grpc.http2.min_ping_interval_without_data_ms", CLIENT_KEEPALIVE_MS // 2)]
        # gRPC cancels calls that wait to be picked up once more than 1,000 do (3,000 at once), as CANCELLED, which
        # a client reads as its own cancel: a burst of new streams (a 2,000-prompt batch through the HTTP front) lost
        # some. Admission control is the scheduler's own, with a status that says so (RESOURCE_EXHAUSTED,
        # --max-num-queued-requests); a waiting call costs a few KiB.
        options += [("grpc.server.max_pending_requests", MAX_PENDING_CALLS),
                    ("grpc.server.max_pending_requests_hard_limit", MAX_PENDING_CALLS)]
    return grpc.aio.server(options=options, interceptors=[*interceptors, EdgeInterceptor(tolerate_malformed=public)])


def add_health_and_reflection(server: grpc.aio.Server, service_names: list[str]) -> health.aio.HealthServicer:
    """Registers grpc.health.v1 (all services SERVING) and server reflection."""
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    names = [*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME, REFLECTION_V1_SERVICE_NAME]
    reflection.enable_server_reflection(names, server)
    v1 = grpc.stream_stream_rpc_method_handler(
        reflection_aio.ReflectionServicer(names).ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString)
    server.add_generic_rpc_handlers(
        [grpc.method_handlers_generic_handler(REFLECTION_V1_SERVICE_NAME, {"ServerReflectionInfo": v1})])
    return servicer


async def mark_serving(servicer: health.aio.HealthServicer, service_names: list[str]) -> None:
    """Marks the overall server and each named service SERVING."""
    for name in ["", *service_names]:
        await servicer.set(name, health_pb2.HealthCheckResponse.SERVING)

"""Bearer-token authentication of the public gRPC API: `authorization: Bearer <token>` metadata.

The server side is one interceptor that runs before any servicer. grpc.health.v1 stays open, so that
load balancers and Kubernetes probes need no secret; server reflection is behind the token like the
API itself (grpcurl: `-H "authorization: Bearer $TOKEN"`), since it is a tool for operators.
The token is compared in constant time and never echoed, logged or put in an error message.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from grpc_health.v1 import health

log = logging.getLogger(__name__)

METADATA_KEY = "authorization"
SCHEME = "bearer"
# Services anyone may call: liveness and readiness checks must work without the secret.
OPEN_SERVICES = frozenset({health.SERVICE_NAME})

MISSING_MESSAGE = ("missing bearer token: send the metadata 'authorization: Bearer <token>' "
                   "(llmserve clients: --auth-token-file or LLMSERVE_AUTH_TOKEN)")
INVALID_MESSAGE = "invalid bearer token"


def bearer_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """The call metadata that carries `token`."""
    return ((METADATA_KEY, f"Bearer {token}"),)


def parse_bearer(value: str) -> str | None:
    """The token of one `Bearer <token>` credential (scheme case-insensitive, RFC 6750), else None."""
    scheme, _, token = value.strip().partition(" ")
    return token.strip() if scheme.lower() == SCHEME and token.strip() else None


def presented_token(metadata: Any) -> str | None:
    """The token of the call's `authorization: Bearer <token>` metadata entry, else None."""
    for key, value in metadata or ():
        if key.lower() == METADATA_KEY and isinstance(value, str) and (token := parse_bearer(value)) is not None:
            return token
    return None


def _denying_handler(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that ends the call with `code` before reading anything."""

    async def unary_response(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(code, message)

    async def stream_response(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        await context.abort(code, message)
        yield  # pragma: no cover - makes this an async generator; abort raises first

    # No request deserializer: the request of an unauthenticated call is never parsed.
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(stream_response)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(unary_response)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(stream_response)
    return grpc.unary_unary_rpc_method_handler(unary_response)


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call without the right bearer token with UNAUTHENTICATED (open services excepted)."""

    def __init__(self, token: str, open_services: frozenset[str] = OPEN_SERVICES) -> None:
        if not token:
            raise ValueError("auth token must be a non-empty string, got ''")
        self._token = token.encode()
        self._open = open_services

    def __repr__(self) -> str:
        return "BearerTokenInterceptor(token=<redacted>)"

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        service = handler_call_details.method.lstrip("/").split("/")[0]
        if handler is None or service in self._open:
            return handler
        token = presented_token(handler_call_details.invocation_metadata)
        if token is not None and hmac.compare_digest(token.encode(), self._token):
            return handler
        message = MISSING_MESSAGE if token is None else INVALID_MESSAGE
        log.info("refused %s: %s", handler_call_details.method, message.split(":")[0])
        return _denying_handler(handler, grpc.StatusCode.UNAUTHENTICATED, message)


# --- client side -------------------------------------------------------------------------------------------


def _with_token(details: grpc.aio.ClientCallDetails, token: str) -> grpc.aio.ClientCallDetails:
    """Call details of the asyncio API (a namedtuple) with the token's metadata replacing any other."""
    metadata = [m for m in (details.metadata or ()) if m[0].lower() != METADATA_KEY]
    return details._replace(metadata=grpc.aio.Metadata(*metadata, *bearer_metadata(token)))


class _SyncToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                 grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    def __init__(self, token: str) -> None:
        self._token = token

    def __repr__(self) -> str:
        return "BearerToken(<redacted>)"

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(_SyncDetails.of(details, self._token), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(_SyncDetails.of(details, self._token), request)

    def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(_SyncDetails.of(details, self._token), requests)

    def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(_SyncDetails.of(details, self._token), requests)


class _SyncDetails(grpc.ClientCallDetails):
    """grpc.ClientCallDetails is not a namedtuple in the synchronous API; this one carries the token."""

    def __init__(self, method: Any, timeout: Any, metadata: Any, credentials: Any, wait_for_ready: Any,
                 compression: Any) -> None:
        self.method, self.timeout, self.metadata = method, timeout, metadata
        self.credentials, self.wait_for_ready, self.compression = credentials, wait_for_ready, compression

    @classmethod
    def of(cls, details: Any, token: str) -> "_SyncDetails":
        metadata = [m for m in (details.metadata or ()) if m[0].lower() != METADATA_KEY]
        return cls(details.method, details.timeout, [*metadata, *bearer_metadata(token)], details.credentials,
                   getattr(details, "wait_for_ready", None), getattr(details, "compression", None))


class _AioTokenUnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, token: str) -> None:
        self._token = token

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(_with_token(details, self._token), request)


class _AioTokenUnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, token: str) -> None:
        self._token = token

    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(_with_token(details, self._token), request)


def token_interceptors(token: str, *, aio: bool) -> list[Any]:
    """Client interceptors that add the bearer token to every call (none for an empty token).

    Interceptors rather than call credentials: gRPC sends call credentials only over TLS, and a token
    on a plaintext localhost channel is still useful (tests, a mesh that terminates TLS).
    """
    if not token:
        return []
    if aio:
        return [_AioTokenUnaryUnary(token), _AioTokenUnaryStream(token)]
    return [_SyncToken(token)]

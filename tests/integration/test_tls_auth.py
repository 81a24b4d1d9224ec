"""The TLS and bearer-token code paths on a real in-process gRPC server (no model, no Redis).

Every service binds through shared.tls.bind and every client dials through shared.tls.open_channel,
so what holds here holds for the scheduler, the workers and the clients; tests/e2e/test_security.py
runs the whole cluster.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from shared import grpc_server
from shared.auth import INVALID_MESSAGE, MISSING_MESSAGE, BearerTokenInterceptor, token_interceptors
from shared.tls import ClientTLS, ServerTLS, bind, open_channel
from tests.certs import CA, make_ca

TOKEN = "tok-3b9e5d1c"
SERVICE = "llmserve.test.Echo"


def _echo_handlers() -> grpc.GenericRpcHandler:
    async def unary(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return request

    async def stream(request: bytes, context: grpc.aio.ServicerContext) -> Any:
        for _ in range(2):
            yield request

    return grpc.method_handlers_generic_handler(SERVICE, {
        "Unary": grpc.unary_unary_rpc_method_handler(unary),
        "Stream": grpc.unary_stream_rpc_method_handler(stream),
    })


async def _with_server(tls: ServerTLS | None, token: str, body: Callable[[str], Awaitable[None]]) -> None:
    interceptors = [BearerTokenInterceptor(token)] if token else []
    server = grpc.aio.server(interceptors=interceptors)
    server.add_generic_rpc_handlers([_echo_handlers()])
    health = grpc_server.add_health_and_reflection(server, [SERVICE])
    port = bind(server, "127.0.0.1", 0, tls, "test server")
    await server.start()
    await grpc_server.mark_serving(health, [SERVICE])
    try:
        await body(f"localhost:{port}")
    finally:
        await server.stop(grace=None)


async def _call(address: str, tls: ClientTLS | None = None, token: str = "", streaming: bool = False) -> bytes:
    async with open_channel(address, tls, aio=True, interceptors=token_interceptors(token, aio=True)) as channel:
        if streaming:
            call = channel.unary_stream(f"/{SERVICE}/Stream")(b"hi", timeout=5)
            return b"".join([m async for m in call])
        return await channel.unary_unary(f"/{SERVICE}/Unary")(b"hi", timeout=5)


async def _code(call: Awaitable[Any]) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    return info.value.code(), info.value.details() or ""


@pytest.fixture(scope="module")
def cas(tmp_path_factory: pytest.TempPathFactory) -> tuple[CA, CA]:
    root = tmp_path_factory.mktemp("pki")
    return make_ca(root, "trusted"), make_ca(root, "rogue")


def test_bearer_token_is_required_except_for_health() -> None:
    async def body(address: str) -> None:
        assert await _call(address, token=TOKEN) == b"hi"
        assert await _call(address, token=TOKEN, streaming=True) == b"hihi"
        assert await _code(_call(address)) == (grpc.StatusCode.UNAUTHENTICATED, MISSING_MESSAGE)
        assert await _code(_call(address, streaming=True)) == (grpc.StatusCode.UNAUTHENTICATED, MISSING_MESSAGE)
        code, details = await _code(_call(address, token="wrong"))
        assert (code, details) == (grpc.StatusCode.UNAUTHENTICATED, INVALID_MESSAGE)
        assert "wrong" not in details
        async with open_channel(address, aio=True) as channel:
            # Probes and load balancers carry no secret.
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            # Reflection is an operator's tool: behind the token like the API.
            stream = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
            assert await _code(stream.read()) == (grpc.StatusCode.UNAUTHENTICATED, MISSING_MESSAGE)

    asyncio.run(_with_server(None, TOKEN, body))


def test_tls_server_refuses_plaintext_and_untrusted_clients(cas: tuple[CA, CA]) -> None:
    trusted, rogue = cas
    server_files = trusted.issue("server")

    async def body(address: str) -> None:
        assert await _call(address, ClientTLS(str(trusted.cert)), TOKEN) == b"hi"
        code, _ = await _code(_call(address, token=TOKEN))  # plaintext to a TLS port
        assert code == grpc.StatusCode.UNAVAILABLE
        code, _ = await _code(_call(address, ClientTLS(str(rogue.cert)), TOKEN))  # server not trusted
        assert code == grpc.StatusCode.UNAVAILABLE
        assert await _code(_call(address, ClientTLS(str(trusted.cert)))) == (
            grpc.StatusCode.UNAUTHENTICATED, MISSING_MESSAGE)

    asyncio.run(_with_server(ServerTLS(str(server_files.cert), str(server_files.key)), TOKEN, body))


def test_mutual_tls_admits_only_clients_with_a_trusted_certificate(cas: tuple[CA, CA]) -> None:
    trusted, rogue = cas
    server_files = trusted.issue("worker")
    good, bad = trusted.issue("scheduler", client=True), rogue.issue("intruder", client=True)

    async def body(address: str) -> None:
        ok = ClientTLS(str(trusted.cert), str(good.cert), str(good.key))
        assert await _call(address, ok) == b"hi"
        for tls in (ClientTLS(str(trusted.cert)),  # no client certificate
                    ClientTLS(str(trusted.cert), str(bad.cert), str(bad.key))):  # one from another CA
            code, _ = await _code(_call(address, tls))
            assert code == grpc.StatusCode.UNAVAILABLE, tls

    tls = ServerTLS(str(server_files.cert), str(server_files.key), str(trusted.cert))
    asyncio.run(_with_server(tls, "", body))


def test_sync_client_sends_the_token(cas: tuple[CA, CA], tmp_path: Path) -> None:
    trusted, _ = cas
    server_files = trusted.issue("sync")

    async def body(address: str) -> None:
        def call(token: str) -> bytes:
            with open_channel(address, ClientTLS(str(trusted.cert)),
                              interceptors=token_interceptors(token, aio=False)) as channel:
                return channel.unary_stream(f"/{SERVICE}/Stream")(b"ok", timeout=5).__iter__().__next__()

        assert await asyncio.to_thread(call, TOKEN) == b"ok"
        with pytest.raises(grpc.RpcError) as info:
            await asyncio.to_thread(call, "")
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED  # type: ignore[attr-defined]

    asyncio.run(_with_server(ServerTLS(str(server_files.cert), str(server_files.key)), TOKEN, body))

"""Every service's RPC edge (shared.grpc_server.EdgeInterceptor) over a real gRPC server on localhost.

Handlers raise; the client sees the status that the exception means: the client's own mistakes get
their codes, a broken invariant (any other exception, a bare ValueError included) is INTERNAL and is
logged with its traceback, and the server serves the next call.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import grpc
import pytest

from protos import generation_pb2
from shared import grpc_server
from shared.errors import AlreadyExistsError, InvalidRequestError, UnavailableError

SERVICE = "llmserve.test.Edge"
_REQUEST = generation_pb2.TokenizeRequest
_RESPONSE = generation_pb2.TokenizeResponse


async def _unary(request: generation_pb2.TokenizeRequest, context: grpc.aio.ServicerContext
                 ) -> generation_pb2.TokenizeResponse:
    errors = {"bad input": InvalidRequestError("the prompt is empty"), "taken": AlreadyExistsError("id in use"),
              "redis": UnavailableError("the state store is unavailable"), "bug": ValueError("table is shorter")}
    if request.prompt in errors:
        raise errors[request.prompt]
    if request.prompt == "chosen":
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, "the handler's own status")
    return generation_pb2.TokenizeResponse(token_ids=[len(request.prompt)])


async def _stream(request: generation_pb2.TokenizeRequest, context: grpc.aio.ServicerContext
                  ) -> AsyncIterator[generation_pb2.TokenizeResponse]:
    yield generation_pb2.TokenizeResponse(token_ids=[1])
    raise KeyError(request.prompt)


@asynccontextmanager
async def _serving(handlers: dict[str, grpc.RpcMethodHandler], public: bool = True) -> AsyncIterator[int]:
    """A server of create_server's with `handlers` under SERVICE, on localhost; yields its port."""
    server = grpc_server.create_server(public=public)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, handlers)])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield port
    finally:
        await server.stop(None)


async def _call_all(public: bool) -> dict[str, object]:
    seen: dict[str, object] = {}
    async with _serving({
        "Unary": grpc.unary_unary_rpc_method_handler(_unary, _REQUEST.FromString, _RESPONSE.SerializeToString),
        "Stream": grpc.unary_stream_rpc_method_handler(_stream, _REQUEST.FromString, _RESPONSE.SerializeToString),
    }, public=public) as port:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            unary = channel.unary_unary(f"/{SERVICE}/Unary", _REQUEST.SerializeToString, _RESPONSE.FromString)
            raw = channel.unary_unary(f"/{SERVICE}/Unary", lambda b: b, _RESPONSE.FromString)
            stream = channel.unary_stream(f"/{SERVICE}/Stream", _REQUEST.SerializeToString, _RESPONSE.FromString)
            for prompt in ("bad input", "taken", "redis", "bug", "chosen"):
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await unary(_REQUEST(prompt=prompt), timeout=10)
                seen[prompt] = (info.value.code(), info.value.details())
            seen["ok"] = list((await unary(_REQUEST(prompt="fine"), timeout=10)).token_ids)
            received = []
            with pytest.raises(grpc.aio.AioRpcError) as info:
                async for msg in stream(_REQUEST(prompt="k"), timeout=10):
                    received.append(list(msg.token_ids))
            seen["stream"] = (received, info.value.code())
            # A string field holding invalid UTF-8 (field 1, length 1, byte 0xff).
            try:
                seen["malformed"] = (await raw(b"\x0a\x01\xff", timeout=10)).token_ids
            except grpc.aio.AioRpcError as exc:
                seen["malformed"] = exc.code()
    return seen


def test_exceptions_become_statuses_and_only_client_mistakes_are_invalid_argument(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR, logger="shared.errors"):
        seen = asyncio.run(_call_all(public=True))
    assert seen["bad input"] == (grpc.StatusCode.INVALID_ARGUMENT, "the prompt is empty")
    assert seen["taken"] == (grpc.StatusCode.ALREADY_EXISTS, "id in use")
    assert seen["redis"] == (grpc.StatusCode.UNAVAILABLE, "the state store is unavailable")
    assert seen["bug"] == (grpc.StatusCode.INTERNAL, "internal error: ValueError: table is shorter")
    assert seen["chosen"] == (grpc.StatusCode.PERMISSION_DENIED, "the handler's own status")
    assert seen["ok"] == [4]
    assert seen["stream"] == ([[1]], grpc.StatusCode.INTERNAL)
    assert seen["malformed"] == grpc.StatusCode.INVALID_ARGUMENT
    # The two broken invariants, each logged once with its traceback; the client errors are not logged.
    logged = [r for r in caplog.records if r.exc_info]
    assert [type(r.exc_info[1]).__name__ for r in logged] == ["ValueError", "KeyError"]


def test_an_internal_server_answers_unknown_bytes_as_grpc_does() -> None:
    seen = asyncio.run(_call_all(public=False))
    assert seen["bug"][0] == grpc.StatusCode.INTERNAL and seen["bad input"][0] == grpc.StatusCode.INVALID_ARGUMENT
    # Without tolerance the parse error is grpc's own (UNKNOWN or INTERNAL): not the client's INVALID_ARGUMENT.
    assert seen["malformed"] != grpc.StatusCode.INVALID_ARGUMENT


def test_a_burst_of_new_streams_is_served_whole() -> None:
    # gRPC's default cancelled the calls of a burst past ~1,000 waiting ones (CANCELLED, read as the client's own).
    async def handler(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        await asyncio.sleep(0.5)  # every call of the burst is open at once
        yield request

    async def go() -> list[str]:
        async with _serving({"Burst": grpc.unary_stream_rpc_method_handler(handler)}) as port:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                call = channel.unary_stream(f"/{SERVICE}/Burst")

                async def one() -> str:
                    try:
                        return "ok" if [m async for m in call(b"x", timeout=300)] == [b"x"] else "short"
                    except grpc.aio.AioRpcError as exc:
                        return exc.code().name

                return await asyncio.gather(*[one() for _ in range(3000)])

    outcomes = asyncio.run(go())
    assert outcomes.count("ok") == 3000, {o: outcomes.count(o) for o in set(outcomes)}


def test_a_stream_that_sends_nothing_for_a_while_keeps_its_pinging_client(monkeypatch: pytest.MonkeyPatch) -> None:
    # A resuming client pings an open call every CLIENT_KEEPALIVE_MS (llmserve/resume.py) also while the server
    # sends nothing (a queued request); gRPC's default policy allows one such ping in 5 minutes and sent GOAWAY
    # "too_many_pings" on the third, breaking the stream. Both intervals scaled down 50x: ~9 pings in the silence.
    every_ms = grpc_server.CLIENT_KEEPALIVE_MS // 50
    monkeypatch.setattr(grpc_server, "CLIENT_KEEPALIVE_MS", every_ms)
    silence_s = 9 * every_ms / 1000

    async def handler(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        yield b"first"
        await asyncio.sleep(silence_s)
        yield b"second"

    async def go() -> list[bytes] | str:
        options = grpc_server.keepalive_options(every_ms, grpc_server.CLIENT_PING_TIMEOUT_MS)
        async with _serving({"Quiet": grpc.unary_stream_rpc_method_handler(handler)}) as port:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
                try:
                    return [m async for m in channel.unary_stream(f"/{SERVICE}/Quiet")(b"x", timeout=60)]
                except grpc.aio.AioRpcError as exc:
                    return f"{exc.code().name}: {exc.details()}"

    assert asyncio.run(go()) == [b"first", b"second"]

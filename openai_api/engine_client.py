"""The front's connection to the scheduler's public gRPC API.

A stream is opened by reading its first message before any HTTP status is sent: admission errors
(INVALID_ARGUMENT, RESOURCE_EXHAUSTED, UNAVAILABLE) then become proper 400 / 429 / 503 answers
instead of an error in the middle of a 200 event stream. Cancelling a stream cancels its gRPC
call, which makes the scheduler abort the request and free its blocks.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from openai_api.errors import OpenAIError, from_rpc_error
from protos import generation_pb2, generation_pb2_grpc
from shared.auth import token_interceptors
from shared.tls import ClientTLS, open_channel

Metadata = tuple[tuple[str, str], ...]
# Deadline of Tokenize and Detokenize (a long prompt tokenizes in milliseconds).
UNARY_TIMEOUT_S = 30.0


class GenerationStream:
    """The responses of one Generate call, its first already received."""

    def __init__(self, call: grpc.aio.UnaryStreamCall, first: generation_pb2.GenerateResponse) -> None:
        self._call = call
        # The stream's first message, kept after it was yielded: it carries the prompt's token ids and
        # prompt logprobs (generation.proto), which responses report before any output.
        self.first = first
        self._first: generation_pb2.GenerateResponse | None = first

    async def __aiter__(self) -> AsyncIterator[generation_pb2.GenerateResponse]:
        """Yields every response; a broken call raises OpenAIError (e.g. 503 when the scheduler went away)."""
        try:
            if self._first is not None:
                first, self._first = self._first, None
                yield first
                if first.HasField("usage"):
                    return
            while True:
                msg = await self._call.read()
                if msg is grpc.aio.EOF:
                    return
                yield msg
                if msg.HasField("usage"):
                    return
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc) from exc
        finally:
            self.cancel()

    def cancel(self) -> None:
        """Ends the call (a no-op when it has finished); the scheduler aborts an unfinished request."""
        self._call.cancel()


class EngineClient:
    """An asyncio gRPC channel to one scheduler address (a load balancer or a replica).

    tls: verify the scheduler's certificate; token: bearer token sent with every call.
    """

    def __init__(self, address: str, tls: ClientTLS | None = None, token: str = "") -> None:
        self.address = address
        self._channel = open_channel(address, tls, aio=True, interceptors=token_interceptors(token, aio=True))
        self._stub = generation_pb2_grpc.GenerationStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    async def max_model_len(self) -> int | None:
        """The scheduler's context limit (ModelInfo), or None when it does not answer within a second."""
        try:
            info = await self._stub.ModelInfo(generation_pb2.ModelInfoRequest(), timeout=1.0)
        except grpc.aio.AioRpcError:
            return None
        return info.max_model_len

    async def open(self, request: generation_pb2.GenerateRequest, metadata: Metadata = ()) -> GenerationStream:
        """Starts a Generate call and waits for its first response; raises OpenAIError on failure.

        metadata: sent with the call (the HTTP caller's W3C trace context). No wait_for_ready: with the
        scheduler down the caller gets a 503 at once, not a hang.
        """
        call = self._stub.Generate(request, metadata=metadata)
        try:
            first = await call.read()
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc) from exc
        except BaseException:
            call.cancel()
            raise
        if first is grpc.aio.EOF:
            raise OpenAIError(502, "the scheduler ended the stream without a response", "server_error")
        return GenerationStream(call, first)

    async def open_all(self, requests: list[generation_pb2.GenerateRequest], metadata: Metadata = ()
                       ) -> list[GenerationStream]:
        """Opens one stream per request concurrently; if any fails, the others are cancelled."""
        tasks = [asyncio.ensure_future(self.open(r, metadata)) for r in requests]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for task in tasks:
                if task.done() and not task.cancelled() and task.exception() is None:
                    task.result().cancel()
                else:
                    task.cancel()
            raise

    async def tokenize(self, request: generation_pb2.TokenizeRequest) -> generation_pb2.TokenizeResponse:
        """The scheduler's tokens for a prompt or messages, exactly as Generate computes them."""
        try:
            return await self._stub.Tokenize(request, timeout=UNARY_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc) from exc

    async def detokenize(self, token_ids: list[int]) -> str:
        """The scheduler's tokenizer's text for token ids."""
        try:
            reply = await self._stub.Detokenize(generation_pb2.DetokenizeRequest(token_ids=token_ids),
                                                timeout=UNARY_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc) from exc
        return reply.text

    async def healthy(self, timeout_s: float = 2.0) -> bool:
        """Whether the scheduler reports SERVING on grpc.health.v1."""
        try:
            reply = await self._health.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
        except grpc.aio.AioRpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    async def close(self) -> None:
        await self._channel.close()

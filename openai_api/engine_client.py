"""The front's connection to the scheduler's public gRPC API.

A stream is opened by reading its first message before any HTTP status is sent: admission errors
(INVALID_ARGUMENT, RESOURCE_EXHAUSTED, UNAVAILABLE) then become proper 400 / 429 / 503 answers
instead of an error in the middle of a 200 event stream. Cancelling a stream cancels its gRPC
call, which makes the scheduler abort the request and free its blocks.

A stream whose call breaks with UNAVAILABLE after it started (the scheduler replica died, or its
connection dropped) re-attaches with Resume(request_id, from_index) on the channel, which reconnects
to the address again (a load balancer, a restarted replica, or the next of an `ipv4:a,b` list), as
the Python client does (llmserve/resume.py): the HTTP caller's stream goes on without a message lost
or repeated. The request keeps running meanwhile: only the call that admitted it could abort it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmserve.resume import RECONNECT_OPTIONS, ResumePolicy
from openai_api.errors import OpenAIError, from_rpc_error
from protos import generation_pb2, generation_pb2_grpc
from shared.auth import token_interceptors
from shared.grpc_server import CHANNEL_OPTIONS
from shared.tls import ClientTLS, open_channel

log = logging.getLogger(__name__)

Metadata = tuple[tuple[str, str], ...]
# Deadline of Tokenize and Detokenize (a long prompt tokenizes in milliseconds).
UNARY_TIMEOUT_S = 30.0
# Re-attaching a broken stream: backoffs from 0.1 s to 2 s, and at most a minute without a message.
RESUME_POLICY = ResumePolicy()
# Aborts sent for streams cancelled after a re-attachment, kept until they finish (asyncio holds tasks weakly).
_ABORTS: set[asyncio.Task[None]] = set()


class GenerationStream:
    """The responses of one Generate call, its first already received; re-attached after UNAVAILABLE."""

    def __init__(self, stub: generation_pb2_grpc.GenerationStub, request_id: str, call: grpc.aio.UnaryStreamCall,
                 first: generation_pb2.GenerateResponse, policy: ResumePolicy = RESUME_POLICY) -> None:
        self._stub, self._request_id, self._call, self._policy = stub, request_id, call, policy
        # The stream's first message, kept after it was yielded: it carries the prompt's token ids and
        # prompt logprobs (generation.proto), which responses report before any output.
        self.first = first
        self._first: generation_pb2.GenerateResponse | None = first
        self._next_index = first.index + 1
        self._finished = first.HasField("usage")
        self._resumed = self._cancelled = False
        # Since when the stream has been broken (loop time; None while it flows), and the re-attachments since.
        self._broken_since: float | None = None
        self._failures = 0

    async def __aiter__(self) -> AsyncIterator[generation_pb2.GenerateResponse]:
        """Yields every response once; a call that cannot be re-attached raises OpenAIError (e.g. 503)."""
        try:
            if self._first is not None:
                first, self._first = self._first, None
                yield first
                if self._finished:
                    return
            while True:
                try:
                    msg = await self._call.read()
                except grpc.aio.AioRpcError as exc:
                    if exc.code() != grpc.StatusCode.UNAVAILABLE or self._cancelled:
                        raise
                    await self._reattach(exc)
                    continue
                if msg is grpc.aio.EOF:
                    return
                if self._broken_since is not None:
                    log.info("stream of %s re-attached at message %d", self._request_id, self._next_index)
                    self._broken_since, self._failures = None, 0
                if msg.index < self._next_index:
                    continue  # sent again by the call it re-attached to (Resume starts at next_index: not expected)
                self._next_index = msg.index + 1
                self._finished = msg.HasField("usage")
                yield msg
                if self._finished:
                    return
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc) from exc
        finally:
            self.cancel()

    async def _reattach(self, cause: grpc.aio.AioRpcError) -> None:
        """Waits a backoff, then opens Resume(request_id, next_index); the reads tell whether it answered.

        Gives up (raises the break) once the policy's wait has passed without a message since the break.
        """
        # The call that admitted the request is gone: from now on, leaving the stream must abort the request.
        self._resumed = True
        now = asyncio.get_running_loop().time()
        if self._broken_since is None:
            self._broken_since = now
            log.warning("stream of %s broke at message %d (%s); re-attaching", self._request_id, self._next_index,
                        cause.code().name)
        delay = self._policy.backoff_s(self._failures)
        if now + delay >= self._broken_since + self._policy.max_wait_s:
            raise cause
        await asyncio.sleep(delay)
        self._failures += 1
        resume = generation_pb2.ResumeRequest(request_id=self._request_id, from_index=self._next_index)
        # wait_for_ready=False: while no scheduler answers the call fails at once, and the next read waits again.
        self._call = self._stub.Resume(resume, wait_for_ready=False)

    def cancel(self) -> None:
        """Ends the call (a no-op when it has finished); the scheduler aborts an unfinished request.

        After a re-attachment the call that admitted the request is gone, so the abort is asked for.
        """
        if self._cancelled:
            return
        self._cancelled = True
        self._call.cancel()
        if self._resumed and not self._finished:
            abort = asyncio.ensure_future(self._abort())
            _ABORTS.add(abort)
            abort.add_done_callback(_ABORTS.discard)

    async def _abort(self) -> None:
        try:
            await self._stub.Abort(generation_pb2.AbortRequest(request_id=self._request_id), timeout=UNARY_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            # Best effort: the request may have just finished, or no scheduler answers.
            log.info("abort of %s after a re-attachment: %s", self._request_id, exc.code().name)


class EngineClient:
    """An asyncio gRPC channel to one scheduler address (a load balancer or a replica).

    tls: verify the scheduler's certificate; token: bearer token sent with every call.
    """

    def __init__(self, address: str, tls: ClientTLS | None = None, token: str = "") -> None:
        self.address = address
        self._channel = open_channel(address, tls, aio=True, interceptors=token_interceptors(token, aio=True),
                                     options=[*CHANNEL_OPTIONS, *RECONNECT_OPTIONS])
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
        return GenerationStream(self._stub, request.request_id, call, first)

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

"""The public Generation servicer: admit, queue in Redis, stream committed outputs (and resume them)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import grpc
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from protos import generation_pb2, generation_pb2_grpc, state_pb2
from scheduler_service.admission import Admission, AdmittedPrompt, to_record
from scheduler_service.router import Router
from scheduler_service.output_reader import check_resumable, follow
from scheduler_service.stream_mux import StreamMux
from scheduler_service.store import AdmitOutcome, QueueLimits, RedisStore, WorkerGoneError
from shared.errors import NotFoundError, UnavailableError, status_for
from shared.tracing import context_from_metadata, to_traceparent

log = logging.getLogger(__name__)

# How long one blocking read of the output stream waits before checking the call is alive.
READ_BLOCK_MS = 5000


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    """Thin: protobuf in, domain calls, protobuf out; errors mapped in one place."""

    def __init__(self, admission: Admission, store: RedisStore, router: Router, tracer: trace.Tracer,
                 model_name: str, queue_limits: QueueLimits) -> None:
        self._admission = admission
        self._queue_limits = queue_limits
        self._store = store
        # One XREAD for every stream this replica's clients read (stream_mux.py).
        self._streams = StreamMux(store)
        self._router = router
        # Set when the replica shuts down: the calls its server then ends were not left by their clients.
        self._stopping = False
        self._tracer = tracer
        self._model_name = model_name

    async def Generate(
        self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        span = self._start_span("llmserve.generate", context)
        started = time.time()
        try:
            try:
                # Tokenizing can take milliseconds for long prompts: keep it off the event loop.
                admitted = await asyncio.to_thread(self._admission.admit, request)
                self._describe(span, admitted)
                seq_ids = await self._store.reserve_seq_ids(admitted.sampling.num_sequences)
                record = to_record(admitted, seq_ids, "", time.time())  # its worker: chosen by _queue
                record.traceparent = to_traceparent(span)
                outcome = await self._queue(record, admitted.digest)
            except Exception as exc:
                span.set_status(Status(StatusCode.ERROR, f"{status_for(exc).name}: {exc}"))
                raise  # the status: shared.grpc_server.EdgeInterceptor
            request_id = admitted.request_id
            # Only the call that admitted the request owns it: its stream breaking aborts the request, unless the
            # client asked to be able to re-attach. A re-sent request only reads the original's stream.
            owner = outcome is AdmitOutcome.ADMITTED and not request.resumable
            span.set_attribute("llmserve.attached", outcome is AdmitOutcome.ATTACHED)
            finished = first_token = False
            try:
                async for msg in follow(self._store, request_id, 0, READ_BLOCK_MS, self._streams.read_from):
                    if not first_token and any(d.token_ids for d in msg.outputs):
                        first_token = True
                        span.set_attribute("gen_ai.latency.time_to_first_token", time.time() - started)
                    if msg.HasField("usage"):
                        self._finish(span, msg, started)
                        finished = True
                    yield msg
            except (UnavailableError, NotFoundError) as exc:
                # The break is on this side (Redis away): the request goes on, and its client may resume it.
                owner = False
                span.set_status(Status(StatusCode.ERROR, str(exc)))
                raise
            finally:
                if not finished and owner and not self._stopping:
                    span.set_attribute("llmserve.cancelled", True)
                    # The client went away (or the stream broke): free the request's blocks.
                    await asyncio.shield(self._abort_quietly(request_id))
        finally:
            span.end()

    async def _queue(self, record: state_pb2.AdmittedRequest, digest: str) -> AdmitOutcome:
        """Routes the request and admits it to the chosen worker (`record.worker_id` is set to it).

        The router sees the workers as of the supervisor's last tick: a worker that left since then is
        refused by the admission itself, and the request goes to another one.
        """
        gone: set[str] = set()
        while True:
            record.worker_id = await self._router.pick(record.request_id, record.prompt_token_ids, exclude=gone)
            try:
                return await self._store.admit(record, self._queue_limits, digest, require_alive=True)
            except WorkerGoneError:
                log.info("worker %s left; routing request %s to another worker", record.worker_id, record.request_id)
                gone.add(record.worker_id)

    async def Resume(
        self, request: generation_pb2.ResumeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        span = self._start_span("llmserve.resume", context)
        span.set_attributes({"gen_ai.request.id": request.request_id, "llmserve.resume.from_index": request.from_index})
        # A resumed stream never aborts the request when it ends early: the client may come back again.
        try:
            await check_resumable(self._store, request.request_id, request.from_index)
            async for msg in follow(self._store, request.request_id, request.from_index, READ_BLOCK_MS,
                                  self._streams.read_from):
                yield msg
        except Exception as exc:
            span.set_status(Status(StatusCode.ERROR, f"{status_for(exc).name}: {exc}"))
            raise
        finally:
            span.end()

    def _start_span(self, name: str, context: grpc.aio.ServicerContext) -> trace.Span:
        """One SERVER span per call; a caller's traceparent makes it part of the caller's trace."""
        return self._tracer.start_span(name, context=context_from_metadata(context.invocation_metadata()),
                                       kind=SpanKind.SERVER)

    @staticmethod
    def _finish(span: trace.Span, msg: generation_pb2.GenerateResponse, started: float) -> None:
        span.set_attributes({
            "gen_ai.usage.prompt_tokens": msg.usage.prompt_tokens,
            "gen_ai.usage.completion_tokens": msg.usage.completion_tokens,
            "gen_ai.latency.e2e": time.time() - started,
        })
        if msg.error:
            span.set_status(Status(StatusCode.ERROR, msg.error))

    def _describe(self, span: trace.Span, admitted: AdmittedPrompt) -> None:
        """The request's gen_ai.* attributes (OpenTelemetry's GenAI conventions, as vLLM sets them)."""
        if not span.is_recording():
            return
        params = admitted.sampling
        span.set_attributes({
            "gen_ai.request.id": admitted.request_id,
            "gen_ai.request.model": self._model_name,
            "gen_ai.request.max_tokens": params.max_tokens or 0,
            "gen_ai.request.temperature": params.temperature,
            "gen_ai.request.top_p": params.top_p,
            "gen_ai.request.n": params.n,
            "gen_ai.usage.prompt_tokens": len(admitted.prompt_token_ids),
        })

    async def Abort(self, request: generation_pb2.AbortRequest, context: grpc.aio.ServicerContext) -> generation_pb2.AbortResponse:
        if not await self._store.route_aborts([request.request_id]):
            raise NotFoundError(f"no live request has id {request.request_id!r}")
        return generation_pb2.AbortResponse()

    async def ModelInfo(self, request: generation_pb2.ModelInfoRequest,
                        context: grpc.aio.ServicerContext) -> generation_pb2.ModelInfoResponse:
        admission = self._admission
        return generation_pb2.ModelInfoResponse(
            model=self._model_name, max_model_len=admission.limits.max_model_len,
            vocab_size=admission.limits.vocab_size, has_chat_template=admission.has_chat_template,
            num_workers=self._router.num_workers, eos_token_id=admission.eos_token_id,  # None leaves it unset
        )

    async def Tokenize(self, request: generation_pb2.TokenizeRequest,
                       context: grpc.aio.ServicerContext) -> generation_pb2.TokenizeResponse:
        ids, tokens = await asyncio.to_thread(self._admission.tokenize, request)
        return generation_pb2.TokenizeResponse(token_ids=ids, tokens=tokens)

    async def Detokenize(self, request: generation_pb2.DetokenizeRequest,
                         context: grpc.aio.ServicerContext) -> generation_pb2.DetokenizeResponse:
        text = await asyncio.to_thread(self._admission.detokenize, list(request.token_ids))
        return generation_pb2.DetokenizeResponse(text=text)

    def stop_owning(self) -> None:
        """The replica is going away (SIGTERM, a rolling update): the streams its server ends from now on leave
        their requests running, since their clients did not leave. They get UNAVAILABLE and re-attach on another
        replica (llmserve/resume.py, the OpenAI front), while the engine loop that takes the worker over
        continues the requests."""
        self._stopping = True

    async def _abort_quietly(self, request_id: str) -> None:
        try:
            await self._store.route_aborts([request_id])
        except UnavailableError:
            log.warning("could not queue the abort of %s", request_id)

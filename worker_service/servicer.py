"""The worker's gRPC servicer: protobuf at the edge, fencing, one step at a time."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from itertools import repeat

import grpc
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from protos import worker_pb2, worker_pb2_grpc
from shared.errors import InvalidRequestError, StaleEpochError, status_for
from shared.metrics import WorkerMetrics
from shared.tracing import context_from_metadata
from worker_service.model_runner import ExecutedStepData, ModelRunner, StepOutput
from worker_service.sequence_cache import NOT_CACHED
from worker_service.model_thread import ModelThread
from shared.liveness import Activity
from worker_service.plan import StepPlanData, plan_from_proto

log = logging.getLogger(__name__)


@dataclass
class _Call:
    """A call of the step stream: its plans, its span, and the steps running them (or waiting for their turn)."""

    plans: list[worker_pb2.StepPlan]
    span: trace.Span
    steps: asyncio.Task[list[StepOutput]]

    def abandon(self) -> None:
        """No one will answer the call: its steps run to their end, and a failure of theirs is only logged."""
        self.steps.add_done_callback(self._ended_unanswered)

    def _ended_unanswered(self, steps: asyncio.Task[list[StepOutput]]) -> None:
        if not steps.cancelled() and steps.exception() is not None:
            log.warning("a step whose caller had gone failed: %s", steps.exception())
            self.span.set_status(Status(StatusCode.ERROR, str(steps.exception())))
        self.span.end()


def step_result(out: StepOutput, result: worker_pb2.StepResult | None = None) -> worker_pb2.StepResult:
    """The wire form of a step's output, written into `result` (a field of the message that carries it) or a new one.

    Built in place with `add()`: constructing each sub-message and then the repeated field
    from a list copies every message once more, 3x the cost at batch 64 (~75 us -> ~25 us).
    """
    if result is None:
        result = worker_pb2.StepResult()
    result.step_id, result.execute_seconds = out.step_id, out.execute_seconds
    add_sampled = result.sampled.add
    for s in out.sampled:
        token = add_sampled(seq_id=s.seq_id, token_id=s.token_id, logprob=s.logprob)
        if s.top_logprobs:
            add_top = token.top_logprobs.add
            for token_id, logprob in s.top_logprobs:
                add_top(token_id=token_id, logprob=logprob)
    for p in out.prompt_logprobs:
        positions = result.prompt_logprobs.add(seq_id=p.seq_id, start=p.start).positions
        for logprob, top, rank in zip(p.logprobs, p.top, p.ranks or repeat(0)):
            add_position_top = positions.add(logprob=logprob, rank=rank).top.add
            for token_id, top_logprob in top:
                add_position_top(token_id=token_id, logprob=top_logprob)
    return result


def batch_result(outs: list[StepOutput]) -> worker_pb2.StepBatchResult:
    """The answer to a call of the step stream, each result written in place rather than copied in (at batch 64 on
    a Zen 5, built and serialized: 23 us against 26)."""
    answer = worker_pb2.StepBatchResult()
    for out in outs:
        step_result(out, answer.results.add())
    return answer


def describe_runner(r: ModelRunner, model_name: str, instance_id: str, epoch: int) -> worker_pb2.WorkerDescription:
    """What a model runner serves and holds, as Describe answers it."""
    return worker_pb2.WorkerDescription(
        model=model_name,
        dtype=str(r.dtype).removeprefix("torch."),
        block_size=r.config.block_size,
        num_gpu_blocks=r.cache.sizing.num_gpu_blocks,
        num_cpu_blocks=r.cache.sizing.num_cpu_blocks,
        max_model_len=r.max_model_len,
        instance_id=instance_id,
        device=str(r.device),
        num_cached_sequences=len(r.seqs),
        epoch=epoch,
        vocab_size=r.shape.vocab_size,
        num_used_blocks=r.seqs.num_used_blocks(),
        sliding_window=r.shape.sliding_window or 0,
        num_recomputed_tokens=r.seqs.num_recomputed_tokens,
    )


def executed_step(step: ExecutedStepData, runner: ModelRunner, with_tables: bool) -> worker_pb2.ExecutedStep:
    """The wire form of a step the worker ran (Reset with keep_cache); `with_tables`: the newest step."""
    plan = step.plan
    msg = worker_pb2.ExecutedStep(epoch=plan.epoch, step_id=plan.step_id)
    step_result(step.output, msg.result)
    for seq_id, computed, new in step.scheduled:
        entry = msg.sequences.add(seq_id=seq_id, num_computed_tokens=computed, num_new_tokens=new)
        cached = runner.seqs.get(seq_id) if with_tables else None
        if cached is not None:
            entry.block_table.extend(cached.block_table)
    for field, pairs in ((msg.swap_in, plan.swap_in), (msg.swap_out, plan.swap_out), (msg.copy, plan.copy)):
        for src, dst in pairs:
            field.add(src=src, dst=dst)
    return msg


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    """Serves Describe / StreamSteps / Reset / Resume over one ModelRunner.

    The forward pass runs on the model thread (the one that loaded the model: model_thread.py) so
    Describe and health checks stay responsive during a long step; a lock keeps steps strictly sequential.
    """

    def __init__(self, runner: ModelRunner, model_name: str, tracer: trace.Tracer | None = None,
                 metrics: WorkerMetrics | None = None, model_thread: ModelThread | None = None) -> None:
        self._runner = runner
        self._model_thread = model_thread if model_thread is not None else ModelThread()
        self._tracer = tracer if tracer is not None else trace.NoOpTracer()
        self._metrics = metrics
        self._model_name = model_name
        self.instance_id = uuid.uuid4().hex
        self._epoch = 0
        self._lock = asyncio.Lock()
        # time.monotonic() when the forward pass now running began (None between steps). Set in the
        # step's thread: a cancelled call (the scheduler's deadline) leaves the thread running, and
        # liveness must see that forward pass, not the call.
        self._step_started: float | None = None

    @property
    def step_activity(self) -> Activity:
        """Liveness input: a step is work, and its start is the last progress."""
        started = self._step_started
        return Activity(has_work=started is not None, last_progress=started if started is not None else 0.0)

    def _execute(self, plans: list[StepPlanData], requests: list[worker_pb2.StepPlan]) -> list[StepOutput]:
        self._step_started = time.monotonic()
        try:
            return [self._runner.execute(plan, request) for plan, request in zip(plans, requests)]
        finally:
            self._step_started = None

    def _fence(self, epoch: int) -> None:
        # Fencing: a plan from an engine loop older than the newest owner is refused,
        # so a deposed scheduler replica can never write into the new owner's blocks.
        if epoch < self._epoch:
            raise StaleEpochError(f"epoch {epoch} is older than the current epoch {self._epoch}")
        self._epoch = epoch

    async def Describe(self, request: worker_pb2.DescribeRequest, context: grpc.aio.ServicerContext) -> worker_pb2.WorkerDescription:
        return self.description()

    def description(self) -> worker_pb2.WorkerDescription:
        """What the worker is and holds (Describe, and its registration in Redis)."""
        return describe_runner(self._runner, self._model_name, self.instance_id, self._epoch)

    async def StreamSteps(self, request_iterator: AsyncIterator[worker_pb2.StepBatch],
                          context: grpc.aio.ServicerContext) -> AsyncIterator[worker_pb2.StepBatchResult]:
        """The engine loop's calls on one stream (scheduler_service/step_stream.py), answered in order.

        Each call starts when it arrives, not when the one before it has been answered: under async
        scheduling the next call is sent while one runs, and a call that reached the worker runs even if
        the stream ends before its turn (resume.py counts on it)."""
        calls: asyncio.Queue[_Call | None] = asyncio.Queue()

        async def receive() -> None:
            try:
                async for batch in request_iterator:
                    calls.put_nowait(self._start_call(batch))
            finally:
                calls.put_nowait(None)

        receiver = asyncio.ensure_future(receive())
        try:
            while (call := await calls.get()) is not None:
                outs = await self._answer(call)
                yield batch_result(outs)
        finally:
            receiver.cancel()
            # Calls not answered (the stream ended, or a call before them failed) run all the same.
            while not calls.empty():
                if (left := calls.get_nowait()) is not None:
                    left.abandon()

    def _start_call(self, batch: worker_pb2.StepBatch) -> _Call:
        """Starts a call's plans, behind the calls before it (the lock is first come, first served). Its span
        is a child of the engine loop's step span (the batch's trace context)."""
        plans = list(batch.steps)
        span = self._tracer.start_span("llmserve.worker.execute_step", kind=SpanKind.SERVER,
                                       context=context_from_metadata(batch.trace_context.items()))
        return _Call(plans, span, asyncio.ensure_future(self._run_steps(plans)))

    async def _answer(self, call: _Call) -> list[StepOutput]:
        """A started call's outputs. Shielded from the stream: plans that reached the worker run in their turn
        even if their caller is gone (a scheduler replica killed while its call waited behind the one before).
        The next owner lands their kept results (Reset with keep_cache reports the last steps); dropped, they
        would leave the stored state, which already counts them as run under async or multi-step scheduling,
        ahead of the cache, and the next owner would recompute every sequence."""
        try:
            outs = await asyncio.shield(call.steps)
        except asyncio.CancelledError:
            call.abandon()
            raise
        except Exception as exc:
            call.span.set_status(Status(StatusCode.ERROR, f"{status_for(exc).name}: {exc}"))
            call.span.end()
            raise  # the status: shared.grpc_server.EdgeInterceptor
        self._observe(call.plans, outs, call.span)
        return outs

    async def _run_steps(self, requests: list[worker_pb2.StepPlan]) -> list[StepOutput]:
        if not requests:
            raise InvalidRequestError("a step batch holds no plan")
        async with self._lock:
            for request in requests:
                self._fence(request.epoch)
            plans = [plan_from_proto(request) for request in requests]
            # The wire plans too: a tensor-parallel rank 0 forwards them to the other ranks.
            return await self._model_thread.call(self._execute, plans, requests)

    def _observe(self, plans: list[worker_pb2.StepPlan], outs: list[StepOutput], span: trace.Span) -> None:
        """The call's span attributes and each step's metrics (execute_seconds is the runner's own measurement)."""
        m = self._metrics
        if not span.is_recording() and m is None:
            return
        tokens = [sum(s.num_new_tokens for s in p.new_sequences) + sum(s.num_new_tokens for s in p.cached_sequences)
                  for p in plans]
        used = self._runner.seqs.num_used_blocks()
        if span.is_recording():
            first = plans[0]
            span.set_attributes({
                "llmserve.step_id": first.step_id, "llmserve.epoch": first.epoch, "llmserve.worker.steps": len(plans),
                "llmserve.worker.new_sequences": sum(len(p.new_sequences) for p in plans),
                # The decodes of a multi-step call are the same sequences in each step: counted once.
                "llmserve.worker.cached_sequences": len(first.cached_sequences),
                "llmserve.worker.tokens": sum(tokens), "llmserve.worker.sampled": sum(len(o.sampled) for o in outs),
                "llmserve.worker.swap_in_blocks": sum(len(p.swap_in) for p in plans),
                "llmserve.worker.swap_out_blocks": sum(len(p.swap_out) for p in plans),
                "llmserve.worker.copy_blocks": sum(len(p.copy) for p in plans), "llmserve.worker.blocks_in_use": used,
                "llmserve.worker.execute_s": sum(o.execute_seconds for o in outs),
            })
        span.end()
        if m is not None:
            for out, num_tokens in zip(outs, tokens):
                m.step_time.observe(out.execute_seconds)
                m.tokens.inc(num_tokens)
                m.sampled.inc(len(out.sampled))
            m.blocks_used.set(used)

    def _observe_blocks(self) -> None:
        """The block gauge after the sequences changed outside a step (a reset drops them, a resume keeps some)."""
        if self._metrics is not None:
            self._metrics.blocks_used.set(self._runner.seqs.num_used_blocks())

    async def Reset(self, request: worker_pb2.ResetRequest, context: grpc.aio.ServicerContext) -> worker_pb2.ResetResponse:
        async with self._lock:
            self._fence(request.epoch)
            # On the model thread: after a step still running there (its caller gone), never beside it.
            steps = await self._model_thread.call(self._reset, request.keep_cache)
        self._observe_blocks()
        log.info("%s by epoch %d", "fenced (cache kept)" if request.keep_cache else "reset", request.epoch)
        return worker_pb2.ResetResponse(instance_id=self.instance_id, last_steps=steps)

    def _reset(self, keep_cache: bool) -> list[worker_pb2.ExecutedStep]:
        if not keep_cache:
            self._runner.reset()
            return []
        steps = list(self._runner.last_steps)
        return [executed_step(step, self._runner, step is steps[-1]) for step in steps]

    async def Resume(self, request: worker_pb2.ResumeSequencesRequest,
                     context: grpc.aio.ServicerContext) -> worker_pb2.ResumeSequencesResponse:
        async with self._lock:
            if request.epoch != self._epoch:
                raise StaleEpochError(f"Resume of epoch {request.epoch}, the worker is fenced at {self._epoch}")
            refused = await self._model_thread.call(self._runner.resume, request)
        self._observe_blocks()
        log.info("resumed %d sequence(s) for epoch %d, refused %d", len(request.sequences) - len(refused),
                 request.epoch, len(refused))
        response = worker_pb2.ResumeSequencesResponse()
        for seq_id, reason in refused:
            response.refused.add(seq_id=seq_id, reason=reason, not_cached=reason == NOT_CACHED)
        return response

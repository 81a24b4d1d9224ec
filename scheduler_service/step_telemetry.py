"""Spans and metrics of an engine loop, built from each step's measurements (its StepProfile).

A step serves several requests, so its span starts a trace of its own and
links to the `llmserve.generate` span of every request in it (that span
lives in whichever replica admitted the request; its context travels in the
Redis request record). The worker's execution is a child of the step span
(context in the gRPC metadata). When a request finishes, an engine-side
`llmserve.request` span, a child of its generate span, records what only
the engine saw (time in queue).
"""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.trace import Link, SpanContext, SpanKind

from protos import state_pb2, worker_pb2
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.core.scheduler_output import SchedulerOutput
from scheduler_service.output_processor import OutputProcessor
from scheduler_service.step_profile import StepProfile
from shared.metrics import EngineMetrics
from shared.tracing import PerfClock, child_span, from_traceparent, remote_parent


class StepTelemetry:
    """The engine loop's traces and metrics (either may be off)."""

    def __init__(
        self,
        worker_id: str,
        scheduler: Scheduler,
        processor: OutputProcessor,
        tracer: trace.Tracer | None,
        metrics: EngineMetrics | None,
    ) -> None:
        self.worker_id = worker_id
        self._scheduler = scheduler
        self._processor = processor
        self._tracer = tracer if tracer is not None else trace.NoOpTracer()
        self.tracing = not isinstance(self._tracer, trace.NoOpTracer)
        self._metrics = metrics
        self.enabled = self.tracing or metrics is not None
        # request id -> its `llmserve.generate` span (other process): step spans link to it.
        self._request_spans: dict[str, SpanContext] = {}
        self._last_step: SpanContext | None = None
        # The block manager's cumulative prefix-cache lookups (blocks) when last exported.
        self._prefix_seen = (0, 0)

    def remember(self, record: state_pb2.AdmittedRequest) -> None:
        if self.tracing and record.traceparent:
            ctx = from_traceparent(record.traceparent)
            if ctx is not None:
                self._request_spans[record.request_id] = ctx

    def forget(self, request_id: str) -> None:
        """The request left this loop unfinished (handed over): the loop that continues it traces it."""
        self._request_spans.pop(request_id, None)

    def start_step(self, out: SchedulerOutput, clock: PerfClock | None, started: float) -> trace.Span:
        """A step's span (its own trace), linked to the request span of every request in the step."""
        if clock is None:
            return trace.INVALID_SPAN
        request_ids = list(dict.fromkeys(item.group.request_id for item in out.scheduled))
        links = [Link(self._request_spans[r], {"gen_ai.request.id": r}) for r in request_ids if r in self._request_spans]
        bm = self._scheduler.block_manager
        # Blocks as planned: the step's finished requests free theirs when it is postprocessed.
        attributes = {"llmserve.request_ids": request_ids, "llmserve.step.blocks_total": bm.num_gpu_blocks,
                      "llmserve.step.blocks_in_use": bm.num_gpu_blocks - bm.num_free_gpu_blocks}
        return self._tracer.start_span("llmserve.step", kind=SpanKind.INTERNAL, links=links,
                                       start_time=clock.ns(started), attributes=attributes)

    def observe_step(self, p: StepProfile, outs: list[SchedulerOutput], results: list[worker_pb2.StepResult],
                     span: trace.Span, clock: PerfClock | None, ingested: float, commit_start: float,
                     processing: float) -> None:
        """Records one finished worker call (one step, or several under multi-step scheduling) as spans and
        metrics (all times from its StepProfile)."""
        preemptions = sum(len(out.preempted) for out in outs)
        if clock is not None:
            span.set_attributes({
                "llmserve.step": p.step, "llmserve.worker": self.worker_id, "llmserve.step.num_seqs": p.num_seqs,
                "llmserve.step.prefill_tokens": p.num_prefill_tokens, "llmserve.step.decode_tokens": p.num_decode_tokens,
                "llmserve.step.preemptions": preemptions, "llmserve.step.steps": p.num_steps,
                "llmserve.step.swap_in_blocks": sum(len(out.blocks_to_swap_in) for out in outs),
                "llmserve.step.swap_out_blocks": sum(len(out.blocks_to_swap_out) for out in outs),
                "llmserve.step.rpc_s": p.rpc_s, "llmserve.step.worker_s": p.worker_s,
                "llmserve.step.commit_wait_s": p.commit_wait_s,
            })
            child_span(self._tracer, "llmserve.schedule", span, clock.ns(ingested),
                       clock.ns(ingested + p.schedule_s + p.plan_s), {"llmserve.schedule_s": p.schedule_s})
            child_span(self._tracer, "llmserve.redis_commit", span, clock.ns(commit_start),
                       clock.ns(commit_start + p.commit_s), {"llmserve.committed_step": p.step - 1},
                       links=self._last_step_link())
            child_span(self._tracer, "llmserve.postprocess", span, clock.ns(processing), clock.ns(processing + p.process_s))
            span.end(end_time=clock.ns(processing + p.process_s))
            self._last_step = span.get_span_context()
        m = self._metrics
        if m is not None:
            m.step_time.observe(p.wall_s)
            m.commit_time.observe(p.commit_s)
            m.prompt_tokens.inc(p.num_prefill_tokens)
            m.generation_tokens.inc(sum(len(result.sampled) for result in results))
            m.preemptions.inc(preemptions)
            for out in outs:
                m.iteration_tokens.observe(out.num_batched_tokens)
        self._observe_state()

    def observe_idle_commit(self, step: int, commit_start: float, commit_s: float, clock: PerfClock | None) -> None:
        """The commit of the last step before the loop went idle (no step overlaps it)."""
        if clock is not None:
            span = self._tracer.start_span("llmserve.redis_commit", start_time=clock.ns(commit_start),
                                           links=self._last_step_link(),
                                           attributes={"llmserve.committed_step": step,
                                                       "llmserve.worker": self.worker_id})
            span.end(end_time=clock.ns(commit_start + commit_s))
        if self._metrics is not None:
            self._metrics.commit_time.observe(commit_s)
        self._observe_state()

    def baseline(self) -> None:
        """Counts from here on: the prefix-cache lookups a restored scheduler carries were exported by its last
        owner."""
        stats = self._scheduler.block_manager.prefix_cache_stats
        self._prefix_seen = (stats.queries, stats.hits)

    def close(self) -> None:
        """The engine loop ended: its gauges go (a stopped loop reports no queue or cache)."""
        if self._metrics is not None:
            self._metrics.close()

    def _last_step_link(self) -> list[Link] | None:
        """A commit span links to the step whose results it commits (the last one traced)."""
        return [Link(self._last_step)] if self._last_step is not None else None

    def _observe_state(self) -> None:
        """Queue gauges, and the requests that finished: histograms and their engine-side spans."""
        m = self._metrics
        if m is not None:
            sched, bm = self._scheduler, self._scheduler.block_manager
            m.running.set(len(sched.running))
            m.waiting.set(len(sched.waiting))
            m.swapped.set(len(sched.swapped))
            usage = 1.0 - bm.num_free_gpu_blocks / bm.num_gpu_blocks if bm.num_gpu_blocks else 0.0
            m.cache_usage.set(usage)
            m.kv_cache_usage.set(usage)
            stats = bm.prefix_cache_stats
            queries, hits = self._prefix_seen
            m.prefix_cache_queries.inc((stats.queries - queries) * bm.block_size)
            m.prefix_cache_hits.inc((stats.hits - hits) * bm.block_size)
            self._prefix_seen = (stats.queries, stats.hits)
            m.cpu_cache_usage.set((bm.num_cpu_blocks - bm.num_free_cpu_blocks) / bm.num_cpu_blocks if bm.num_cpu_blocks else 0.0)
        finished, inter_token = self._processor.take_finished()
        if m is not None:
            for latency in inter_token:
                m.inter_token_latency.observe(latency)
        for request_id, t in finished:
            if m is not None:
                m.finished(t)
            parent = self._request_spans.pop(request_id, None)
            if parent is None:
                continue
            # The request's life as the engine saw it, as a child of its llmserve.generate span.
            attributes: dict[str, object] = {
                "gen_ai.request.id": request_id, "llmserve.worker": self.worker_id,
                "gen_ai.latency.time_in_queue": t.time_in_queue,
                "gen_ai.latency.time_to_first_token": t.time_to_first_token, "gen_ai.latency.e2e": t.e2e,
                "gen_ai.usage.prompt_tokens": t.prompt_tokens, "gen_ai.usage.completion_tokens": t.generation_tokens,
                "llmserve.finished_reason": t.finished_reason,
            }
            if t.time_per_output_token is not None:
                attributes["llmserve.time_per_output_token"] = t.time_per_output_token
            span = self._tracer.start_span("llmserve.request", context=remote_parent(parent),
                                           start_time=int(t.arrival_time * 1e9), attributes=attributes)  # type: ignore[arg-type]
            span.end(end_time=int(t.finished_time * 1e9))

"""Prometheus metrics of both services, served by `--metrics-port` at /metrics.

Names follow vLLM (`vllm:` prefix) wherever vLLM has the metric, so its dashboards work
unchanged; metrics vLLM has no counterpart for use the `llmserve:` prefix. Each service
keeps its own registry (no process-wide globals); the scheduler labels every series
with `model_name` and `worker` (one engine loop per worker), the worker with `model_name`.
"""

from __future__ import annotations

from dataclasses import dataclass
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

# vLLM's buckets, so histograms line up with vLLM's dashboards.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)
# vLLM's: tokens per engine step, and 1-2-5 steps for per-request token counts.
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
REQUEST_TOKEN_BUCKETS = tuple(m * 10**e for e in range(7) for m in (1, 2, 5))
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)

_ENGINE_LABELS = ("model_name", "worker")


@dataclass
class RequestTimings:
    """One finished request, as the engine loop saw it (seconds; unix times)."""

    arrival_time: float
    first_scheduled_time: float
    first_token_time: float
    finished_time: float
    prompt_tokens: int
    generation_tokens: int
    finished_reason: str

    @property
    def time_in_queue(self) -> float:
        return max(0.0, self.first_scheduled_time - self.arrival_time)

    @property
    def time_to_first_token(self) -> float:
        return max(0.0, self.first_token_time - self.arrival_time)

    @property
    def e2e(self) -> float:
        return max(0.0, self.finished_time - self.arrival_time)

    @property
    def prefill_time(self) -> float:
        return max(0.0, self.first_token_time - self.first_scheduled_time)

    @property
    def decode_time(self) -> float:
        return max(0.0, self.finished_time - self.first_token_time)

    @property
    def time_per_output_token(self) -> float | None:
        """Mean time between output tokens after the first; None with fewer than two tokens."""
        if self.generation_tokens < 2:
            return None
        return max(0.0, self.finished_time - self.first_token_time) / (self.generation_tokens - 1)


class SchedulerMetrics:
    """Every metric a scheduler replica exports; `engine(worker_id)` binds one engine loop's labels."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.model_name = model_name
        r, labels = self.registry, _ENGINE_LABELS
        self.running = Gauge("vllm:num_requests_running", "Requests running on the worker.", labels, registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.", labels, registry=r)
        self.swapped = Gauge("vllm:num_requests_swapped", "Requests swapped out to CPU memory.", labels, registry=r)
        self.cache_usage = Gauge("vllm:gpu_cache_usage_perc",
                                 "Fraction of the worker's device KV-cache blocks in use (1 = full; the cache lives "
                                 "in CPU memory on CPU workers).", labels, registry=r)
        # vLLM's current name for the same gauge (the older one is kept for existing dashboards).
        self.kv_cache_usage = Gauge("vllm:kv_cache_usage_perc", "Fraction of the worker's KV-cache blocks in use.",
                                    labels, registry=r)
        self.prefix_cache_queries = Counter("vllm:prefix_cache_queries",
                                            "Prompt tokens looked up in the prefix cache (full blocks).", labels,
                                            registry=r)
        self.prefix_cache_hits = Counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", labels,
                                         registry=r)
        self.iteration_tokens = Histogram("vllm:iteration_tokens_total", "Tokens computed per engine step.", labels,
                                          buckets=ITERATION_TOKEN_BUCKETS, registry=r)
        self.cpu_cache_usage = Gauge("vllm:cpu_cache_usage_perc", "Fraction of the CPU swap-space blocks in use.",
                                     labels, registry=r)
        self.preemptions = Counter("vllm:num_preemptions", "Preemptions (recompute and swap).", labels, registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens computed (prefill, recomputation included).",
                                     labels, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated.", labels, registry=r)
        self.success = Counter("vllm:request_success", "Requests finished, by finish reason.",
                               (*labels, "finished_reason"), registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Arrival to first generated token.", labels,
                              buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("vllm:time_per_output_token_seconds",
                              "Per request: mean time between output tokens after the first.", labels,
                              buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Arrival to the request's last token.", labels,
                             buckets=E2E_BUCKETS, registry=r)
        self.queue_time = Histogram("vllm:request_queue_time_seconds", "Arrival to first scheduled.", labels,
                                    buckets=E2E_BUCKETS, registry=r)
        self.inter_token_latency = Histogram("vllm:inter_token_latency_seconds",
                                             "Time between a request's consecutive output tokens.", labels,
                                             buckets=TPOT_BUCKETS, registry=r)
        self.prefill_time = Histogram("vllm:request_prefill_time_seconds", "First scheduled to first generated token.",
                                      labels, buckets=E2E_BUCKETS, registry=r)
        self.decode_time = Histogram("vllm:request_decode_time_seconds", "First generated token to the last.", labels,
                                     buckets=E2E_BUCKETS, registry=r)
        self.request_prompt_tokens = Histogram("vllm:request_prompt_tokens", "Prompt tokens of each finished request.",
                                               labels, buckets=REQUEST_TOKEN_BUCKETS, registry=r)
        self.request_generation_tokens = Histogram("vllm:request_generation_tokens",
                                                   "Generated tokens of each finished request.", labels,
                                                   buckets=REQUEST_TOKEN_BUCKETS, registry=r)
        self.step_time = Histogram("llmserve:engine_step_seconds", "Wall time of one engine-loop step.", labels,
                                   buckets=STEP_BUCKETS, registry=r)
        self.commit_time = Histogram("llmserve:redis_commit_seconds", "One step's fenced Redis commit (WATCH, GET of the epoch, MULTI/EXEC).",
                                     labels, buckets=STEP_BUCKETS, registry=r)

    def engine(self, worker_id: str) -> "EngineMetrics":
        return EngineMetrics(self, worker_id)


class EngineMetrics:
    """One engine loop's series (label values bound once: observing is then a method call)."""

    def __init__(self, m: SchedulerMetrics, worker_id: str) -> None:
        values = (m.model_name, worker_id)
        self._m, self._values = m, values
        self._gauges = (m.running, m.waiting, m.swapped, m.cache_usage, m.kv_cache_usage, m.cpu_cache_usage)
        self.running, self.waiting, self.swapped = (g.labels(*values) for g in (m.running, m.waiting, m.swapped))
        self.cache_usage, self.cpu_cache_usage = m.cache_usage.labels(*values), m.cpu_cache_usage.labels(*values)
        self.kv_cache_usage = m.kv_cache_usage.labels(*values)
        self.prefix_cache_queries, self.prefix_cache_hits = (
            m.prefix_cache_queries.labels(*values), m.prefix_cache_hits.labels(*values))
        self.iteration_tokens, self.inter_token_latency = (
            m.iteration_tokens.labels(*values), m.inter_token_latency.labels(*values))
        self.preemptions = m.preemptions.labels(*values)
        self.prompt_tokens, self.generation_tokens = m.prompt_tokens.labels(*values), m.generation_tokens.labels(*values)
        self.ttft, self.tpot, self.e2e = m.ttft.labels(*values), m.tpot.labels(*values), m.e2e.labels(*values)
        self.queue_time = m.queue_time.labels(*values)
        self.step_time, self.commit_time = m.step_time.labels(*values), m.commit_time.labels(*values)

    def finished(self, t: RequestTimings) -> None:
        """Per-request histograms and the success counter, once per finished request."""
        self._m.success.labels(*self._values, t.finished_reason).inc()
        self.ttft.observe(t.time_to_first_token)
        self.e2e.observe(t.e2e)
        self.queue_time.observe(t.time_in_queue)
        tpot = t.time_per_output_token
        if tpot is not None:
            self.tpot.observe(tpot)
        m, values = self._m, self._values
        m.prefill_time.labels(*values).observe(t.prefill_time)
        m.decode_time.labels(*values).observe(t.decode_time)
        m.request_prompt_tokens.labels(*values).observe(t.prompt_tokens)
        m.request_generation_tokens.labels(*values).observe(t.generation_tokens)

    def close(self) -> None:
        """The engine loop ended: its gauges leave the registry (a stopped loop has no queue or cache to report).
        Counters and histograms stay: they are totals so far."""
        for gauge in self._gauges:
            try:
                gauge.remove(*self._values)
            except KeyError:  # never set
                pass


class WorkerMetrics:
    """Every metric a worker exports."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r, labels = self.registry, ("model_name",)
        self.step_time = Histogram("llmserve:worker_step_seconds",
                                   "Step time in the worker: block operations, forward pass, sampling.",
                                   labels, buckets=STEP_BUCKETS, registry=r).labels(model_name)
        self.tokens = Counter("llmserve:worker_tokens", "Tokens computed by forward passes (prefill and decode).",
                              labels, registry=r).labels(model_name)
        self.sampled = Counter("llmserve:worker_sampled_tokens", "Tokens sampled.", labels, registry=r).labels(model_name)
        self.blocks_used = Gauge("llmserve:worker_kv_blocks_used", "KV-cache blocks held by cached sequences.",
                                 labels, registry=r).labels(model_name)


class FrontMetrics:
    """The HTTP front's own series (the engine's are the scheduler's): requests and their durations by route,
    under the names of the instrumentator that vLLM's API server uses."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.requests = Counter("http_requests", "HTTP requests by route, method and status class (2xx, 4xx, ...).",
                                ("handler", "method", "status"), registry=r)
        self.duration = Histogram("http_request_duration_seconds",
                                  "HTTP request duration by route and method (a stream: until its last event).",
                                  ("handler", "method"), buckets=E2E_BUCKETS, registry=r)


class MetricsServer:
    """prometheus_client's HTTP server on its own thread; port 0 picks a free one (see `port`)."""

    def __init__(self, registry: CollectorRegistry, port: int, host: str = "0.0.0.0") -> None:
        self._server: WSGIServer
        self._server, self._thread = start_http_server(port, addr=host, registry=registry)
        self.port: int = self._server.server_port

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

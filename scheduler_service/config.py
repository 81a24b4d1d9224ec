"""Scheduler service configuration, validated at start-up."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SchedulerServiceConfig:
    """How a scheduler replica reaches its dependencies and schedules.

    tokenizer: local directory with the model's tokenizer (usually the model directory).
    redis_url: the state store.
    workers: worker addresses (host:port); each gets one engine loop.
    max_num_batched_tokens: token budget per step; None = max(max_model_len, 2048) as in vLLM
      without chunked prefill (a prompt must fit in one step), 512 with it.
    enable_chunked_prefill: decodes and prompt chunks share each step's token budget.
    enable_prefix_caching: full KV blocks are shared between requests with the same prefix.
    profile_steps: append each engine-loop step's time split to this JSON-lines file (benchmarks).
    otlp_endpoint: send OpenTelemetry spans to this OTLP/gRPC collector.
    trace_file: append spans to this JSON-lines file (read by `llmserve trace show`).
    metrics_port: serve Prometheus metrics on this port at /metrics (0 = off).
    max_num_queued_requests: per worker, the most requests admitted but not yet scheduled (0 = unbounded);
      beyond it Generate answers RESOURCE_EXHAUSTED at once.
    max_queued_tokens: per worker, the most prompt tokens of those requests (0 = unbounded); a request is
      always admitted into an empty queue, so one prompt above the bound is not refused forever.
    step_timeout_s: deadline of one worker step (ExecuteStep); a step past it counts as a worker failure.
    """

    tokenizer: str
    redis_url: str
    workers: list[str] = field(default_factory=list)
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    max_model_len: int = 0
    enable_chunked_prefill: bool = False
    enable_prefix_caching: bool = False
    worker_connect_timeout_s: float = 300.0
    profile_steps: str = ""
    otlp_endpoint: str = ""
    trace_file: str = ""
    metrics_port: int = 0
    max_num_queued_requests: int = 0
    max_queued_tokens: int = 0
    step_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if not self.workers:
            raise ValueError("workers must name at least one worker address (host:port)")
        for address in self.workers:
            host, sep, port = address.rpartition(":")
            if not sep or not host or not port.isdigit():
                raise ValueError(f"worker address must be host:port, got {address!r}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}")
        if self.max_model_len < 0:
            raise ValueError(f"max_model_len must be non-negative, got {self.max_model_len}")
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in 0..65535 (0 = off), got {self.metrics_port}")
        if self.max_num_queued_requests < 0:
            raise ValueError(f"max_num_queued_requests must be non-negative (0 = unbounded), got {self.max_num_queued_requests}")
        if self.max_queued_tokens < 0:
            raise ValueError(f"max_queued_tokens must be non-negative (0 = unbounded), got {self.max_queued_tokens}")
        if not self.step_timeout_s > 0:
            raise ValueError(f"step_timeout_s must be positive, got {self.step_timeout_s}")

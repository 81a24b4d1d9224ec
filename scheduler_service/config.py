"""Scheduler service configuration, validated at start-up."""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler_service.scheduling import SchedulingFlags
from shared import defaults
from shared.redis_client import RedisOptions
from shared.tls import ClientTLS, ServerTLS


@dataclass(kw_only=True)
class SchedulerServiceConfig(SchedulingFlags):
    """How a scheduler replica reaches its dependencies and schedules.

    tokenizer: local directory with the model's tokenizer (usually the model directory).
    redis_url: the state store.
    lease_ttl_s: how long a worker's lease outlives its last renewal: a replica that dies is replaced
      on its workers within this time; renewals run every min(TTL / 3, 1 s).
    worker_connect_timeout_s: how long start-up waits for Redis to answer and a first worker to register in it (the
      deploy/k8s startup probe's 10 minutes: a worker's first start compiles its kernels, a large model loads long).
    (the scheduling flags, max_num_seqs to enable_prefix_caching: see SchedulingFlags)
    profile_steps: append each engine-loop step's time split to this JSON-lines file (benchmarks).
    otlp_endpoint: send OpenTelemetry spans to this OTLP/gRPC collector.
    trace_file: append spans to this JSON-lines file (read by `llmserve trace show`).
    metrics_port: serve Prometheus metrics on this port at /metrics (0 = off).
    max_num_queued_requests: per worker, the most requests admitted but not yet scheduled (0 = unbounded);
      beyond it Generate answers RESOURCE_EXHAUSTED at once.
    max_queued_tokens: per worker, the most prompt tokens of those requests (0 = unbounded); a request is
      always admitted into an empty queue, so one prompt above the bound is not refused forever.
    step_timeout_s: deadline of one worker step (a call on its step stream); a step past it counts as a worker failure.
    async_scheduling: plan and send step N+1 while the worker runs step N (the worker decodes on its own
      samples of N; a sequence that N ends by a stop token runs one step more, its token dropped); off,
      each step waits for the previous result. Beam search always waits. Off by default: on the 2-core
      CPU machine of docs/benchmarks.md the overlapped scheduling work slows the worker's step as much
      as it saves (docs/benchmarks-history.md); it pays where the worker's host has idle cores (a GPU).
    num_scheduler_steps: the most steps one call to a worker carries (multi-step scheduling, vLLM's
      --num-scheduler-steps): a batch of decodes only, with no waiting request that could start, runs that
      many steps back to back on the worker, each decoding the token the one before sampled, for one round
      trip, one Redis commit and one postprocessing (scheduler_service/multi_step.py); clients get the
      tokens in bursts, a sequence that stops mid-call computes the rest of the call for nothing, and a
      request arriving meanwhile waits for the call's end. Not with async scheduling.
    liveness_timeout_s: grpc.health.v1 "liveness" turns NOT_SERVING when an engine loop holding requests
      has completed no step for this long; keep it well above step_timeout_s, which handles a hung worker
      first (a restart of the scheduler does not mend a worker).
    tls: serve the public API over TLS (None = plaintext); with a client CA, clients need certificates.
    auth_token: when set, every public call but grpc.health.v1 needs `authorization: Bearer <auth_token>`.
    worker_tls: reach the workers over TLS, presenting a client certificate for their mutual TLS.
    redis: AUTH password and TLS CA for redis_url (rediss://).
    output_retention_s: how long a finished request's output stream stays in Redis, for Resume and idempotent
      re-sends; each generated token keeps ~50 bytes there that long (size Redis by output tokens/s x this).
    front_only: serve clients and drive no worker (take no lease, stay out of the replicas' roster), so that
      the client streams' per-token work and the engine loops' per-step work scale on separate replicas.
    """

    tokenizer: str
    redis_url: str
    worker_connect_timeout_s: float = 600.0
    profile_steps: str = ""
    otlp_endpoint: str = ""
    trace_file: str = ""
    metrics_port: int = 0
    max_num_queued_requests: int = 0
    max_queued_tokens: int = 0
    step_timeout_s: float = defaults.STEP_TIMEOUT_S
    async_scheduling: bool = False
    num_scheduler_steps: int = defaults.NUM_SCHEDULER_STEPS
    liveness_timeout_s: float = defaults.LIVENESS_TIMEOUT_S
    lease_ttl_s: float = defaults.LEASE_TTL_S
    output_retention_s: int = defaults.OUTPUT_RETENTION_S
    tls: ServerTLS | None = None
    auth_token: str = field(default="", repr=False)
    worker_tls: ClientTLS | None = None
    redis: RedisOptions = field(default_factory=RedisOptions)
    front_only: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in 0..65535 (0 = off), got {self.metrics_port}")
        for name in ("max_num_queued_requests", "max_queued_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be non-negative (0 = unbounded), got {getattr(self, name)}")
        if self.output_retention_s < 1:
            raise ValueError(f"output_retention_s must be at least 1 second, got {self.output_retention_s}")
        if not self.lease_ttl_s >= 1:
            raise ValueError(f"lease_ttl_s must be at least 1 second, got {self.lease_ttl_s}")
        for name in ("step_timeout_s", "liveness_timeout_s"):
            if not getattr(self, name) > 0:  # NaN fails too
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not 1 <= self.num_scheduler_steps <= defaults.MAX_NUM_SCHEDULER_STEPS:
            raise ValueError(f"num_scheduler_steps must be in 1..{defaults.MAX_NUM_SCHEDULER_STEPS}, "
                             f"got {self.num_scheduler_steps}")
        if self.num_scheduler_steps > 1 and self.async_scheduling:
            raise ValueError("num_scheduler_steps > 1 and async_scheduling are exclusive: both plan steps ahead of "
                             "their results, one per call and one in a call")
        self.redis.check_url(self.redis_url)  # its message redacts a password in the URL

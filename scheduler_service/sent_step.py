"""A step the engine loop has sent to its worker and not yet landed (its result not processed)."""

from __future__ import annotations

from dataclasses import dataclass

import grpc
from opentelemetry import trace

from protos import state_pb2, worker_pb2
from scheduler_service.core.scheduler_output import SchedulerOutput
from scheduler_service.step_profile import StepProfile
from shared.tracing import PerfClock


@dataclass
class SentStep:
    """The plan's scheduler output, the ExecuteStep call carrying it, and what its telemetry needs."""

    out: SchedulerOutput
    call: grpc.aio.UnaryUnaryCall[worker_pb2.StepPlan, worker_pb2.StepResult]
    span: trace.Span
    clock: PerfClock | None
    profile: StepProfile | None
    # perf_counter() times: the loop iteration that planned it began, its requests were ingested, it was sent.
    started: float
    ingested: float
    sent: float
    # What a commit stores of it for a new owner while it has not landed.
    record: state_pb2.StepRecord

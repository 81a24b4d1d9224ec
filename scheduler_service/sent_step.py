"""A call the engine loop has sent to its worker and not yet landed (its results not processed)."""

from __future__ import annotations

from dataclasses import dataclass

from opentelemetry import trace

from protos import state_pb2
from scheduler_service.core.scheduler_output import SchedulerOutput
from scheduler_service.step_profile import StepProfile
from scheduler_service.step_stream import StepCall
from shared.tracing import PerfClock


@dataclass
class SentStep:
    """The scheduler outputs of one worker call (one step; several under multi-step scheduling), the call
    carrying their plans, and what its telemetry needs."""

    outs: list[SchedulerOutput]
    # The call on the worker's step stream: one plan, or several under multi-step scheduling.
    call: StepCall
    span: trace.Span
    clock: PerfClock | None
    profile: StepProfile | None
    # perf_counter() times: the loop iteration that planned it began, its requests were ingested, it was sent.
    started: float
    ingested: float
    sent: float
    # What a commit stores of each step for a new owner while it has not landed.
    records: list[state_pb2.StepRecord]
    # How many of `outs`, from the first, the scheduler counts as run (Scheduler.advance): their samples are
    # tokens in flight until they land.
    num_advanced: int = 0

"""The engine in one process: the scheduler core and a model runner, no Redis, no gRPC.

The offline API (llmserve/offline.py) runs on it by default. It is the services' own code, minus
their transport: admission validates and tokenizes as the scheduler service does, the same core
schedules, planner.build_step builds the same protobuf plan the worker would receive, the worker's
ModelRunner runs it, and the output processor turns the result into the same GenerateResponse
messages a client reads from Redis:

    add_request ──▶ Admission ──▶ OutputProcessor.add ──▶ Scheduler (waiting)
    step:  Scheduler.schedule ─▶ build_step (StepPlan) ─▶ ModelRunner.execute ─▶ OutputProcessor.process
           └──────────────────────────────────────────────────────────▶ [(request id, GenerateResponse)]
"""

from __future__ import annotations

import itertools
import time

from protos import generation_pb2
from scheduler_service.admission import Admission, ModelLimits, to_record
from scheduler_service.output_processor import OutputProcessor
from scheduler_service.planner import Planner, build_step
from scheduler_service.scheduling import SchedulingFlags, scheduler_for
from scheduler_service.store_types import StepCommit
from shared.tokenizer_loading import load_tokenizer
from worker_service.config import WorkerConfig
from worker_service.model_runner import ModelRunner
from worker_service.plan import plan_from_proto
from worker_service.servicer import describe_runner, step_result

# What the engine's records and commits name as their worker.
WORKER_ID = "in-process"


class InProcessEngine:
    """Admits requests and runs steps until they finish, in the calling thread."""

    def __init__(self, worker: WorkerConfig, flags: SchedulingFlags | None = None) -> None:
        flags = flags or SchedulingFlags()
        self._runner = ModelRunner(worker)
        desc = describe_runner(self._runner, worker.model, WORKER_ID, 0)
        self._scheduler = scheduler_for(flags, desc)
        tokenizer = load_tokenizer(worker.model)
        self._admission = Admission(tokenizer, ModelLimits(
            max_model_len=self._scheduler.scheduler_config.max_model_len, vocab_size=desc.vocab_size,
            max_num_seqs=flags.max_num_seqs,
        ))
        self._processor = OutputProcessor(tokenizer, self._scheduler)
        self._planner = Planner(epoch=1)
        self._seq_ids = itertools.count()

    def add_request(self, request: generation_pb2.GenerateRequest) -> str:
        """Validates, tokenizes and queues a request; returns its id. Bad input raises InvalidRequestError."""
        admitted = self._admission.admit(request)
        seq_ids = [next(self._seq_ids) for _ in range(admitted.sampling.num_sequences)]
        self._processor.add(to_record(admitted, seq_ids, WORKER_ID, time.time()))
        return admitted.request_id

    def has_unfinished_requests(self) -> bool:
        return self._scheduler.has_unfinished_requests()

    def step(self) -> list[tuple[str, generation_pb2.GenerateResponse]]:
        """Runs one step; returns the messages it produced, per request, in order (final ones included)."""
        commit = StepCommit(WORKER_ID)
        out = self._scheduler.schedule()
        plan = build_step(out, self._scheduler, self._processor, self._planner, commit)
        if plan is not None:
            result = step_result(self._runner.execute(plan_from_proto(plan), plan))
            self._processor.process(out, result, commit)
        return commit.outputs

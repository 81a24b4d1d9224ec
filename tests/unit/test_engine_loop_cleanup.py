"""The engine loop's per-request state is dropped when requests leave it, whatever ends them.

Drives one loop's planning and postprocessing in memory (no worker, no Redis): every sequence the
worker was sent must later be named in a plan's finished_seq_ids (else the worker caches it until its
next reset), and the planner must keep nothing of it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Set as AbstractSet

from opentelemetry.sdk.trace import TracerProvider

from protos import common_pb2, state_pb2, worker_pb2
from scheduler_service.core.config import CacheConfig, SchedulerConfig
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.engine_loop import EngineLoop
from scheduler_service.fleet import Fleet
from scheduler_service.output_processor import OutputProcessor
from scheduler_service.store import Pickup, StepCommit


class _Tokenizer:
    eos_token_id = None

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(f" t{t}" for t in token_ids)


def _record(request_id: str, first_seq_id: int, prompt: list[int], n: int, max_tokens: int) -> state_pb2.AdmittedRequest:
    return state_pb2.AdmittedRequest(
        request_id=request_id, prompt_token_ids=prompt, seq_ids=list(range(first_seq_id, first_seq_id + n)),
        arrival_time=float(first_seq_id),
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=1.0, n=n, seed=1, ignore_eos=True),
    )


def test_sequences_of_a_request_failed_by_a_full_swap_space_are_dropped_on_the_worker() -> None:
    # a (1 sequence) and b (n=2, forked) fill 7 device blocks; b's 5 blocks cannot fit 4 CPU blocks, so when
    # a needs a slot, swapping b out fails and b ends with an error (tests/unit/test_swap.py, same shape).
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64),
                          CacheConfig(block_size=4, num_gpu_blocks=7, num_cpu_blocks=4, watermark=0.0))
    processor = OutputProcessor(_Tokenizer(), scheduler)
    loop = EngineLoop("w", None, None, scheduler, processor, None)  # type: ignore[arg-type]
    processor.add(_record("a", 0, [1, 2, 3, 4], n=1, max_tokens=12))
    processor.add(_record("b", 1, [5, 6, 7, 8, 9, 10], n=2, max_tokens=12))

    sent: set[int] = set()
    dropped: set[int] = set()
    swap_failures = 0
    commit = StepCommit("w")
    for _ in range(40):
        out, plan = loop._plan(commit)  # noqa: SLF001 - one engine step without a worker
        swap_failures += len(out.swap_failed)
        commit = StepCommit("w")
        if plan is None:
            break
        sent.update(s.seq_id for s in plan.new_sequences)
        dropped.update(plan.finished_seq_ids)
        sampled = [worker_pb2.SampledToken(seq_id=item.seq.seq_id, token_id=100 + item.seq.seq_id, logprob=-1.0)
                   for item in out.scheduled if item.samples]
        processor.process(out, worker_pb2.StepResult(sampled=sampled), commit)

    assert swap_failures == 1
    assert len(processor) == 0 and loop.is_idle
    assert sent == {0, 1, 2}
    assert dropped == sent, f"sequences the worker was never told to drop: {sorted(sent - dropped)}"
    bm = loop._scheduler.block_manager  # noqa: SLF001
    # The per-sequence maps of what the worker holds: a leak grows them.
    assert (bm._num_held, bm._changes, bm.block_tables) == ({}, {}, {})  # noqa: SLF001


class _Router:
    """Another worker to hand requests to."""

    workers = ["w", "other"]

    async def pick(self, request_id: str, prompt: list[int], exclude: AbstractSet[str] = frozenset()) -> str:
        return "other"


def test_requests_handed_over_to_another_worker_leave_no_trace_context_behind() -> None:
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64),
                          CacheConfig(block_size=4, num_gpu_blocks=8))
    processor = OutputProcessor(_Tokenizer(), scheduler)
    fleet = Fleet(None, None, _Router())  # type: ignore[arg-type]
    tracer = TracerProvider().get_tracer("test")
    # No registration: the worker left, so every request moves to "other".
    loop = EngineLoop("w", None, None, scheduler, processor, fleet, tracer=tracer, registration=None)  # type: ignore[arg-type]
    commit = StepCommit("w")
    records = [_record(f"r{i}", 10 * i, [1, 2, 3], n=1, max_tokens=4) for i in range(3)]
    for i, record in enumerate(records):
        record.traceparent = f"00-{'ab' * 16}-{i + 1:016x}-01"
    asyncio.run(loop._ingest(Pickup(records, []), commit))  # noqa: SLF001 - what a commit's pickup hands the loop
    assert len(loop._telemetry._request_spans) == 3  # noqa: SLF001

    assert asyncio.run(loop._follow_registration(commit)) is False  # noqa: SLF001 - idle and departed: ends
    assert [r.request_id for r, target in commit.handed_over if target == "other"] == ["r0", "r1", "r2"]
    assert len(processor) == 0
    assert loop._telemetry._request_spans == {}  # noqa: SLF001 - the per-request map the hand-over left behind


class _Store:
    """Records the aborts a loop forwards."""

    def __init__(self) -> None:
        self.forwarded: list[tuple[list[str], str]] = []

    async def route_aborts(self, request_ids: list[str], skip_worker: str = "") -> int:
        self.forwarded.append((request_ids, skip_worker))
        return len(request_ids)


def test_aborts_of_requests_the_loop_no_longer_holds_go_on_to_their_current_worker() -> None:
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64),
                          CacheConfig(block_size=4, num_gpu_blocks=8))
    processor = OutputProcessor(_Tokenizer(), scheduler)
    store = _Store()
    loop = EngineLoop("w", None, store, scheduler, processor, None)  # type: ignore[arg-type]
    commit = StepCommit("w")
    asyncio.run(loop._ingest(Pickup([_record("here", 0, [1, 2, 3], n=1, max_tokens=4)], []), commit))  # noqa: SLF001
    asyncio.run(loop._ingest(Pickup([], ["here", "moved"]), commit))  # noqa: SLF001
    assert commit.finished_requests == ["here"] and len(processor) == 0  # aborted here
    assert store.forwarded == [(["moved"], "w")]  # handed over (or finished) before: forwarded, never to itself
    asyncio.run(loop._ingest(Pickup([], []), commit))  # noqa: SLF001
    assert len(store.forwarded) == 1  # nothing to forward: no round trip

"""Each way a takeover finds the worker, made certain: the old owner stops at a chosen point of its loop.

A real worker process (tiny model) and a real redis-server; the old owner is driven step by step with the
engine loop's parts (scheduler, output processor, planner, journal, store), the way its sync loop runs:
plan and send step N, commit (N's plan, N-1's results) beside it, land N. It stops

- after committing N's plan, with the worker having run N: the new owner lands N from the kept result;
- after sending N+1 and before committing it: the new owner lands N, plans N+1 itself, finds it is the
  step the worker ran and lands it too;
- after committing N's plan and before sending N: the worker never ran N, its block operations (a fork's
  copy-on-write) are replayed;

The same three points are taken in the async loop (plan and send N+1, commit beside it, land N, count N+1 as
run), whose commits also hold a step counted as run and not landed: the new owner lands it first, and
plans the step after N (when the worker ran it) with N in flight, as the old owner did.

Under multi-step scheduling (a call of several decode steps, all counted as run as they are planned) the
first two points: the new owner lands every step of the committed call, then plans the next call's steps
itself, each with the one before in flight, and lands them too.

A new owner (WorkerResume, the engine loop's takeover) continues. Every request must end with
transformers' greedy tokens, and the worker must have computed no token twice.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import redis
from transformers import AutoTokenizer

from llmserve.client import make_request
from llmserve.local_cluster import wait_serving
from protos import generation_pb2, state_pb2, worker_pb2, worker_pb2_grpc
from scheduler_service import keys
from scheduler_service.admission import Admission, ModelLimits, to_record
from scheduler_service.multi_step import is_steady_decode, plan_call
from scheduler_service.core.scheduler_output import SchedulerOutput
from scheduler_service.core.sequence import SequenceStatus
from scheduler_service.output_processor import OutputProcessor
from scheduler_service.planner import Planner, build_step
from scheduler_service.resume import WorkerResume
from scheduler_service.scheduling import SchedulingFlags, scheduler_for
from scheduler_service.state_journal import StateJournal, step_record
from scheduler_service.step_stream import StepCall, StepStream
from scheduler_service.store import RedisStore, StepCommit
from shared.redis_server import RedisServer, free_port
from tests.hf_reference import HFReference, compare_greedy

W = "worker-under-test"
MAX_NEW = 10
PROMPTS = [list(range(300, 337)), list(range(900, 915)), [5] * 40]


@pytest.fixture(scope="module")
def worker_address(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    log = tmp_path_factory.mktemp("worker") / "worker.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "llmserve", "worker", "--model", str(tiny_llama_dir), "--host", "127.0.0.1",
             "--port", str(port), "--num-gpu-blocks-override", "64", "--max-model-len", "256", "--num-threads", "1"],
            stdout=out, stderr=subprocess.STDOUT,
        )
    try:
        if not wait_serving(f"127.0.0.1:{port}", 120, lambda: proc.poll() is None or pytest.fail(log.read_text())):
            pytest.fail(f"worker not ready: {log.read_text()}")
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=15)


class Owner:
    """One engine loop's parts, driven by hand as its sync loop drives them."""

    def __init__(self, epoch: int, stub: worker_pb2_grpc.WorkerStub, store: RedisStore, tokenizer: object,
                 desc: worker_pb2.WorkerDescription) -> None:
        self.stub, self.store = stub, store
        self.steps = StepStream(stub)
        self.scheduler = scheduler_for(SchedulingFlags(enable_prefix_caching=True, max_num_seqs=8), desc)
        self.processor = OutputProcessor(tokenizer, self.scheduler)
        self.planner = Planner(epoch)
        self.journal = StateJournal()
        self.journal.restart(desc.instance_id)
        self.pending = StepCommit(W)
        # Async loop: the step counted as run and not landed, with its call.
        self.inflight: tuple[SchedulerOutput, worker_pb2.StepPlan, StepCall] | None = None
        # Multi-step loop: the steps of the call whose commit runs beside it.
        self.call_steps: list[state_pb2.StepRecord] = []

    def plan(self, commit: StepCommit) -> tuple[SchedulerOutput, worker_pb2.StepPlan | None]:
        out = self.scheduler.schedule()
        return out, build_step(out, self.scheduler, self.processor, self.planner, commit)

    async def commit(self, unlanded: worker_pb2.StepPlan | None = None, out: SchedulerOutput | None = None) -> None:
        c, self.pending = self.pending, StepCommit(W)
        c.epoch = self.planner.epoch
        record = step_record(unlanded, out) if unlanded is not None else None
        inflight = [step_record(self.inflight[1], self.inflight[0])] if self.inflight is not None else []
        inflight += self.call_steps
        self.journal.write(self.scheduler, c, record, (self.planner.epoch, self.planner.last_step_id), inflight)
        pickup = await self.store.commit(c)
        for admitted in pickup.admitted:
            self.processor.add(admitted)

    async def step(self, stop_at: str = "") -> str:
        """One loop iteration; returns where it stopped ("" when it ran whole, "idle" when nothing to run)."""
        out, plan = self.plan(self.pending)
        if plan is None:
            await self.commit()
            return "idle"
        if stop_at == "before_send":
            await self.commit(plan, out)
            return stop_at
        result = (await (await self.steps.send([plan], 60, {}))).results[0]
        if stop_at == "unlanded_next":
            return stop_at  # sent and run, its commit never made
        await self.commit(plan, out)
        if stop_at == "unlanded":
            return stop_at
        self.processor.process(out, result, self.pending)
        return ""

    async def async_step(self, stop_at: str = "") -> str:
        """One iteration of the async loop: plan and send N+1, commit beside it, land N, count N+1 as run."""
        out, plan = self.plan(self.pending)
        if plan is None:
            await self.commit()
            if self.inflight is None:
                return "idle"
            await self.land_inflight()
            return ""
        if stop_at == "before_send":
            await self.commit(plan, out)
            assert self.inflight is not None
            await self.inflight[2]  # the worker ran the step in flight, never the planned one
            return stop_at
        call = await self.steps.send([plan], 60, {})
        if stop_at == "unlanded_next":
            await call
            return stop_at  # sent and run, its commit never made
        await self.commit(plan, out)
        if stop_at == "unlanded":
            await call  # the worker ran both
            return stop_at
        if self.inflight is not None:
            await self.land_inflight()
        self.scheduler.advance(out)
        self.inflight = (out, plan, call)
        return ""

    async def multi_step(self, stop_at: str = "") -> str:
        """One iteration of the sync loop under multi-step scheduling (MULTI_STEPS steps a call): plan the call,
        send it, commit beside it, land every step."""
        call = plan_call(self.scheduler, lambda: self.plan(self.pending), MULTI_STEPS,
                         lambda out: is_steady_decode(self.scheduler, out))
        if call is None:
            await self.commit()
            return "idle"
        if call.num_advanced:
            self.call_steps = [step_record(plan, out) for plan, out in zip(call.plans, call.outs)]
        results = list((await (await self.steps.send(call.plans, 60, {}))).results)
        if stop_at == "unlanded_next":
            return stop_at  # sent and run, its commit never made
        if call.num_advanced:
            await self.commit()
        else:
            await self.commit(call.plans[0], call.outs[0])
        self.call_steps = []
        if stop_at == "unlanded":
            return stop_at
        for i, (out, result) in enumerate(zip(call.outs, results)):
            self.processor.process(out, result, self.pending, advanced=i < call.num_advanced)
        return ""

    async def land_inflight(self) -> None:
        assert self.inflight is not None
        (out, _, call), self.inflight = self.inflight, None
        self.processor.process(out, (await call).results[0], self.pending, advanced=True)


def _fork_copies(owner: Owner) -> bool:
    """Whether the next step forks a request (its children copy the parent's last block on write)."""
    return any(
        parent.num_computed_tokens == len(parent.prompt_token_ids) - 1
        for g in owner.scheduler.running if g.pending_fork_seqs() for parent in g.get_seqs(SequenceStatus.RUNNING))


# (where the old owner stops, steps the new owner lands, whether it stops at a fork step, the loop)
CASES = [("unlanded", 1, False, "sync"), ("unlanded_next", 2, False, "sync"), ("before_send", 0, True, "sync"),
         ("unlanded", 2, False, "async"), ("unlanded_next", 3, False, "async"), ("before_send", 1, True, "async"),
         ("unlanded", 3, False, "multi_step"), ("unlanded_next", 6, False, "multi_step")]
MULTI_STEPS = 3


@pytest.mark.parametrize(("stop_at", "landed", "fork", "loop"), CASES)
def test_a_new_owner_continues_wherever_the_old_one_stopped(
    worker_address: str, tiny_llama_dir: Path, stop_at: str, landed: int, fork: bool, loop: str
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)

    async def main() -> tuple[dict[str, dict[int, list[int]]], int, object]:
        with RedisServer() as server:
            store = RedisStore.from_url(server.url)
            plain = redis.Redis.from_url(server.url)
            channel = grpc.aio.insecure_channel(worker_address)
            stub = worker_pb2_grpc.WorkerStub(channel)
            try:
                desc = await stub.Describe(worker_pb2.DescribeRequest(), timeout=10)
                plain.set(keys.epoch(W), 1000 + 10 * CASES.index((stop_at, landed, fork, loop)))
                epoch = int(plain.get(keys.epoch(W)))
                await stub.Reset(worker_pb2.ResetRequest(epoch=epoch), timeout=10)
                recomputed_before = desc.num_recomputed_tokens
                old = Owner(epoch, stub, store, tokenizer, desc)
                admission = Admission(tokenizer, ModelLimits(max_model_len=256, vocab_size=desc.vocab_size))
                for i, prompt in enumerate(PROMPTS):
                    # The last request forks two sequences (greedy both: top_k=1).
                    sampling = dict(n=2, temperature=1.0, top_k=1) if i == 2 else dict(temperature=0.0)
                    admitted = admission.admit(make_request(request_id=f"r{i}", prompt_token_ids=prompt,
                                                            max_tokens=MAX_NEW, ignore_eos=True, **sampling))
                    record = to_record(admitted, await store.reserve_seq_ids(admitted.sampling.num_sequences), W, i)
                    await store.admit(record)
                await old.commit()  # picks them up
                step = {"sync": old.step, "async": old.async_step, "multi_step": old.multi_step}[loop]
                if fork:
                    # Stop right at the fork step, whose copy-on-write the replay must do.
                    while not _fork_copies(old):
                        assert await step() == ""
                else:
                    for _ in range(3):
                        assert await step() == ""
                if stop_at == "unlanded_next":
                    # Step N runs whole (its plan committed beside it, landed after); N+1 runs, uncommitted.
                    assert await step() == ""
                assert await step(stop_at) == stop_at

                plain.incr(keys.epoch(W))
                new = Owner(epoch + 1, stub, store, tokenizer, desc)
                resume = WorkerResume(W, stub, new.scheduler, new.processor, new.planner, new.plan)
                state = await store.load_engine_state(W)
                assert state is not None
                if loop == "multi_step":  # every step of the call counts as run
                    assert state.step is None and len(state.inflight) == MULTI_STEPS
                else:
                    assert state.step is not None
                    assert bool(state.step.copy) == fork  # the fork step's copy-on-write, to replay
                    assert len(state.inflight) == (loop == "async")
                resumed = await resume.run(state, new.pending)
                assert resumed is not None and not resumed.needs_reset
                assert (resumed.landed_steps, resumed.continued, resumed.recomputed) == (landed, len(PROMPTS), 0)
                await new.commit()
                # Every landed token is in the stored token lists (a commit of two landed steps kept both), which
                # the next owner (or a recompute) continues from.
                for group in new.scheduler.running:
                    for seq in group.seqs:
                        stored = [int(t) for t in plain.lrange(keys.seq_tokens(seq.seq_id), 0, -1)]
                        assert stored == seq.output_token_ids, (seq.seq_id, stored, seq.output_token_ids)
                for _ in range(100):
                    if await new.step() == "idle" and not new.scheduler.has_unfinished_requests():
                        break
                recomputed = (await stub.Describe(worker_pb2.DescribeRequest(), timeout=10)).num_recomputed_tokens
                outputs: dict[str, dict[int, list[int]]] = {}
                for i in range(len(PROMPTS)):
                    for _id, fields in plain.xrange(keys.output_stream(f"r{i}")):
                        for delta in generation_pb2.GenerateResponse.FromString(fields[b"m"]).outputs:
                            outputs.setdefault(f"r{i}", {}).setdefault(delta.index, []).extend(delta.token_ids)
                return outputs, recomputed - recomputed_before, resumed
            finally:
                await channel.close()
                await store.close()
                plain.close()

    outputs, recomputed, _ = asyncio.run(main())
    assert recomputed == 0
    reference = HFReference(str(tiny_llama_dir))
    for i, expected in enumerate(reference.greedy_many(PROMPTS, MAX_NEW, stop_at_eos=False)):
        streams = outputs[f"r{i}"]
        assert sorted(streams) == ([0, 1] if i == 2 else [0])
        for index, tokens in streams.items():
            cmp = compare_greedy(tokens, expected)
            assert cmp.matched, f"r{i}[{index}]: {cmp.detail}"

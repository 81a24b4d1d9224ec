"""A new owner continues a worker on the KV cache it kept: fence, rebuild, land, resume.

    1. fence only   Reset(epoch, keep_cache): the old owner can no longer run a step; the worker
                    answers with its instance id and the last steps it ran (results included).
    2. rebuild      the scheduler from the state the old owner committed (takeover.py), exactly.
    3. land         the stored state is "step N planned, not landed" (with async scheduling also "step
                    N-1 counted as run, its samples in flight": the worker ran it, its result lands
                    first). If the worker ran N, its kept result lands here (tokens appended, outputs
                    published): nothing is computed again. If it ran the step after N as well (sent
                    before the old owner's next commit returned), this owner plans that step itself,
                    as the old owner did (with N in flight under async scheduling), and when the plan
                    is the one the worker ran (same sequences, token counts, tables and block
                    operations) lands its result too. If the worker never ran N, N's block operations
                    are replayed. Under multi-step scheduling the state is "the steps of one call counted
                    as run": each lands in turn, and the worker's next call, when it ran one, is planned
                    step by step as the old owner did (each with the one before in flight) and landed.
    4. resume       Resume(views): the worker checks each running sequence's tokens and blocks against
                    its cache and keeps the ones that match, as the views have them (the block manager
                    marks those tables held: the next steps send them as deltas); the others are
                    recomputed here (and the prefix cache is forgotten when the worker's cache disagreed
                    with the stored state).

Only a restarted worker (another instance id), a step in flight that the worker never ran, or no
stored state at all make the new owner recompute everything. A step that reached the worker runs even
when its caller is gone (worker_service/servicer.py), so "never ran" is left to a plan that never
reached the worker.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from protos import state_pb2, worker_pb2, worker_pb2_grpc
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.core.scheduler_output import SchedulerOutput
from scheduler_service.core.sequence import SequenceStatus
from scheduler_service.core.snapshot import (
    load_snapshot,
    restore_inflight_step,
    restore_scheduler,
    restore_step,
    snapshot_scheduler,
)
from scheduler_service.output_processor import OutputProcessor
from scheduler_service.planner import Planner, sequence_sampling
from scheduler_service.store import StepCommit, StoredEngineState
from scheduler_service.takeover import takeover_from_store

log = logging.getLogger(__name__)

# Deadline of a Reset (full or fence-only) and of a Resume: both wait for a step still running on the worker.
RESET_TIMEOUT_SECONDS = 30.0


@dataclass
class Resumed:
    """How a takeover went: the worker's instance, what was continued, what is recomputed."""

    instance_id: str
    # Requests continued on the worker's cache, and recomputed.
    continued: int
    recomputed: int
    # Steps of the old owner landed from the worker's kept results.
    landed_steps: int
    # The records of every request the loop now holds.
    records: list[state_pb2.AdmittedRequest]
    # The worker failed the Resume: every request is queued for recompute, the worker must be reset.
    needs_reset: bool = False


def _key(step: worker_pb2.ExecutedStep | state_pb2.StepRecord) -> tuple[int, int]:
    return step.epoch, step.step_id


def _ops(step: worker_pb2.ExecutedStep | state_pb2.StepRecord) -> tuple[list[tuple[int, int]], ...]:
    """The step's swap-in, swap-out and copy pairs, as a SchedulerOutput holds them."""
    return tuple([(p.src, p.dst) for p in pairs] for pairs in (step.swap_in, step.swap_out, step.copy))


class WorkerResume:
    """Steps 1 to 4 of the module doc for one engine loop (its scheduler, processor and planner)."""

    def __init__(self, worker_id: str, stub: worker_pb2_grpc.WorkerStub, scheduler: Scheduler,
                 processor: OutputProcessor, planner: Planner,
                 plan_step: Callable[[StepCommit], tuple[SchedulerOutput, worker_pb2.StepPlan | None]]) -> None:
        self._worker_id = worker_id
        self._stub = stub
        self._scheduler = scheduler
        self._processor = processor
        self._planner = planner
        # The loop's own planning (EngineLoop._plan): the step after a landed one is planned through it.
        self._plan_step = plan_step

    async def run(self, state: StoredEngineState, commit: StepCommit) -> Resumed | None:
        """Continues the worker from `state`; None (nothing changed here) when it must be recomputed instead."""
        try:
            takeover = takeover_from_store(state)
        except ValueError as exc:
            log.warning("worker %s: its stored state cannot be continued (%s): recomputing its requests",
                        self._worker_id, exc)
            return None
        epoch = self._planner.epoch
        try:
            fenced = await self._stub.Reset(worker_pb2.ResetRequest(epoch=epoch, keep_cache=True),
                                            timeout=RESET_TIMEOUT_SECONDS)
        except grpc.aio.AioRpcError as exc:
            log.warning("worker %s unreachable for a fence-only reset (%s)", self._worker_id, exc.code())
            return None
        if fenced.instance_id != state.instance_id:
            log.info("worker %s restarted since its state was stored (instance %s, stored %s): recomputing",
                     self._worker_id, fenced.instance_id, state.instance_id or "none")
            return None
        ran = {_key(s) for s in fenced.last_steps}
        never_ran = [_key(r) for r in state.inflight if _key(r) not in ran]
        if never_ran:
            log.warning("worker %s never ran step %s, which its stored state counts as run: recomputing",
                        self._worker_id, never_ran[0])
            return None
        try:
            load_snapshot(self._scheduler, takeover.snapshot)
        except ValueError as exc:
            log.warning("worker %s: its stored state is inconsistent (%s): recomputing", self._worker_id, exc)
            return None
        for request_id, request in takeover.continued.items():
            group = self._scheduler.group(request_id)
            assert group is not None  # load_snapshot put every continued request in the queues
            self._processor.adopt(request, group)
        for request in takeover.recomputed:
            self._processor.restore(request)
        records = [r.record for r in (*takeover.continued.values(), *takeover.recomputed)]
        continued = {seq_id for r in takeover.continued.values() for seq_id in r.record.seq_ids}
        landed, replay, trusted = self._land(state, list(fenced.last_steps), continued, commit)
        refused = await self._resume_sequences(epoch, replay)
        if refused is None:
            groups = [*self._scheduler.running, *self._scheduler.swapped]
            for group in groups:
                self._processor.recompute(group)
            return Resumed(fenced.instance_id, 0, len(takeover.recomputed) + len(groups), landed, records, True)
        if not trusted or any(not r.not_cached for r in refused):
            # The worker ran something the stored state does not know of: a cached block may hold other KV.
            self._scheduler.reset_prefix_cache()
        recompute = {r.seq_id for r in refused}
        groups = [g for g in self._scheduler.running if any(s.seq_id in recompute for s in g.seqs)]
        for group in groups:
            self._processor.recompute(group)
        for r in refused:
            log.warning("worker %s: seq %d is recomputed: %s", self._worker_id, r.seq_id, r.reason)
        for group in self._scheduler.running:
            for seq in group.get_seqs(SequenceStatus.RUNNING):
                self._scheduler.block_manager.mark_held(seq)
        num_continued = len(takeover.continued) - len(groups)
        return Resumed(fenced.instance_id, num_continued, len(takeover.recomputed) + len(groups), landed, records)

    def _land(self, state: StoredEngineState, steps: list[worker_pb2.ExecutedStep], continued: set[int],
              commit: StepCommit) -> tuple[int, state_pb2.StepRecord | None, bool]:
        """Lands what the worker ran beyond the stored state (step 3) for the `continued` sequences (the
        recomputed ones start over). Returns the steps landed, the block operations to replay (a step the
        worker never ran) and whether the worker ran nothing the state does not account for."""
        executed = {_key(s): s for s in steps}
        newest = _key(steps[-1]) if steps else (0, 0)
        known = state.last_sent
        landed = 0
        for inflight in state.inflight:  # run() checked that the worker ran them
            # Rebuilt only once the one before has landed: each samples the oldest of its sequences' tokens in flight.
            out = restore_inflight_step(self._scheduler, [(t.seq_id, t.num_new_tokens, t.num_computed_tokens)
                                                          for t in inflight.scheduled if t.seq_id in continued])
            result = _only(executed[_key(inflight)].result, out)
            self._processor.process(out, result, commit, advanced=True)
            landed += 1
        # A landed step counted as run while the next one is planned (as the old owner did under async
        # scheduling), its result processed after that planning.
        in_flight: tuple[SchedulerOutput, worker_pb2.StepResult] | None = None
        record = state.step
        if record is not None:
            key = _key(record)
            if key in executed:
                # Less the sequences a landed step in flight ended with their whole request.
                sched = self._scheduler
                held = {s.seq_id for g in (*sched.waiting, *sched.running, *sched.swapped) for s in g.seqs}
                scheduled = [(t.seq_id, t.num_new_tokens) for t in record.scheduled
                             if t.seq_id in continued and t.seq_id in held]
                out = restore_step(self._scheduler, scheduled, *_ops(record))
                result = _only(executed[key].result, out)
                if state.inflight and newest > key:
                    self._scheduler.advance(out)
                    in_flight = (out, result)
                else:
                    self._processor.process(out, result, commit)
                landed += 1
            elif newest < key:
                return landed, record, True
            known = key
        if newest <= known:
            return landed, None, True
        # The worker ran the call after the stored steps: land it if this owner plans exactly its steps.
        after = [s for s in steps if _key(s) > known]
        planned = self._plan_after(after, commit) if [_key(s) for s in after] == [
            (known[0], known[1] + 1 + i) for i in range(len(after))] else None
        if in_flight is not None:
            self._processor.process(*in_flight, commit, advanced=True)
        if planned is not None:
            for i, (out, step) in enumerate(zip(planned, after)):
                self._processor.process(out, step.result, commit, advanced=i < len(planned) - 1)
            return landed + len(planned), None, True
        log.warning("worker %s ran step %s, which the stored state does not account for: its sequences are "
                    "checked against the cache and the prefix cache is forgotten", self._worker_id, newest)
        return landed, None, False

    def _plan_after(self, after: list[worker_pb2.ExecutedStep], commit: StepCommit) -> list[SchedulerOutput] | None:
        """Plans the steps of `after` as the last owner did, each once the one before counts as run (the steps of
        one multi-step call; otherwise a single step); None (nothing planned) unless each is exactly the step the
        worker ran."""
        scratch = restore_scheduler(self._scheduler.scheduler_config, self._scheduler.cache_config,
                                    snapshot_scheduler(self._scheduler))
        out: SchedulerOutput | None = None
        for step in after:
            if out is not None:
                scratch.advance(out)
            out = scratch.schedule()
            if not _same_step(scratch, out, step):
                return None
        planned: list[SchedulerOutput] = []
        for step in after:
            if planned:
                self._scheduler.advance(planned[-1])
            out, _ = self._plan_step(commit)
            if not _same_step(self._scheduler, out, step):  # the same schedule on the same state: cannot differ
                raise RuntimeError("planning the same state twice gave two different steps")
            planned.append(out)
        return planned

    async def _resume_sequences(self, epoch: int, replay: state_pb2.StepRecord | None
                                ) -> list[worker_pb2.RefusedSequence] | None:
        """Resume (step 4), replaying first the block operations of `replay` (a step the worker never ran)."""
        ops = replay if replay is not None else state_pb2.StepRecord()
        request = worker_pb2.ResumeSequencesRequest(epoch=epoch, swap_in=ops.swap_in, swap_out=ops.swap_out,
                                                    copy=ops.copy)
        bm = self._scheduler.block_manager
        for group in self._scheduler.running:
            for seq in group.get_seqs(SequenceStatus.RUNNING):
                request.sequences.add(
                    seq_id=seq.seq_id, prompt_token_ids=seq.prompt_token_ids, output_token_ids=seq.output_token_ids,
                    sampling=sequence_sampling(group, seq), block_table=bm.logical_block_table(seq),
                    num_computed_tokens=seq.num_computed_tokens,
                )
        try:
            response = await self._stub.Resume(request, timeout=RESET_TIMEOUT_SECONDS)
        except grpc.aio.AioRpcError as exc:
            log.warning("worker %s failed to resume its sequences (%s)", self._worker_id, exc.code())
            return None
        return list(response.refused)


def _only(result: worker_pb2.StepResult, out: SchedulerOutput) -> worker_pb2.StepResult:
    """The step's result for the sequences of `out` only."""
    seq_ids = {s.seq.seq_id for s in out.scheduled}
    kept = worker_pb2.StepResult(step_id=result.step_id, execute_seconds=result.execute_seconds)
    kept.sampled.extend(s for s in result.sampled if s.seq_id in seq_ids)
    kept.prompt_logprobs.extend(p for p in result.prompt_logprobs if p.seq_id in seq_ids)
    return kept


def _same_step(scheduler: Scheduler, out: SchedulerOutput, step: worker_pb2.ExecutedStep) -> bool:
    """Whether `out` (planned on `scheduler`) is the step the worker ran: sequences, counts, tables, operations.

    The worker reports the tables with its newest step only (the tables as they are now): an older step of a
    multi-step call is compared without them, its call's last step with them."""
    bm = scheduler.block_manager
    tables = any(e.block_table for e in step.sequences)
    mine = sorted((s.seq.seq_id, s.num_computed_tokens, s.num_new_tokens,
                   tuple(bm.logical_block_table(s.seq)) if tables else ()) for s in out.scheduled)
    theirs = sorted((e.seq_id, e.num_computed_tokens, e.num_new_tokens, tuple(e.block_table)) for e in step.sequences)
    return mine == theirs and (out.blocks_to_swap_in, out.blocks_to_swap_out, out.blocks_to_copy) == _ops(step)

"""One engine loop per worker: schedule -> execute -> postprocess, committed to Redis.

    iteration N:   ingest pickups, schedule, build plan N
                   ├── worker executes plan N ─────────┐   (concurrently)
                   └── Redis commits results of N-1 ───┘   + picks up new requests/aborts
                   postprocess results of N in memory (published by commit N, next iteration)

Committing step N-1 while the worker computes step N hides the Redis round
trip; tokens still reach clients only after their step is committed.

With async scheduling (--async-scheduling) plan N+1 is built and sent while the
worker still runs step N, and the results of N land after it:

    iteration N+1: ingest, schedule + send plan N+1 (queued on the worker behind N)
                   ├── worker finishes N, starts N+1 at once ─┐
                   └── Redis commits results of N-1 ──────────┘
                   land N: its tokens resolved and postprocessed; advance N+1

The scheduler counts step N's samples as tokens in flight (Scheduler.advance) and the worker decodes them
from its own samples, so no step waits for the scheduler. A sequence that step N ends by a stop token runs
once more in N+1; that token is dropped. EngineLoop._may_overlap says when a step lands before the next.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import grpc
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from protos import worker_pb2, worker_pb2_grpc
from scheduler_service import keys
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.core.scheduler_output import SchedulerOutput
from scheduler_service.fleet import Fleet
from scheduler_service.multi_step import is_steady_decode, plan_call
from scheduler_service.output_processor import OutputProcessor
from scheduler_service.planner import Planner, build_step
from scheduler_service.step_profile import StepProfile, StepProfileWriter
from scheduler_service.step_stream import StepStream
from scheduler_service.step_telemetry import StepTelemetry
from scheduler_service.resume import RESET_TIMEOUT_SECONDS, WorkerResume
from scheduler_service.sent_step import SentStep
from scheduler_service.state_journal import StateJournal, step_record
from scheduler_service.store import Pickup, RedisStore, RestoredRequest, StepCommit
from shared import defaults
from shared.metrics import EngineMetrics
from shared.tracing import PerfClock, trace_carrier
from shared.worker_registry import WorkerEntry

log = logging.getLogger(__name__)

_T = TypeVar("_T")


async def _timed(awaitable: Awaitable[_T]) -> tuple[_T, float, float]:
    """The awaitable's result, when it started and how long it took (its own wall time, whatever ran beside it)."""
    started = time.perf_counter()
    result = await awaitable
    return result, started, time.perf_counter() - started

# How long an idle loop blocks on its worker's queue before it looks round (a lost lease, a drain).
IDLE_WAIT_SECONDS = 1.0
# A worker that leaves or drains gets requests handed over only when one came back from a target that
# went away meanwhile (or a router's view was a tick old): the pause before handing them on again lets
# the routers' next tick (about a second) learn of it, rather than sending them round in a tight loop.
HAND_ON_PAUSE_SECONDS = 0.25


class EngineLoop:
    """Drives one worker from the state of its scheduler core."""

    def __init__(
        self,
        worker_id: str,
        stub: worker_pb2_grpc.WorkerStub,
        store: RedisStore,
        scheduler: Scheduler,
        processor: OutputProcessor,
        fleet: Fleet,
        profile_path: Path | None = None,
        tracer: trace.Tracer | None = None,
        metrics: EngineMetrics | None = None,
        # Every worker RPC has a deadline: a step past it counts as a failed worker (reset, recompute).
        step_timeout_s: float = defaults.STEP_TIMEOUT_S,
        channel: grpc.aio.Channel | None = None,
        registration: WorkerEntry | None = None,
        on_owned: Callable[[str, int], None] | None = None,
        async_scheduling: bool = False,
        num_scheduler_steps: int = 1,
    ) -> None:
        self.worker_id = worker_id
        # Told (worker id, epoch) each time the loop owns its worker: the replica's start-up reports the first.
        self._on_owned = on_owned
        self._fleet = fleet
        self._channel = channel
        self._registration = registration
        # The instance id this loop reported drained (once per draining instance).
        self._drained_instance = ""
        self._step_timeout_s = step_timeout_s
        self._stub = stub
        # Every step goes out on one stream (step_stream.py); Describe, Reset and Resume are unary calls.
        self._steps_out = StepStream(stub)
        self._store = store
        self._scheduler = scheduler
        self._processor = processor
        self._planner = Planner(epoch=0)
        self._async_scheduling = async_scheduling
        # The most steps one call to the worker may carry (multi-step scheduling; 1: one step a call).
        self._num_scheduler_steps = num_scheduler_steps
        self.steps = 0
        # perf_counter() when the last landed step's result came back.
        self._last_stepped = 0.0
        # time.monotonic() of the last completed step, or of the last moment the loop was idle:
        # liveness (scheduler_service/health.py) flags a loop holding work that has not stepped since.
        self.last_progress = time.monotonic()
        self._journal = StateJournal()
        # The calls sent and not landed yet: planned only, and advanced (async scheduling: its samples are the
        # tokens in flight; a multi-step call is advanced as it is sent). A commit stores records of both for a
        # new owner.
        self._unlanded: SentStep | None = None
        self._inflight: SentStep | None = None
        self._profiles = StepProfileWriter(profile_path) if profile_path is not None else None
        # Spans and metrics are built from the same per-step measurements as --profile-steps.
        self._telemetry = StepTelemetry(worker_id, scheduler, processor, tracer, metrics)
        self._measure = self._profiles is not None or self._telemetry.enabled
        processor.record_timings = self._telemetry.enabled

    @property
    def num_requests(self) -> int:
        """Requests waiting, running or swapped on this loop."""
        return self._scheduler.get_num_unfinished_requests()

    @property
    def is_idle(self) -> bool:
        """No request is waiting, running or swapped on this loop."""
        return not self._scheduler.has_unfinished_requests()

    def observe_registration(self, entry: WorkerEntry | None) -> None:
        """What the worker registry says of this loop's worker (None: no longer registered)."""
        self._registration = entry

    def _plan(self, commit: StepCommit, profile: StepProfile | None = None
              ) -> tuple[SchedulerOutput, worker_pb2.StepPlan | None]:
        started = time.perf_counter()
        out = self._scheduler.schedule()
        scheduled = time.perf_counter()
        plan = build_step(out, self._scheduler, self._processor, self._planner, commit)
        if profile is not None:
            profile.schedule_s = scheduled - started
            profile.plan_s = time.perf_counter() - scheduled
            profile.num_seqs = len(out.scheduled)
            profile.num_prefill_tokens = out.num_prefill_tokens
            profile.num_decode_tokens = out.num_batched_tokens - profile.num_prefill_tokens
            if self._profiles is not None:  # O(allocated blocks): only the profile file reports it
                profile.kv_slots, profile.kv_tokens = self._scheduler.kv_occupancy()
        return out, plan

    async def _ingest(self, pickup: Pickup, commit: StepCommit) -> None:
        for record in pickup.admitted:
            self._processor.add(record)
            self._telemetry.remember(record)
        # From a worker that left or drains: recomputed here from prompt + the outputs committed there.
        self._recompute(pickup.handed_over, "took over %d request(s) from another worker")
        unknown = [r for r in pickup.aborts if not self._processor.abort(r, commit)]
        if unknown:
            # Finished here already, or handed over to another worker before the abort arrived: the
            # latter's abort goes on to the loop that runs the request now.
            await self._store.route_aborts(unknown, skip_worker=self.worker_id)

    async def _resume(self, commit: StepCommit, stop: asyncio.Event) -> bool:
        """Continues on the KV cache the worker kept, from the state its last owner stored (resume.py);
        False when there is none to continue from (then everything is recomputed)."""
        state = await self._store.load_engine_state(self.worker_id)
        if state is None:
            return False
        resume = WorkerResume(self.worker_id, self._stub, self._scheduler, self._processor, self._planner, self._plan)
        try:
            resumed = await resume.run(state, commit)
        except Exception:
            # A bug, not a fault: the loop fails (logged with its traceback) and the replica's next loop for
            # the worker recomputes instead of trying the same state again.
            await self._store.invalidate_engine_state(self.worker_id)
            raise
        if resumed is None:
            return False
        for record in resumed.records:
            self._telemetry.remember(record)
        self._journal.restart(resumed.instance_id)
        epoch = self._planner.epoch
        log.info("engine loop for worker %s owns epoch %d: continued %d request(s) on its KV cache, %d recomputed, "
                 "%d step(s) of the last owner landed", self.worker_id, epoch, resumed.continued, resumed.recomputed,
                 resumed.landed_steps)
        if resumed.needs_reset:
            await self._own_worker(stop)
        elif self._on_owned is not None:
            self._on_owned(self.worker_id, epoch)
        return True

    def _recompute(self, requests: list[RestoredRequest], message: str) -> None:
        """Queues requests to be recomputed from their prompts and committed outputs."""
        for request in requests:
            self._processor.restore(request)
            self._telemetry.remember(request.record)
        if requests:
            log.info("worker %s: " + message, self.worker_id, len(requests))

    async def run(self, stop: asyncio.Event) -> None:
        """Runs until `stop` is set."""
        try:
            pending = StepCommit(self.worker_id)
            # Fence first: once the epoch has moved on, a loop that drove this worker before (its lease lost,
            # a commit of it still in flight) can take nothing more off the inbox, so the restore sees it all.
            self._planner.reset(await self._fleet.leases.next_epoch(self.worker_id, self._worker_epoch()))
            if not await self._resume(pending, stop):
                # The worker is reset: what the last owner picked up is recomputed (the first commit replaces
                # the stored scheduler state).
                restored = await self._store.load_picked_up(self.worker_id)
                self._recompute(restored, "continuing %d request(s) of the previous owner")
                await self._own_worker(stop)
            self._telemetry.baseline()
            await self._steps(stop, pending, Pickup([], []))
        finally:
            self._telemetry.close()
            if self._profiles is not None:
                self._profiles.close()
            self._steps_out.close()
            if self._channel is not None:
                await self._channel.close()

    async def _steps(self, stop: asyncio.Event, pending: StepCommit, pickup: Pickup) -> None:
        while not stop.is_set():
            started = time.perf_counter()
            clock = PerfClock(started) if self._telemetry.tracing else None
            if self.is_idle:  # nothing to make progress on: new work's clock starts now
                self.last_progress = time.monotonic()
            await self._ingest(pickup, pending)
            if self._inflight is not None and not self._may_overlap(stop):
                await self._land(self._inflight, pending, stop, None)
            if not await self._follow_registration(pending, took_over=bool(pickup.handed_over)):
                # The worker left and every request this loop held has moved on; so must whatever reached the
                # worker's queue meanwhile (admitted while it still counted as alive): the loop goes round
                # until a commit finds the queue empty.
                pickup = await self._commit(pending)
                pending = StepCommit(self.worker_id)
                if pickup.is_empty():
                    break
                continue
            step = await self._send(pending, stop, clock, started, time.perf_counter())
            if step is None and self._inflight is None:
                if not pending.is_empty():
                    pickup, commit_start, commit_s = await _timed(self._commit(pending))
                    pending = StepCommit(self.worker_id)
                    self._telemetry.observe_idle_commit(self.steps, commit_start, commit_s, clock)
                else:
                    if self._profiles is not None:
                        self._profiles.flush()  # idle: a reader sees every step so far
                    pickup = await self._store.wait_for_work(self.worker_id, IDLE_WAIT_SECONDS)
                continue
            # The commit of the results landed so far runs while the worker computes.
            committed = asyncio.ensure_future(_timed(self._commit(pending)))
            pending = StepCommit(self.worker_id)
            if self._inflight is not None:
                # Async scheduling: `step` waits on the worker behind the step in flight, which lands here.
                landed, pickup = await self._land(self._inflight, pending, stop, committed, then=step)
                if landed and step is not None:
                    self._advance(step)
            else:
                assert step is not None
                if self._may_overlap(stop):
                    # The next iteration plans its step while this one runs, and lands this one after.
                    pickup, _, _ = await committed
                    self._advance(step)
                else:
                    _, pickup = await self._land(step, pending, stop, committed)
        if self._inflight is not None:
            await self._land(self._inflight, pending, stop, None)
        if not pending.is_empty():
            # Takes nothing more off the queues: what waits there is the next owner's to pick up.
            pending.pick_up = False
            await self._commit(pending)
        if self._departed() and self._registration is not None and self.is_idle:
            # Only now that the hand-over is committed may the registration go: a registry without the
            # worker is what tells every replica that nothing of it is left to continue.
            await self._fleet.registry.forget(self.worker_id, keys.worker_state(self.worker_id))

    def _may_overlap(self, stop: asyncio.Event) -> bool:
        """Whether the next step may be planned before the one in flight lands (async scheduling): not for beam
        search (its next beams come from the result), nor while the worker leaves or drains, nor when stopping
        (each acts on the results)."""
        if not self._async_scheduling or stop.is_set() or not self._steady():
            return False
        s = self._scheduler
        return not any(g.sampling_params.use_beam_search for g in (*s.running, *s.swapped))

    async def _send(self, commit: StepCommit, stop: asyncio.Event, clock: PerfClock | None, started: float,
                    ingested: float) -> SentStep | None:
        """Plans a call and sends it to the worker; None when there is nothing to send. Under multi-step
        scheduling a steady decode batch takes up to num_scheduler_steps steps in the call (multi_step.py)."""
        profiles: list[StepProfile] = []

        def plan_step() -> tuple[SchedulerOutput, worker_pb2.StepPlan | None]:
            profile = StepProfile(self.steps + 1, 0, 0, 0) if self._measure else None
            if profile is not None:
                profiles.append(profile)
            return self._plan(commit, profile)

        def may_continue(out: SchedulerOutput) -> bool:
            return self._steady() and not stop.is_set() and is_steady_decode(self._scheduler, out)

        planned = plan_call(self._scheduler, plan_step, self._num_scheduler_steps, may_continue)
        if planned is None:
            return None
        outs, plans = planned.outs, planned.plans
        # One profile for the call: its planning and decode tokens summed.
        profile = profiles[0] if profiles else None
        if profile is not None:
            for ahead in profiles[1:len(outs)]:
                profile.schedule_s += ahead.schedule_s
                profile.plan_s += ahead.plan_s
                profile.num_decode_tokens += ahead.num_decode_tokens
            profile.num_steps = len(outs)
        if self._processor.record_timings:
            for out in outs:
                self._processor.mark_scheduled(out, time.time())
        span = self._telemetry.start_step(outs[0], clock, started)
        # Timed from here to the loop holding the call's answer.
        sent = time.perf_counter()
        # Written before this step's records and the commit of the step before are built (~0.4 ms at 64
        # sequences, while the worker waits). The deadline is per step.
        call = await self._steps_out.send(plans, self._step_timeout_s * len(plans), trace_carrier(span))
        records = [step_record(plan, out) for plan, out in zip(plans, outs)]
        self._unlanded = SentStep(outs, call, span, clock, profile, started, ingested, sent, records,
                                  planned.num_advanced)
        return self._unlanded

    def _advance(self, step: SentStep) -> None:
        """Counts the step as running (Scheduler.advance): the next one is planned before it lands."""
        for out in step.outs[step.num_advanced:]:
            self._scheduler.advance(out)
        step.num_advanced = len(step.outs)
        self._unlanded, self._inflight = None, step

    async def _land(
        self, step: SentStep, pending: StepCommit, stop: asyncio.Event,
        committed: asyncio.Future[tuple[Pickup, float, float]] | None, then: SentStep | None = None,
    ) -> tuple[bool, Pickup]:
        """Waits for a step's result (and the commit running beside it) and processes it into `pending`;
        returns whether it landed (False: the worker failed and was reset) and the commit's pickup.
        `then`: the step sent behind it (async scheduling), cancelled when this one failed."""
        failure: grpc.aio.AioRpcError | None = None
        try:
            answer = await step.call
        except grpc.aio.AioRpcError as exc:
            failure = exc
        finally:
            self._forget_unlanded(step)
        stepped = time.perf_counter()
        pickup, commit_start, commit_s = await committed if committed is not None else (Pickup([], []), stepped, 0.0)
        if failure is not None:
            step.span.set_status(Status(StatusCode.ERROR, f"worker failed: {failure.code().name}"))
            step.span.end()
            if then is not None:
                then.call.cancel()
                then.span.end()
                self._forget_unlanded(then)
            await self._on_worker_failure(failure, pending, stop)
            return False, pickup
        processing = time.perf_counter()
        results = answer.results
        if len(results) != len(step.outs):
            raise RuntimeError(f"worker {self.worker_id} answered {len(results)} results to {len(step.outs)} plans")
        for i, (out, result) in enumerate(zip(step.outs, results)):
            self._processor.process(out, result, pending, advanced=i < step.num_advanced)
        self.steps += len(step.outs)
        self.last_progress = time.monotonic()
        done = time.perf_counter()
        profile = step.profile
        if profile is not None:
            profile.ingest_s = step.ingested - step.started
            # From when the worker could start it: its sending, or the answer to the step ahead of it.
            profile.rpc_s = stepped - max(step.sent, self._last_stepped)
            profile.worker_s = sum(r.execute_seconds for r in results)
            profile.commit_s, profile.commit_wait_s = commit_s, max(0.0, processing - stepped)
            # With async scheduling it was planned while the step ahead ran: its wall time starts at that
            # step's answer (step_profile.py).
            profile.process_s, profile.wall_s = done - processing, done - max(step.started, self._last_stepped)
            if self._profiles is not None:
                self._profiles.write(profile)
            self._telemetry.observe_step(profile, step.outs, results, step.span, step.clock, step.ingested,
                                         commit_start, processing)
        self._last_stepped = stepped
        return True, pickup

    def _forget_unlanded(self, step: SentStep) -> None:
        if self._unlanded is step:
            self._unlanded = None
        if self._inflight is step:
            self._inflight = None

    def _commit(self, commit: StepCommit) -> Awaitable[Pickup]:
        # Fenced by the loop's epoch, stamped at commit time: the loop may have taken a newer epoch (worker
        # reset) since the commit began, and a loop that lost its worker to another replica writes nothing.
        commit.epoch = self._planner.epoch
        inflight, planned = [], None
        for sent in (self._inflight, self._unlanded):  # oldest first
            if sent is not None:
                inflight += sent.records[:sent.num_advanced]
                planned = sent.records[-1] if sent.num_advanced < len(sent.records) else planned
        self._journal.write(self._scheduler, commit, planned, (self._planner.epoch, self._planner.last_step_id),
                            inflight)
        return self._store.commit(commit)

    async def _on_worker_failure(self, exc: grpc.aio.AioRpcError, commit: StepCommit, stop: asyncio.Event) -> None:
        """The worker's cache can no longer be trusted: recompute what ran, reset, go on. The failed step's
        results never arrived, so the scheduler's state is the one before that step, and its committed outputs
        are what clients have seen: recomputing from there loses and repeats nothing."""
        log.error("worker %s failed a step: %s %s", self.worker_id, exc.code(), exc.details())
        commit.num_worker_failures += 1
        message = f"the worker failed while running this request: {exc.code().name}: {exc.details()}"
        # Running groups (the step's ones included) had KV on the worker, swapped ones in its CPU pool:
        # both are gone with it. Waiting ones hold no KV and are sent in full anyway.
        for group in [*self._scheduler.running, *self._scheduler.swapped]:
            self._processor.requeue(group, commit, message)
        await self._own_worker(stop)

    def _steady(self) -> bool:
        """The worker is registered, alive and not draining."""
        entry = self._registration
        return not self._departed() and entry is not None and not entry.draining

    def _departed(self) -> bool:
        """The registry no longer lists the worker as alive (deregistered, or its heartbeat expired)."""
        entry = self._registration
        return entry is None or not entry.alive

    async def _own_worker(self, stop: asyncio.Event) -> None:
        """Takes (or retakes) the worker with a new epoch and a full Reset; gives up when stopping, or when it
        left and others can serve (the next iteration then hands its requests over)."""
        above = self._worker_epoch()
        while True:
            epoch = await self._fleet.leases.next_epoch(self.worker_id, above)
            # The epoch fences this loop's commits from now on, even while the worker cannot be reached.
            self._planner.reset(epoch)
            try:
                reset = await self._stub.Reset(worker_pb2.ResetRequest(epoch=epoch), timeout=RESET_TIMEOUT_SECONDS)
            except grpc.aio.AioRpcError as exc:
                if stop.is_set() or (self._departed() and self._fleet.others(self.worker_id)):
                    return
                seen = await self._epoch_seen_by_worker() if exc.code() == grpc.StatusCode.FAILED_PRECONDITION else 0
                if seen >= epoch:
                    # Only the lease holder takes epochs, so the worker has seen a newer one than Redis's counter
                    # only if Redis lost that counter: the next epoch is taken above the worker's.
                    log.warning("worker %s refused epoch %d: it has seen epoch %d, which Redis's counter is behind "
                                "(did Redis lose its data?); taking an epoch above it", self.worker_id, epoch, seen)
                    above = seen
                    continue
                log.warning("worker %s unreachable (%s); retrying", self.worker_id, exc.code())
                await asyncio.sleep(1.0)
                continue
            # The worker's KV is gone: cached prefix blocks no longer hold what their hashes say.
            self._scheduler.reset_prefix_cache()
            self._journal.restart(reset.instance_id)
            log.info("engine loop for worker %s owns epoch %d", self.worker_id, epoch)
            if self._on_owned is not None:
                self._on_owned(self.worker_id, epoch)
            return

    def _worker_epoch(self) -> int:
        """The newest epoch the worker had seen at its last heartbeat (0 before it registered)."""
        entry = self._registration
        return entry.description.epoch if entry is not None else 0

    async def _epoch_seen_by_worker(self) -> int:
        """The newest epoch the worker has seen, asked now; 0 when it does not answer."""
        try:
            described = await self._stub.Describe(worker_pb2.DescribeRequest(), timeout=RESET_TIMEOUT_SECONDS)
        except grpc.aio.AioRpcError:
            return 0
        return described.epoch

    async def _follow_registration(self, commit: StepCommit, took_over: bool = False) -> bool:
        """Acts on the worker leaving or draining; False when the loop has nothing left to drive. A departed
        worker's requests all move to other workers (its KV is gone); a draining worker keeps its running
        requests to the end and hands over only those not started.
        `took_over`: the last pickup held handed-over requests (see HAND_ON_PAUSE_SECONDS)."""
        if self._steady():
            return True
        entry = self._registration
        departed = self._departed()
        s = self._scheduler
        groups = [*s.waiting, *s.running, *s.swapped] if departed else list(s.waiting)
        if groups and self._fleet.others(self.worker_id):
            if took_over:
                await asyncio.sleep(HAND_ON_PAUSE_SECONDS)
            moved = await self._fleet.hand_over(groups, self._processor, self.worker_id, commit)
            # They never finish here, which is where telemetry drops a request's span context.
            for record, _ in commit.handed_over:
                self._telemetry.forget(record.request_id)
            log.info("worker %s %s: handed %d request(s) to other workers", self.worker_id,
                     "left" if departed else "drains", moved)
        if not self.is_idle:
            return True
        if departed:
            log.info("worker %s left; its engine loop ends", self.worker_id)
            return False
        if entry is not None and self._drained_instance != entry.alive_instance:
            await self._fleet.registry.mark_drained(self.worker_id, entry.alive_instance)
            self._drained_instance = entry.alive_instance
            log.info("worker %s drained", self.worker_id)
        return True


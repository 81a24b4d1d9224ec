"""A scheduler rebuilt from its snapshot is the same scheduler (scheduler_service/core/snapshot.py).

The scheduler state machines of test_scheduler / test_prefix_caching / test_chunked_prefill get one
more rule: at any point (a step planned and not run included) the live scheduler is replaced by one
restored from its snapshot, and the machine goes on with it. Every later check of those machines (the
shadow KV cache of the worker, block accounting, queue order, prefix-cache consistency, teardown's
drain to zero) then runs against the restored scheduler, which must behave exactly as the original.
"""

from __future__ import annotations

import pytest
from hypothesis import event, settings
from hypothesis.stateful import invariant, rule

from tests.hypothesis_profiles import examples

from scheduler_service.core.block_pool import CachedBlockEntry
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.core.scheduler_output import SchedulerOutput
from scheduler_service.core.sequence import SequenceStatus
from scheduler_service.core.snapshot import (
    GroupSnapshot,
    SchedulerSnapshot,
    SeqSnapshot,
    restore_inflight_step,
    restore_scheduler,
    restore_step,
    snapshot_scheduler,
)
from shared.sampling_params import SamplingParams
from tests.unit.test_async_scheduling import AsyncSchedulerMachine
from tests.unit.test_chunked_prefill import ChunkedPrefixCachingMachine, SlidingWindowMachine
from tests.unit.test_scheduler import SchedulerMachine, make_group, make_parallel_group, make_scheduler, plan, step


def assert_same_scheduler(live: Scheduler, rebuilt: Scheduler) -> None:
    """Equal snapshots, and equal derived state: reference counts, free lists, evictor order."""
    assert snapshot_scheduler(rebuilt) == snapshot_scheduler(live)
    a, b = live.block_manager, rebuilt.block_manager
    assert b.block_pool.ref_counts() == a.block_pool.ref_counts()
    assert b.block_pool.free_block_ids() == a.block_pool.free_block_ids()
    assert b.num_free_gpu_blocks == a.num_free_gpu_blocks
    if a.swapper.cpu_pool is not None:
        assert b.swapper.cpu_pool is not None
        assert b.swapper.cpu_pool.ref_counts() == a.swapper.cpu_pool.ref_counts()
        assert b.swapper.cpu_pool.free_block_ids() == a.swapper.cpu_pool.free_block_ids()
    assert b.block_pool.enable_caching == a.block_pool.enable_caching
    assert b.block_pool.evictor.block_ids() == a.block_pool.evictor.block_ids()
    for group in (*live.waiting, *live.running, *live.swapped):
        for seq in group.seqs:
            assert b.chain_length(seq.seq_id) == a.chain_length(seq.seq_id)
            assert b._block_hashes.get(seq.seq_id) == a._block_hashes.get(seq.seq_id)


class RestoreRule:
    """Adds to a SchedulerMachine subclass: every state restores exactly, and the `restore` rule."""

    @invariant()
    def restores_exactly(self) -> None:
        live: Scheduler = self.sched
        assert_same_scheduler(live, restore_scheduler(live.scheduler_config, live.cache_config, snapshot_scheduler(live)))
        if live.swapped:
            event("a state with swapped groups restored")

    @rule()
    def restore(self) -> None:
        live: Scheduler = self.sched
        rebuilt = restore_scheduler(live.scheduler_config, live.cache_config, snapshot_scheduler(live))
        assert_same_scheduler(live, rebuilt)
        pending: SchedulerOutput | None = self.pending
        if pending is not None:
            out = restore_step(
                # Sequences finished since it was planned are skipped by the update, and gone with aborted requests.
                rebuilt, [(s.seq.seq_id, s.num_new_tokens) for s in pending.scheduled if not s.seq.is_finished],
                pending.blocks_to_swap_in, pending.blocks_to_swap_out, pending.blocks_to_copy,
            )
            live_items = [(s.seq.seq_id, s.num_new_tokens, s.num_computed_tokens, s.num_tokens, s.samples)
                          for s in pending.scheduled if not s.seq.is_finished]
            rebuilt_items = [(s.seq.seq_id, s.num_new_tokens, s.num_computed_tokens, s.num_tokens, s.samples)
                             for s in out.scheduled]
            assert rebuilt_items == live_items
            self.pending = out
            event("restored with a step planned")
        inflight: SchedulerOutput | None = getattr(self, "inflight", None)
        if inflight is not None:
            # Counted as run, not landed (async scheduling): rebuilt as it was planned.
            out = restore_inflight_step(
                rebuilt, [(s.seq.seq_id, s.num_new_tokens, s.num_computed_tokens) for s in inflight.scheduled])
            held = {s.seq.seq_id for s in out.scheduled}
            live_items = [(s.seq.seq_id, s.num_new_tokens, s.num_computed_tokens, s.num_tokens, s.samples)
                          for s in inflight.scheduled if s.seq.seq_id in held]
            rebuilt_items = [(s.seq.seq_id, s.num_new_tokens, s.num_computed_tokens, s.num_tokens, s.samples)
                             for s in out.scheduled]
            assert rebuilt_items == live_items
            # A sequence finished while its step was in flight (stopped, aborted) is not rebuilt.
            assert held == {s.seq.seq_id for s in inflight.scheduled if not s.seq.is_finished
                            and any(s.group is g for g in (*live.waiting, *live.running, *live.swapped))}
            self.inflight = out
            if any(s.samples for s in out.scheduled):
                event("restored with tokens in flight")
        if rebuilt.swapped:
            event("restored with swapped groups")
        if any(e.last_accessed is not None for e in snapshot_scheduler(rebuilt).cached_blocks):
            event("restored with evictable cached blocks")
        self.replace_scheduler(rebuilt)


class RestoredSchedulerMachine(RestoreRule, SchedulerMachine):
    """Swaps (and failed swaps), recompute preemption, parallel sampling, restored at random points."""


class RestoredPrefixCachingMachine(RestoreRule, ChunkedPrefixCachingMachine):
    """Prefix hits, evictable blocks and their LRU order, chunked prefill, restored at random points."""


class RestoredSlidingWindowMachine(RestoreRule, SlidingWindowMachine):
    """Ring tables (a sliding window) restored at random points."""


class RestoredAsyncSchedulerMachine(RestoreRule, AsyncSchedulerMachine):
    """Driven one step ahead (async scheduling): restored with a step in flight and the next one planned."""


TestRestoredSchedulerMachine = RestoredSchedulerMachine.TestCase
TestRestoredPrefixCachingMachine = RestoredPrefixCachingMachine.TestCase
TestRestoredSlidingWindowMachine = RestoredSlidingWindowMachine.TestCase
TestRestoredAsyncSchedulerMachine = RestoredAsyncSchedulerMachine.TestCase
for case in (TestRestoredSchedulerMachine, TestRestoredPrefixCachingMachine, TestRestoredSlidingWindowMachine,
             TestRestoredAsyncSchedulerMachine):
    case.settings = settings(max_examples=examples(100), stateful_step_count=40, deadline=None)
del case


# -- exact cases -----------------------------------------------------------------------------


def test_restored_scheduler_plans_the_same_next_steps() -> None:
    kwargs = dict(num_gpu_blocks=10, block_size=4, max_num_seqs=3, max_num_batched_tokens=16,
                  enable_prefix_caching=True, num_cpu_blocks=8)
    live = make_scheduler(**kwargs)
    for i in range(4):
        live.add_request(make_group(f"r{i}", i, 5 + i))
    for _ in range(3):
        step(live)
    rebuilt = restore_scheduler(live.scheduler_config, live.cache_config, snapshot_scheduler(live))
    for _ in range(6):
        a, b = step(live), step(rebuilt)
        assert [(s.seq.seq_id, s.num_new_tokens) for s in a.scheduled] == [(s.seq.seq_id, s.num_new_tokens) for s in b.scheduled]
        assert (a.blocks_to_copy, a.blocks_to_swap_in, a.blocks_to_swap_out) == (b.blocks_to_copy, b.blocks_to_swap_in, b.blocks_to_swap_out)
        assert_same_scheduler(live, rebuilt)


def test_restored_swapped_group_comes_back_in_the_same_blocks() -> None:
    live = make_scheduler(num_gpu_blocks=10, block_size=4, max_num_seqs=4, max_num_batched_tokens=16, watermark=0.1,
                          num_cpu_blocks=6, enable_prefix_caching=True)
    live.add_request(make_parallel_group("a", 0, list(range(1, 7)), 2))
    live.add_request(make_parallel_group("b", 2, list(range(1, 7)), 2))
    while not live.swapped:
        step(live)
    snap = snapshot_scheduler(live)
    # Both beams of "b" share their first CPU block (the prompt's), each has its own for the rest.
    assert [(s.seq_id, s.status, s.cpu_block_table) for s in snap.swapped[0].seqs] == [
        (2, SequenceStatus.SWAPPED, (0, 1, 2)), (3, SequenceStatus.SWAPPED, (0, 3, 4))]
    rebuilt = restore_scheduler(live.scheduler_config, live.cache_config, snap)
    assert rebuilt.block_manager.swapper.cpu_pool.ref_counts() == {0: 2, 1: 1, 2: 1, 3: 1, 4: 1}
    swapped_in = False
    for i in range(6):
        if i == 2:  # "a" ends: "b" comes back
            for sched in (live, rebuilt):
                for seq in sched.running[0].unfinished_seqs():
                    sched.finish_sequence(sched.running[0], seq, SequenceStatus.FINISHED_LENGTH)
        a, b = step(live), step(rebuilt)
        assert plan(a) == plan(b) and a.blocks_to_swap_in == b.blocks_to_swap_in
        swapped_in |= bool(a.blocks_to_swap_in)
        assert_same_scheduler(live, rebuilt)
    assert swapped_in


def test_a_step_in_flight_restores_as_planned() -> None:
    live = make_scheduler(num_gpu_blocks=8, block_size=4)
    live.add_request(make_group("r", 0, 5))
    first = live.schedule()
    live.advance(first)  # the prefill runs; its sample is in flight
    second = live.schedule()  # decodes the token in flight
    rebuilt = restore_scheduler(live.scheduler_config, live.cache_config, snapshot_scheduler(live))
    assert_same_scheduler(live, rebuilt)
    assert rebuilt.running[0].seqs[0].num_inflight_tokens == 1
    out = restore_inflight_step(rebuilt, [(0, 5, 0)])
    assert [(s.num_new_tokens, s.num_computed_tokens, s.num_tokens, s.samples) for s in out.scheduled] == [
        (5, 0, 5, True)]
    again = restore_step(rebuilt, [(0, 1)])
    assert [(s.num_computed_tokens, s.num_tokens) for s in again.scheduled] == [
        (s.num_computed_tokens, s.num_tokens) for s in second.scheduled]
    for sched, landed, planned in ((live, first, second), (rebuilt, out, again)):
        sched.resolve(landed, {0: 42})
        sched.update_after_step(planned, {0: 43})
    assert rebuilt.running[0].seqs[0].output_token_ids == [42, 43]
    assert_same_scheduler(live, rebuilt)


def test_a_sequence_finished_while_its_step_is_in_flight_is_left_out_of_the_restored_step() -> None:
    """A parallel pair: one sequence stops after the next step was planned and sent. The stored step in flight
    still names it, but its token there is dropped when the step lands, and the snapshot keeps no token in
    flight for a finished sequence: the restored step holds its sibling only, as landing it would leave."""
    live = make_scheduler(num_gpu_blocks=8, block_size=4)
    live.add_request(make_parallel_group("r", 0, [1], 2))
    first = live.schedule()
    live.advance(first)
    second = live.schedule()
    group = live.running[0]
    live.finish_sequence(group, group.seqs[0], SequenceStatus.FINISHED_STOPPED)
    live.resolve(first, {1: 7})
    live.advance(second)  # sent: in flight
    rebuilt = restore_scheduler(live.scheduler_config, live.cache_config, snapshot_scheduler(live))
    out = restore_inflight_step(rebuilt, [(s.seq.seq_id, s.num_new_tokens, s.num_computed_tokens)
                                          for s in second.scheduled])
    assert [(s.seq.seq_id, s.num_new_tokens, s.num_computed_tokens, s.num_tokens, s.samples)
            for s in out.scheduled] == [(1, 1, 1, 2, True)]
    for sched, landed in ((live, second), (rebuilt, out)):
        sched.resolve(landed, {1: 8})
    assert_same_scheduler(live, rebuilt)
    assert rebuilt.running[0].seqs[1].output_token_ids == [7, 8]


def _one_running(block_table: tuple[int, ...], **seq: object) -> SchedulerSnapshot:
    s = SeqSnapshot(seq_id=0, status=SequenceStatus.RUNNING, output_token_ids=(), num_computed_tokens=4,
                    block_table=block_table, **seq)
    return SchedulerSnapshot(waiting=(), running=(GroupSnapshot("r", (1, 2, 3, 4, 5), SamplingParams(), 0.0, (s,)),),
                             swapped=())


@pytest.mark.parametrize(
    ("snapshot", "prefix", "message"),
    [
        (_one_running((0, 99)), False, r"device block ids \[99\] are outside \[0, 8\)"),
        (_one_running((0, 1), num_hashed_blocks=3), True, "chain of 3 blocks does not fit its table"),
        (_one_running((0, 1), cpu_block_table=(0,)), False, r"CPU block ids \[0\] are outside \[0, 0\)"),
        (
            SchedulerSnapshot((), _one_running((0, 1)).running, (),
                              cached_blocks=(CachedBlockEntry(0, b"h" * 32, 4, last_accessed=3),)),
            True, "cached block 0 is held by a table, yet its evictor stamp is 3",
        ),
        (
            SchedulerSnapshot((), _one_running((0, 1)).running, (),
                              cached_blocks=(CachedBlockEntry(5, b"h" * 32, 4, last_accessed=None),)),
            True, "cached block 5 is held by no table",
        ),
    ],
)
def test_restore_refuses_a_snapshot_that_contradicts_itself(snapshot: SchedulerSnapshot, prefix: bool, message: str) -> None:
    config = make_scheduler(num_gpu_blocks=8, block_size=4, enable_prefix_caching=prefix)
    with pytest.raises(ValueError, match=message):
        restore_scheduler(config.scheduler_config, config.cache_config, snapshot)


def test_restore_refuses_a_duplicate_request() -> None:
    snap = _one_running((0, 1))
    twice = SchedulerSnapshot(snap.running, snap.running, ())
    config = make_scheduler(num_gpu_blocks=8, block_size=4)
    with pytest.raises(ValueError, match="request_id 'r' appears twice"):
        restore_scheduler(config.scheduler_config, config.cache_config, twice)

"""The scheduler core's table updates as the planner writes them: a NewSequence the first time, SequenceDelta afterwards,
the released sequences in finished_seq_ids."""

from __future__ import annotations

import pytest

from protos import worker_pb2
from scheduler_service.core.block_manager import BlockManager
from scheduler_service.core.config import CacheConfig, SchedulerConfig
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.core.scheduler_output import ScheduledSequence, SchedulerOutput, TableUpdate
from scheduler_service.core.sequence import Sequence, SequenceGroup, SequenceStatus
from scheduler_service.planner import Planner
from shared.sampling_params import SamplingParams
from shared.sampling_proto import sampling_to_proto

BLOCK_SIZE = 4


def make_scheduler(num_gpu_blocks: int = 16) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64),
        CacheConfig(block_size=BLOCK_SIZE, num_gpu_blocks=num_gpu_blocks, watermark=0.0),
    )


def make_group(request_id: str, seq_id: int, prompt: list[int], params: SamplingParams | None = None) -> SequenceGroup:
    return SequenceGroup(request_id, [Sequence(seq_id, prompt)], params or SamplingParams(), 0.0)


def build(planner: Planner, sched: Scheduler, out: SchedulerOutput) -> worker_pb2.StepPlan:
    return planner.build(out)


def deltas(plan: worker_pb2.StepPlan) -> dict[int, tuple[list[int], int]]:
    return {d.seq_id: (list(d.new_block_ids), d.num_new_tokens) for d in plan.cached_sequences}


def new_ids(plan: worker_pb2.StepPlan) -> list[int]:
    return [s.seq_id for s in plan.new_sequences]


def added(plan: worker_pb2.StepPlan) -> dict[int, list[int]]:
    """seq id -> block ids the plan adds to the worker's table (the whole table of a sequence sent in full)."""
    tables = {s.seq_id: list(s.block_table) for s in plan.new_sequences}
    tables.update({d.seq_id: list(d.new_block_ids) for d in plan.cached_sequences})
    return {seq_id: blocks for seq_id, blocks in tables.items() if blocks}


def replaced(plan: worker_pb2.StepPlan) -> dict[int, dict[int, int]]:
    return {d.seq_id: dict(d.replaced_blocks) for d in plan.cached_sequences if d.replaced_blocks}


def num_sequences(plan: worker_pb2.StepPlan) -> int:
    return len(plan.new_sequences) + len(plan.cached_sequences)


PARAMS_A = SamplingParams(
    max_tokens=20, temperature=0.5, top_p=0.75, top_k=5, seed=7, stop=["x", "yz"], stop_token_ids=[3, 4], ignore_eos=True
)
PROMPT_A = [11, 12, 13, 14, 15, 16]  # 6 tokens: 2 blocks
PROMPT_B = [21, 22, 23]  # 3 tokens: 1 block


def test_first_plan_sends_every_sequence_in_full() -> None:
    sched = make_scheduler()
    sched.add_request(make_group("a", 1, PROMPT_A, PARAMS_A))
    sched.add_request(make_group("b", 2, PROMPT_B))
    planner = Planner(epoch=7)
    built = build(planner, sched, sched.schedule())
    plan = built
    assert (plan.epoch, plan.step_id) == (7, 1)
    assert list(plan.finished_seq_ids) == []
    assert len(plan.cached_sequences) == 0
    assert not (plan.swap_in or plan.swap_out or plan.copy)
    assert new_ids(built) == [1, 2]
    a, b = plan.new_sequences
    assert list(a.prompt_token_ids) == PROMPT_A
    assert list(a.output_token_ids) == []
    assert list(a.block_table) == [0, 1]
    assert (a.num_computed_tokens, a.num_new_tokens) == (0, 6)
    assert list(b.prompt_token_ids) == PROMPT_B
    assert list(b.block_table) == [2]
    assert (b.num_computed_tokens, b.num_new_tokens) == (0, 3)
    # Sampling fields travel with the new sequence.
    assert a.sampling == sampling_to_proto(PARAMS_A)
    assert a.sampling.max_tokens == 20
    assert a.sampling.temperature == pytest.approx(0.5)
    assert a.sampling.top_p == pytest.approx(0.75)
    assert a.sampling.top_k == 5
    assert a.sampling.HasField("seed") and a.sampling.seed == 7
    assert list(a.sampling.stop) == ["x", "yz"]
    assert list(a.sampling.stop_token_ids) == [3, 4]
    assert a.sampling.ignore_eos is True
    assert not b.sampling.HasField("seed")
    assert b.sampling.max_tokens == 16
    assert added(built) == {1: [0, 1], 2: [2]}
    assert num_sequences(built) == 2


def test_decodes_go_as_deltas_with_new_blocks_only_when_the_table_grows() -> None:
    sched = make_scheduler()
    ga, gb = make_group("a", 1, PROMPT_A, PARAMS_A), make_group("b", 2, PROMPT_B)
    sched.add_request(ga)
    sched.add_request(gb)
    planner = Planner(epoch=3)

    out = sched.schedule()
    build(planner, sched, out)
    sched.update_after_step(out, {1: 100, 2: 200})  # a: 7 tokens, b: 4 tokens

    out = sched.schedule()
    built = build(planner, sched, out)
    assert built.step_id == 2 and built.epoch == 3
    assert new_ids(built) == []
    assert deltas(built) == {1: ([], 1), 2: ([], 1)}
    assert added(built) == {}
    assert num_sequences(built) == 2
    sched.update_after_step(out, {1: 101, 2: 201})  # a: 8 tokens, b: 5 tokens -> b needs a second block

    out = sched.schedule()
    built = build(planner, sched, out)
    assert built.step_id == 3
    assert deltas(built) == {1: ([], 1), 2: ([3], 1)}
    assert added(built) == {2: [3]}
    assert sched.block_manager.get_block_table(gb.seqs[0]) == [2, 3]
    sched.update_after_step(out, {1: 102, 2: 202})  # a: 9 tokens -> a needs a third block

    out = sched.schedule()
    built = build(planner, sched, out)
    assert built.step_id == 4
    assert deltas(built) == {1: ([4], 1), 2: ([], 1)}
    assert added(built) == {1: [4]}
    assert sched.block_manager.get_block_table(ga.seqs[0]) == [0, 1, 4]
    # Deltas never repeat what a NewSequence carries.
    for d in built.cached_sequences:
        assert len(d.replaced_blocks) == 0


def test_a_newcomer_is_sent_in_full_next_to_deltas() -> None:
    sched = make_scheduler()
    sched.add_request(make_group("a", 1, PROMPT_A))
    planner = Planner(epoch=1)
    out = sched.schedule()
    build(planner, sched, out)
    sched.update_after_step(out, {1: 100})
    sched.add_request(make_group("b", 2, PROMPT_B))
    built = build(planner, sched, sched.schedule())
    assert deltas(built) == {1: ([], 1)}
    assert new_ids(built) == [2]
    (b,) = built.new_sequences
    assert list(b.block_table) == [2] and (b.num_computed_tokens, b.num_new_tokens) == (0, 3)
    assert added(built) == {2: [2]}


def test_a_finished_sequence_is_listed_in_the_next_plan_exactly_once() -> None:
    sched = make_scheduler()
    ga, gb = make_group("a", 1, PROMPT_A), make_group("b", 2, PROMPT_B)
    sched.add_request(ga)
    sched.add_request(gb)
    planner = Planner(epoch=1)
    out = sched.schedule()
    build(planner, sched, out)
    sched.update_after_step(out, {1: 100, 2: 200})

    sched.finish_sequence(gb, gb.seqs[0], SequenceStatus.FINISHED_STOPPED)
    out = sched.schedule()
    built = build(planner, sched, out)
    assert list(built.finished_seq_ids) == [2]
    assert deltas(built) == {1: ([], 1)}
    sched.update_after_step(out, {1: 101})

    built = build(planner, sched, sched.schedule())
    assert list(built.finished_seq_ids) == []


def test_forgotten_plan_with_nothing_scheduled_still_carries_finished_ids() -> None:
    sched = make_scheduler()
    ga = make_group("a", 1, PROMPT_A)
    sched.add_request(ga)
    planner = Planner(epoch=1)
    out = sched.schedule()
    build(planner, sched, out)
    sched.update_after_step(out, {1: 100})
    sched.finish_sequence(ga, ga.seqs[0], SequenceStatus.FINISHED_LENGTH)
    built = build(planner, sched, sched.schedule())
    assert list(built.finished_seq_ids) == [1]
    assert num_sequences(built) == 0 and added(built) == {}


def test_recompute_preemption_resends_the_sequence_in_full_with_its_outputs() -> None:
    sched = make_scheduler(num_gpu_blocks=4)
    ga, gb = make_group("a", 1, list(range(1, 9))), make_group("b", 2, list(range(31, 39)))  # 2 blocks each
    sched.add_request(ga)
    sched.add_request(gb)
    planner = Planner(epoch=5)

    out = sched.schedule()
    built = build(planner, sched, out)
    assert added(built) == {1: [0, 1], 2: [2, 3]}
    sched.update_after_step(out, {1: 100, 2: 200})

    # a needs a third block; the cache is full, so b (latest arrival) is preempted by recompute.
    out = sched.schedule()
    assert [g.request_id for g in out.preempted] == ["b"]
    built = build(planner, sched, out)
    assert list(built.finished_seq_ids) == [2]
    assert new_ids(built) == []
    assert deltas(built) == {1: ([2], 1)}
    assert added(built) == {1: [2]}
    sched.update_after_step(out, {1: 101})

    sched.finish_sequence(ga, ga.seqs[0], SequenceStatus.FINISHED_STOPPED)
    out = sched.schedule()
    built = build(planner, sched, out)
    assert list(built.finished_seq_ids) == [1]
    assert new_ids(built) == [2]
    assert len(built.cached_sequences) == 0
    (b,) = built.new_sequences
    assert list(b.prompt_token_ids) == list(range(31, 39))
    assert list(b.output_token_ids) == [200]
    assert list(b.block_table) == [0, 1, 2]
    assert (b.num_computed_tokens, b.num_new_tokens) == (0, 9)
    assert added(built) == {2: [0, 1, 2]}
    sched.update_after_step(out, {2: 201})

    built = build(planner, sched, sched.schedule())
    assert list(built.finished_seq_ids) == []
    assert deltas(built) == {2: ([], 1)}


def test_step_id_increments_and_epoch_is_carried() -> None:
    sched = make_scheduler()
    planner = Planner(epoch=42)
    step_ids = []
    for _ in range(3):
        built = build(planner, sched, sched.schedule())  # empty steps still count
        assert built.epoch == 42
        assert num_sequences(built) == 0
        step_ids.append(built.step_id)
    assert step_ids == [1, 2, 3]


def test_reset_adopts_the_new_epoch_and_step_ids_go_on() -> None:
    sched = make_scheduler()
    sched.add_request(make_group("a", 1, PROMPT_A))
    planner = Planner(epoch=1)
    out = sched.schedule()
    first = build(planner, sched, out)
    sched.update_after_step(out, {1: 100})
    planner.reset(9)
    built = build(planner, sched, sched.schedule())
    assert (built.epoch, built.step_id) == (9, first.step_id + 1)
    assert deltas(built) == {1: ([], 1)}


def _forked_group() -> tuple[Scheduler, SequenceGroup, Planner, worker_pb2.StepPlan]:
    """Two sequences of one group: the parent prefills all but the last prompt token, then the child
    forks from it and copies the shared (not yet full) block on write; the parent writes in place."""
    sched = make_scheduler()
    group = SequenceGroup("p", [Sequence(1, [1, 2, 3]), Sequence(2, [1, 2, 3])], SamplingParams(), 0.0)
    sched.add_request(group)
    planner = Planner(epoch=1)
    out = sched.schedule()
    first = build(planner, sched, out)
    assert added(first) == {1: [0]}
    sched.update_after_step(out, {})
    out = sched.schedule()
    assert out.blocks_to_copy == [(0, 1)]
    assert sched.block_manager.get_block_table(group.seqs[0]) == [0]
    assert sched.block_manager.get_block_table(group.seqs[1]) == [1]
    return sched, group, planner, build(planner, sched, out)


def test_copy_on_write_pairs_are_forwarded() -> None:
    _, _, _, built = _forked_group()
    assert [(p.src, p.dst) for p in built.copy] == [(0, 1)]
    # The parent goes as a delta; the child is new to the worker and goes in full.
    assert deltas(built) == {1: ([], 1)}
    (child,) = built.new_sequences
    assert (child.seq_id, list(child.block_table), child.num_computed_tokens, child.num_new_tokens) == (2, [1], 2, 1)
    assert added(built) == {2: [1]} and replaced(built) == {}


def test_copy_on_write_of_a_block_the_worker_holds_is_announced_as_a_replacement() -> None:
    # A parallel-sampling fork never replaces a block the worker has (the new child copies), but a beam
    # forked from a known sequence can make the known one copy its last block on write.
    bm = BlockManager(block_size=BLOCK_SIZE, num_gpu_blocks=8, watermark=0.0)
    group = SequenceGroup("p", [Sequence(1, [1, 2, 3, 4, 5]), Sequence(2, [1, 2, 3, 4, 5])], SamplingParams(), 0.0)
    parent, child = group.seqs
    bm.allocate(SequenceGroup("p", [parent], SamplingParams(), 0.0))
    assert bm.take_table_update(parent) == TableUpdate([0, 1], in_full=True)
    parent.num_computed_tokens = 5
    bm.fork(parent, child)
    parent.append_token(7)
    assert bm.append_slot(parent) == (1, 2)  # block 1 is shared with the child: copied on write
    assert bm.take_table_update(parent) == TableUpdate([], start=2, replaced={1: 2})
    assert bm.take_table_update(child) == TableUpdate([0, 1], in_full=True)
    parent.num_computed_tokens = 6
    for token in (8, 9, 10):
        parent.append_token(token)
        bm.append_slot(parent)
        parent.num_computed_tokens += 1
    assert bm.take_table_update(parent) == TableUpdate([3], start=2)  # token 9 opened block 3
    assert bm.take_table_update(parent) == TableUpdate([], start=3)


def test_a_replacement_travels_in_the_delta() -> None:
    group = SequenceGroup("p", [Sequence(1, [1, 2, 3])], SamplingParams(), 0.0)
    item = ScheduledSequence(group, group.seqs[0], 3)
    item.table = TableUpdate([5], start=1, replaced={0: 4})
    (delta,) = Planner(epoch=1).build(SchedulerOutput(scheduled=[item])).cached_sequences
    assert (dict(delta.replaced_blocks), list(delta.new_block_ids)) == ({0: 4}, [5])


def test_swap_pairs_are_forwarded_in_order() -> None:
    out = SchedulerOutput(blocks_to_swap_in=[(1, 2), (3, 4)], blocks_to_swap_out=[(5, 6)], blocks_to_copy=[(7, 8)])
    built = Planner(epoch=1).build(out)
    assert list(built.swap_in) == [worker_pb2.BlockPair(src=1, dst=2), worker_pb2.BlockPair(src=3, dst=4)]
    assert list(built.swap_out) == [worker_pb2.BlockPair(src=5, dst=6)]
    assert list(built.copy) == [worker_pb2.BlockPair(src=7, dst=8)]
    assert num_sequences(built) == 0 and added(built) == {}

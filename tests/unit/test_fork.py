"""Parallel sampling (n > 1): fork before the last prompt token, share by ref count, diverge by copy-on-write."""

from __future__ import annotations

from scheduler_service.core.block_manager import AllocStatus
from scheduler_service.core.block_manager import PrefixCacheStats
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.core.scheduler_output import SchedulerOutput
from scheduler_service.core.sequence import Sequence, SequenceGroup, SequenceStatus
from shared.sampling_params import SamplingParams
from tests.unit.test_scheduler import ids, make_group, make_parallel_group, make_scheduler, plan, sample_all, step

PROMPT6 = [1, 2, 3, 4, 5, 6]


def scheduler(**kwargs: object) -> Scheduler:
    defaults: dict[str, object] = {"num_gpu_blocks": 16, "block_size": 4}
    return make_scheduler(**{**defaults, **kwargs})  # type: ignore[arg-type]


def tables(sched: Scheduler, group: SequenceGroup) -> list[list[int] | None]:
    bm = sched.block_manager
    return [bm.get_block_table(s) if bm.has_block_table(s) else None for s in group.seqs]


def refs(sched: Scheduler, block_ids: list[int]) -> list[int]:
    return [sched.block_manager.block_pool.get_ref_count(b) for b in block_ids]


def distinct(out: SchedulerOutput, base: int) -> dict[int, int]:
    """A different sampled token for every sequence: forked sequences diverge."""
    return {s.seq.seq_id: base + s.seq.seq_id for s in out.scheduled if s.samples}


def details(out: SchedulerOutput) -> list[tuple[int, int, int, bool]]:
    """(seq_id, num_computed_tokens, num_new_tokens, samples) per scheduled sequence."""
    return [(s.seq.seq_id, s.num_computed_tokens, s.num_new_tokens, s.samples) for s in out.scheduled]


# -- the sequence-group helpers ----------------------------------------------------


def test_pending_fork_and_forks_on_admission_helpers() -> None:
    group = make_parallel_group("g", 0, PROMPT6, 3)
    assert group.forks_on_admission() and group.pending_fork_seqs() == []
    group.seqs[0].status = SequenceStatus.RUNNING
    assert group.pending_fork_seqs() == group.seqs[1:]
    for seq in group.seqs[1:]:
        seq.status = SequenceStatus.RUNNING
    assert group.pending_fork_seqs() == []
    # Outputs make the sequences differ: each is prefilled on its own.
    diverged = SequenceGroup("d", [Sequence(5, [1, 2], [3]), Sequence(6, [1, 2], [4])], SamplingParams(), 0.0)
    assert not diverged.forks_on_admission()
    assert not make_group("single", 7, 4).forks_on_admission()


# -- the main path ---------------------------------------------------------------------


def test_fork_before_the_last_prompt_token_then_copy_on_write() -> None:
    sched = scheduler()
    group = make_parallel_group("g", 0, PROMPT6, 3)
    parent, first, second = group.seqs
    sched.add_request(group)
    assert sched.block_manager.can_allocate(group) is AllocStatus.OK

    # Step 1: only the parent runs, prefilling 5 of the 6 prompt tokens, no sample.
    out = sched.schedule()
    assert details(out) == [(0, 0, 5, False)]
    assert out.scheduled[0].token_ids == [1, 2, 3, 4, 5]
    assert tables(sched, group) == [[0, 1], None, None]
    assert [s.status for s in group.seqs] == [SequenceStatus.RUNNING, SequenceStatus.WAITING, SequenceStatus.WAITING]
    assert group.pending_fork_seqs() == [first, second]
    assert ids(sched.running) == ["g"] and not sched.waiting
    sched.update_after_step(out, {})
    assert parent.num_computed_tokens == 5 and parent.output_token_ids == []

    # Step 2: the fork. Observe the tables when the first slot is appended: all
    # three share the parent's blocks, each referenced 3 times.
    bm = sched.block_manager
    seen: list[tuple[list[list[int] | None], list[int]]] = []
    append_slot = bm.append_slot

    def spy(seq: Sequence) -> tuple[int, int] | None:
        if not seen:
            seen.append((tables(sched, group), refs(sched, [0, 1])))
        return append_slot(seq)

    bm.append_slot = spy  # type: ignore[method-assign]
    out = sched.schedule()
    bm.append_slot = append_slot  # type: ignore[method-assign]
    assert seen == [([[0, 1], [0, 1], [0, 1]], [3, 3])]
    # The children copy the shared last block on write; the parent, last, writes in place.
    assert out.blocks_to_copy == [(1, 2), (1, 3)]
    assert tables(sched, group) == [[0, 1], [0, 2], [0, 3]]
    assert refs(sched, [0, 1, 2, 3]) == [3, 1, 1, 1]
    # Every sequence computes the last prompt token and samples its own first token.
    assert details(out) == [(0, 5, 1, True), (1, 5, 1, True), (2, 5, 1, True)]
    assert all(s.token_ids == [6] for s in out.scheduled)
    assert out.num_batched_tokens == 3
    assert all(s.status is SequenceStatus.RUNNING for s in group.seqs)
    sched.update_after_step(out, distinct(out, 10))
    assert [s.output_token_ids for s in group.seqs] == [[10], [11], [12]]
    assert [s.num_computed_tokens for s in group.seqs] == [6, 6, 6]

    # Decodes into their own blocks: no copies, no new blocks until slot 8.
    for num_computed, base in ((6, 20), (7, 30)):
        out = sched.schedule()
        assert details(out) == [(0, num_computed, 1, True), (1, num_computed, 1, True), (2, num_computed, 1, True)]
        assert out.blocks_to_copy == []
        sched.update_after_step(out, distinct(out, base))
    assert tables(sched, group) == [[0, 1], [0, 2], [0, 3]]
    out = sched.schedule()  # slot 8: each sequence appends its own block (children first)
    assert out.blocks_to_copy == []
    assert tables(sched, group) == [[0, 1, 6], [0, 2, 4], [0, 3, 5]]
    sched.update_after_step(out, distinct(out, 40))
    assert [s.all_token_ids for s in group.seqs] == [
        PROMPT6 + [10, 20, 30, 40],
        PROMPT6 + [11, 21, 31, 41],
        PROMPT6 + [12, 22, 32, 42],
    ]

    # Finishing one sequence frees only what it does not share.
    sched.finish_sequence(group, first, SequenceStatus.FINISHED_STOPPED)
    assert not bm.has_block_table(first)
    assert refs(sched, [0, 1, 2, 3, 4, 5, 6]) == [2, 1, 0, 1, 0, 1, 1]
    assert bm.num_free_gpu_blocks == 11
    out = step(sched)
    assert details(out) == [(0, 9, 1, True), (2, 9, 1, True)]
    sched.finish_sequence(group, parent, SequenceStatus.FINISHED_LENGTH)
    assert refs(sched, [0]) == [1] and ids(sched.running) == ["g"]
    sched.finish_sequence(group, second, SequenceStatus.FINISHED_LENGTH)
    assert not sched.has_unfinished_requests()
    assert bm.num_free_gpu_blocks == 16 and bm.block_tables == {}


def test_prompt_of_one_token_forks_at_admission() -> None:
    sched = scheduler()
    group = make_parallel_group("g", 0, [7], 3)
    sched.add_request(group)
    out = sched.schedule()
    # Nothing to prefill before the last token: the three decodes run at once.
    assert details(out) == [(0, 0, 1, True), (1, 0, 1, True), (2, 0, 1, True)]
    assert out.blocks_to_copy == [(0, 1), (0, 2)]
    assert tables(sched, group) == [[0], [1], [2]]
    assert refs(sched, [0, 1, 2]) == [1, 1, 1]
    sched.update_after_step(out, distinct(out, 10))
    assert [s.output_token_ids for s in group.seqs] == [[10], [11], [12]]
    assert plan(step(sched)) == [("g", 1)] * 3


def test_prompt_of_whole_blocks_still_copies_the_full_last_block() -> None:
    sched = scheduler()
    group = make_parallel_group("g", 0, list(range(1, 9)), 2)
    sched.add_request(group)
    out = step(sched)
    assert details(out) == [(0, 0, 7, False)]
    assert tables(sched, group) == [[0, 1], None]
    out = sched.schedule()
    # Block 1 holds tokens 4..6 and gets the 8th token: the child copies it first.
    assert out.blocks_to_copy == [(1, 2)]
    assert details(out) == [(0, 7, 1, True), (1, 7, 1, True)]
    assert tables(sched, group) == [[0, 1], [0, 2]]
    sched.update_after_step(out, distinct(out, 10))
    out = sched.schedule()  # 9 tokens: a new block each, nothing shared to copy
    assert out.blocks_to_copy == []
    assert tables(sched, group) == [[0, 1, 4], [0, 2, 3]]


# -- limits ------------------------------------------------------------------------------


def test_max_num_seqs_counts_every_sequence_of_a_group() -> None:
    sched = scheduler(max_num_seqs=4)
    a = make_group("a", 0, 2)
    group = make_parallel_group("g", 1, PROMPT6, 3)
    big = make_parallel_group("big", 4, PROMPT6, 5)
    c = make_group("c", 9, 3)
    for g in (a, group, big, c):
        sched.add_request(g)
    out = step(sched)
    # a + g's 3 sequences (2 of them pending) are 4: c must wait; big can never fit.
    assert plan(out) == [("a", 2), ("g", 5)]
    assert ids(out.ignored) == ["big"] and ids(sched.waiting) == ["c"]
    assert big.seqs[0].status is SequenceStatus.FINISHED_IGNORED
    out = step(sched)
    assert plan(out) == [("a", 1), ("g", 1), ("g", 1), ("g", 1)]
    assert ids(sched.waiting) == ["c"]
    sched.finish_sequence(a, a.seqs[0], SequenceStatus.FINISHED_STOPPED)
    assert plan(step(sched)) == [("g", 1), ("g", 1), ("g", 1), ("c", 3)]


def test_token_budget_counts_every_sequence() -> None:
    sched = scheduler(max_num_batched_tokens=5)
    group = make_parallel_group("g", 0, PROMPT6[:5], 3)
    sched.add_request(group)
    assert plan(step(sched)) == [("g", 4)]
    sched.add_request(make_group("b", 3, 2))
    sched.add_request(make_group("c", 4, 1))
    # The fork step's 3 decodes leave 2 tokens: b fits, c waits behind it.
    out = step(sched)
    assert plan(out) == [("g", 1), ("g", 1), ("g", 1), ("b", 2)]
    assert ids(sched.waiting) == ["c"]
    # Ignored: the whole prompt (6 tokens: a parent finished before the fork leaves it all to a
    # sibling) or the 6 decodes could never fit one step.
    small = scheduler(max_num_batched_tokens=5, max_num_seqs=8)
    small.add_request(make_parallel_group("long", 10, list(range(1, 7)), 2))
    small.add_request(make_parallel_group("wide", 20, [1, 2], 6))
    small.add_request(make_parallel_group("ok", 30, list(range(1, 6)), 2))
    out = small.schedule()
    assert ids(out.ignored) == ["long", "wide"] and plan(out) == [("ok", 4)]


def test_group_waits_unforked_while_its_decodes_do_not_fit_the_budget() -> None:
    sched = scheduler(max_num_batched_tokens=4)
    a, b = make_group("a", 0, 2), make_group("b", 1, 1)
    group = make_parallel_group("g", 2, [1, 2], 3)
    for g in (a, b, group):
        sched.add_request(g)
    assert plan(step(sched)) == [("a", 2), ("b", 1), ("g", 1)]
    # a and b decode first; g's 3 decodes do not fit the 2 tokens left: no fork yet.
    out = step(sched)
    assert plan(out) == [("a", 1), ("b", 1)]
    assert tables(sched, group) == [[2], None, None] and group.pending_fork_seqs() == group.seqs[1:]
    sched.finish_sequence(a, a.seqs[0], SequenceStatus.FINISHED_STOPPED)
    out = sched.schedule()
    assert plan(out) == [("b", 1), ("g", 1), ("g", 1), ("g", 1)]
    assert out.blocks_to_copy == [(2, 0), (2, 3)]
    assert tables(sched, group) == [[2], [0], [3]]


def test_fork_without_cache_room_preempts_like_a_decode() -> None:
    # can_allocate counted the copy-on-write block, but a decode took it since.
    sched = scheduler(num_gpu_blocks=5)
    a = make_group("a", 0, 8)  # 2 blocks
    group = make_parallel_group("g", 1, PROMPT6, 2)  # 2 blocks + 1 for the fork
    sched.add_request(a)
    sched.add_request(group)
    assert plan(step(sched)) == [("a", 8), ("g", 5)]
    assert sched.block_manager.num_free_gpu_blocks == 1
    out = sched.schedule()
    # a's 9th token takes the last block; g cannot copy its shared block: it is preempted.
    assert plan(out) == [("a", 1)] and ids(out.preempted) == ["g"]
    assert [s.status for s in group.seqs] == [SequenceStatus.WAITING] * 2
    assert tables(sched, group) == [None, None]
    assert [s.num_computed_tokens for s in group.seqs] == [0, 0]
    sched.update_after_step(out, sample_all(out))
    sched.finish_sequence(a, a.seqs[0], SequenceStatus.FINISHED_STOPPED)
    # No output yet: it still shares one prefill.
    assert details(step(sched)) == [(1, 0, 5, False)]


# -- chunked prefill ---------------------------------------------------------------------


def test_chunked_prefill_caps_the_parent_chunks_before_the_last_prompt_token() -> None:
    sched = scheduler(enable_chunked_prefill=True, max_num_batched_tokens=4)
    group = make_parallel_group("g", 0, list(range(1, 11)), 2)
    sched.add_request(group)
    assert details(step(sched)) == [(0, 0, 4, False)]
    assert details(step(sched)) == [(0, 4, 4, False)]
    # Capped at 9 tokens although the budget allows 2.
    out = step(sched)
    assert details(out) == [(0, 8, 1, False)] and out.num_batched_tokens == 1
    assert tables(sched, group) == [[0, 1, 2], None]
    out = sched.schedule()
    assert details(out) == [(0, 9, 1, True), (1, 9, 1, True)]
    assert out.blocks_to_copy == [(2, 3)]
    assert tables(sched, group) == [[0, 1, 2], [0, 1, 3]]
    # The fork's decodes need all n tokens of one step.
    wide = scheduler(enable_chunked_prefill=True, max_num_batched_tokens=2)
    wide.add_request(make_parallel_group("w", 0, PROMPT6, 3))
    assert ids(wide.schedule().ignored) == ["w"]


def test_chunked_prefill_fork_goes_with_the_decodes() -> None:
    sched = scheduler(enable_chunked_prefill=True, max_num_batched_tokens=6)
    long = make_group("long", 0, 20)
    group = make_parallel_group("g", 1, [1, 2, 3], 2)
    sched.add_request(group)
    sched.add_request(long)
    assert plan(step(sched)) == [("g", 2), ("long", 4)]
    # g forks into decodes, which go before long's next chunk.
    out = step(sched)
    assert plan(out) == [("g", 1), ("g", 1), ("long", 4)]
    assert [s.samples for s in out.scheduled] == [True, True, False]


# -- prefix caching ------------------------------------------------------------------------


def test_prefix_cache_hits_shorten_the_parent_prefill() -> None:
    sched = scheduler(enable_prefix_caching=True)
    a = make_group("a", 0, 9)
    sched.add_request(a)
    step(sched)  # a's blocks 0 and 1 registered
    group = make_parallel_group("g", 1, list(range(1, 13)), 2)
    sched.add_request(group)
    out = sched.schedule()
    assert plan(out) == [("a", 1), ("g", 3)]
    assert details(out)[1] == (1, 8, 3, False)
    assert tables(sched, group) == [[0, 1, 3], None]
    assert sched.block_manager.prefix_cache_stats == PrefixCacheStats(queries=4, hits=2)
    sched.update_after_step(out, distinct(out, 50))
    out = sched.schedule()
    assert details(out)[1:] == [(1, 11, 1, True), (2, 11, 1, True)]
    assert out.blocks_to_copy == [(3, 4)]
    assert tables(sched, group) == [[0, 1, 3], [0, 1, 4]]
    assert refs(sched, [0, 1, 3, 4]) == [3, 3, 1, 1]


def test_prefix_cache_hits_up_to_the_last_token_fork_at_admission() -> None:
    sched = scheduler(enable_prefix_caching=True)
    sched.add_request(make_group("a", 0, 9))
    step(sched)
    group = make_parallel_group("g", 1, list(range(1, 10)), 2)
    sched.add_request(group)
    out = sched.schedule()
    # 8 cached tokens are all but the last: fork at once, the last token's block copied on write.
    assert plan(out) == [("a", 1), ("g", 1), ("g", 1)]
    assert details(out)[1:] == [(1, 8, 1, True), (2, 8, 1, True)]
    assert out.blocks_to_copy == [(3, 4)]
    assert tables(sched, group) == [[0, 1, 3], [0, 1, 4]]
    assert out.num_batched_tokens == 3


def test_copy_on_write_blocks_are_registered_once_full_and_computed() -> None:
    sched = scheduler(enable_prefix_caching=True)
    group = make_parallel_group("g", 0, list(range(1, 9)), 2)
    sched.add_request(group)
    step(sched)  # the parent computes 7 tokens: block 0 is registered, block 1 is not full
    cache = sched.block_manager.block_pool
    assert cache.enable_caching
    assert [cache.get_block_hash(b) is not None for b in (0, 1)] == [True, False]
    out = sched.schedule()
    assert out.blocks_to_copy == [(1, 2)]
    sched.update_after_step(out, distinct(out, 50))
    # Both blocks with tokens 5..8 are full and computed: the parent's is registered first,
    # the child's copy stays unhashed (the hash already names block 1).
    assert [cache.get_block_hash(b) is not None for b in (0, 1, 2)] == [True, True, False]
    probe = make_group_of_prompt("p", 9, list(range(1, 9)) + [99])
    assert sched.block_manager.get_num_cached_tokens(probe.seqs[0]) == 8
    # The child registers its own later blocks as usual.
    for _ in range(4):
        step(sched)
    child = group.seqs[1]
    assert child.num_computed_tokens == 12
    assert cache.get_block_hash(sched.block_manager.get_block_table(child)[2]) is not None


def make_group_of_prompt(request_id: str, seq_id: int, prompt: list[int]) -> SequenceGroup:
    return SequenceGroup(request_id, [Sequence(seq_id, prompt)], SamplingParams(), 0.0)


# -- preemption and readmission -----------------------------------------------------------


def test_recompute_preemption_of_a_forked_group_prefills_each_sequence() -> None:
    sched = scheduler(num_gpu_blocks=6)
    a = make_group("a", 0, 8)
    group = make_parallel_group("g", 1, PROMPT6, 2)
    first, second = group.seqs
    sched.add_request(a)
    sched.add_request(group)
    assert plan(step(sched)) == [("a", 8), ("g", 5)]
    out = sched.schedule()
    assert out.blocks_to_copy == [(3, 5)]
    assert (tables(sched, group), sched.block_manager.get_block_table(a.seqs[0])) == ([[2, 3], [2, 5]], [0, 1, 4])
    sched.update_after_step(out, distinct(out, 10))
    for base in (20, 30):
        sched.update_after_step(out := sched.schedule(), distinct(out, base))
    # 9 tokens each: both need a 3rd block, none is free. g is the latest arrival: preempted.
    out = sched.schedule()
    assert plan(out) == [("a", 1)] and ids(out.preempted) == ["g"]
    assert [s.status for s in group.seqs] == [SequenceStatus.WAITING] * 2
    assert [s.num_computed_tokens for s in group.seqs] == [0, 0]
    assert [s.output_token_ids for s in group.seqs] == [[11, 21, 31], [12, 22, 32]]  # kept
    assert tables(sched, group) == [None, None]
    assert sched.block_manager.num_free_gpu_blocks == 3
    sched.update_after_step(out, distinct(out, 40))
    # Diverged: a table each, 3 + 3 blocks; only 2 free after a's growth: LATER.
    out = step(sched)
    assert plan(out) == [("a", 1)] and ids(sched.waiting) == ["g"]
    assert sched.block_manager.can_allocate(group) is AllocStatus.LATER
    sched.finish_sequence(a, a.seqs[0], SequenceStatus.FINISHED_STOPPED)
    out = sched.schedule()
    assert details(out) == [(1, 0, 9, True), (2, 0, 9, True)]
    assert [s.token_ids for s in out.scheduled] == [PROMPT6 + [11, 21, 31], PROMPT6 + [12, 22, 32]]
    assert tables(sched, group) == [[0, 1, 2], [3, 4, 5]]
    assert out.blocks_to_copy == []
    sched.update_after_step(out, distinct(out, 50))
    assert [s.output_token_ids for s in group.seqs] == [[11, 21, 31, 51], [12, 22, 32, 52]]
    out = step(sched)
    assert details(out) == [(1, 9, 1, True), (2, 9, 1, True)]


def test_readmission_keeps_finished_sequences_finished() -> None:
    # As a forked group after a preemption: outputs differ, one sequence already finished.
    prompt = [1, 2, 3]
    group = SequenceGroup(
        "g", [Sequence(0, prompt, [7]), Sequence(1, prompt, [8]), Sequence(2, prompt, [9])], SamplingParams(), 0.0
    )
    sched = scheduler()
    sched.add_request(group)
    sched.finish_sequence(group, group.seqs[0], SequenceStatus.FINISHED_STOPPED)
    assert sched.block_manager.can_allocate(group) is AllocStatus.OK
    out = sched.schedule()
    assert details(out) == [(1, 0, 4, True), (2, 0, 4, True)]
    assert tables(sched, group) == [None, [0], [1]]
    assert group.seqs[0].status is SequenceStatus.FINISHED_STOPPED


def test_diverged_group_prefills_each_sequence_in_chunks() -> None:
    sched = scheduler(enable_chunked_prefill=True, max_num_batched_tokens=8)
    group = SequenceGroup(
        "g", [Sequence(0, [1, 2, 3], [4, 5, 6]), Sequence(1, [1, 2, 3], list(range(10, 19)))], SamplingParams(), 0.0
    )
    sched.add_request(group)
    assert details(step(sched)) == [(0, 0, 4, False), (1, 0, 4, False)]
    # The shorter one finishes its prefill; the budget it leaves goes to the longer one.
    assert details(step(sched)) == [(0, 4, 2, True), (1, 4, 6, False)]
    # Now one decode (with the decodes) and one last chunk.
    out = sched.schedule()
    assert details(out) == [(0, 6, 1, True), (1, 10, 2, True)]
    assert tables(sched, group) == [[0, 1], [2, 3, 4]]


# -- finish and abort ----------------------------------------------------------------------


def test_abort_a_forked_group_frees_everything() -> None:
    sched = scheduler()
    group = make_parallel_group("g", 0, PROMPT6, 3)
    sched.add_request(group)
    step(sched)
    step(sched)
    assert sched.block_manager.get_num_used_blocks() == 4
    assert sched.abort_request("g") is group
    assert all(s.status is SequenceStatus.FINISHED_ABORTED for s in group.seqs)
    assert sched.block_manager.num_free_gpu_blocks == 16 and not sched.has_unfinished_requests()


def test_abort_before_the_fork_frees_the_parent() -> None:
    sched = scheduler()
    group = make_parallel_group("g", 0, PROMPT6, 3)
    sched.add_request(group)
    out = sched.schedule()
    sched.abort_request("g")
    sched.update_after_step(out, {})  # the in-flight prefill is skipped
    assert all(s.status is SequenceStatus.FINISHED_ABORTED for s in group.seqs)
    assert sched.block_manager.num_free_gpu_blocks == 16


def test_finishing_the_parent_before_the_fork_hands_its_prefill_over() -> None:
    sched = scheduler()
    group = make_parallel_group("g", 0, PROMPT6, 3)
    parent, heir, last = group.seqs
    sched.add_request(group)
    step(sched)
    sched.finish_sequence(group, parent, SequenceStatus.FINISHED_STOPPED)
    # The first pending sibling took the parent's table and computed tokens.
    assert tables(sched, group) == [None, [0, 1], None]
    assert (heir.status, heir.num_computed_tokens) == (SequenceStatus.RUNNING, 5)
    assert group.pending_fork_seqs() == [last]
    out = sched.schedule()
    assert details(out) == [(1, 5, 1, True), (2, 5, 1, True)]
    assert out.blocks_to_copy == [(1, 2)]
    assert tables(sched, group) == [None, [0, 1], [0, 2]]


def test_finishing_every_pending_sibling_lets_the_parent_sample() -> None:
    sched = scheduler()
    group = make_parallel_group("g", 0, PROMPT6, 2)
    sched.add_request(group)
    step(sched)
    sched.finish_sequence(group, group.seqs[1], SequenceStatus.FINISHED_ABORTED)
    out = sched.schedule()
    assert details(out) == [(0, 5, 1, True)] and out.blocks_to_copy == []

"""Chunked prefill: one token budget for decodes, prompt chunks and new prompts."""

from __future__ import annotations

import math

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis import event
from hypothesis.stateful import invariant, rule

from tests.hypothesis_profiles import examples

from scheduler_service.core.scheduler import Scheduler
from scheduler_service.core.sequence import Sequence, SequenceGroup, SequenceStatus
from shared.sampling_params import SamplingParams
from tests.unit.test_prefix_caching import PREFIXES, PrefixCachingMachine
from tests.unit.test_scheduler import (
    TOKEN,
    SchedulerMachine,
    ids,
    make_group,
    make_scheduler,
    plan,
    sample_all,
    step,
    table,
)


def chunked_scheduler(**kwargs: object) -> Scheduler:
    defaults: dict[str, object] = {"num_gpu_blocks": 16, "max_num_batched_tokens": 8, "max_model_len": 64}
    return make_scheduler(enable_chunked_prefill=True, **{**defaults, **kwargs})  # type: ignore[arg-type]


def samples(out) -> list[tuple[str, bool]]:
    return [(s.group.request_id, s.samples) for s in out.scheduled]


def test_long_prompt_does_not_stall_a_running_decode() -> None:
    sched = chunked_scheduler()
    a = make_group("a", 0, 3)
    sched.add_request(a)
    assert plan(step(sched)) == [("a", 3)]
    b = make_group("b", 1, 30)
    sched.add_request(b)
    steps = math.ceil(30 / 7)
    assert steps == 5
    chunks = []
    for i in range(steps):
        out = sched.schedule()
        assert out.num_batched_tokens <= 8
        expected_chunk = 7 if i < steps - 1 else 30 - 7 * (steps - 1)
        # Every step: the decode first, then the biggest chunk the budget leaves.
        assert plan(out) == [("a", 1), ("b", expected_chunk)]
        assert samples(out) == [("a", True), ("b", i == steps - 1)]
        assert out.scheduled[1].num_computed_tokens == 7 * i
        chunks.append(out.scheduled[1].num_new_tokens)
        sched.update_after_step(out, sample_all(out))
    assert chunks == [7, 7, 7, 7, 2]
    assert b.seqs[0].num_computed_tokens == 30 and b.seqs[0].output_token_ids == [TOKEN]
    assert a.seqs[0].output_token_ids == [TOKEN] * (1 + steps)
    # Blocks for the whole prompt were allocated at admission.
    assert table(sched, b) == [1, 2, 3, 4, 5, 6, 7, 8]
    assert plan(step(sched)) == [("a", 1), ("b", 1)]


def test_decodes_then_running_prefills_then_new_prompts() -> None:
    sched = chunked_scheduler(max_num_batched_tokens=10)
    for group in (make_group("a", 0, 2), make_group("b", 1, 30), make_group("c", 2, 3)):
        sched.add_request(group)
    out = step(sched)
    assert plan(out) == [("a", 2), ("b", 8)]  # c waits: no budget left
    assert ids(sched.waiting) == ["c"]
    assert plan(step(sched)) == [("a", 1), ("b", 9)]
    assert plan(step(sched)) == [("a", 1), ("b", 9)]
    out = step(sched)
    assert plan(out) == [("a", 1), ("b", 4), ("c", 3)]
    assert samples(out) == [("a", True), ("b", True), ("c", True)]
    assert plan(step(sched)) == [("a", 1), ("b", 1), ("c", 1)]


def test_decodes_go_first_even_before_earlier_prefills() -> None:
    sched = chunked_scheduler(max_num_batched_tokens=9)
    # Two sequences prefilling together split the budget evenly: 4 each. (Diverged
    # ones, as after a recompute preemption: a fresh pair would fork instead.)
    prompt = list(range(1, 12))
    pair = SequenceGroup("pair", [Sequence(0, prompt, [50]), Sequence(1, prompt, [60])], SamplingParams(), 0)
    sched.add_request(pair)
    sched.add_request(make_group("late", 2, 1))
    assert plan(step(sched)) == [("pair", 4), ("pair", 4), ("late", 1)]
    # "late" arrived after "pair" but decodes: it goes first.
    assert plan(step(sched)) == [("late", 1), ("pair", 4), ("pair", 4)]
    out = sched.schedule()
    assert plan(out) == [("late", 1), ("pair", 4), ("pair", 4)]
    assert samples(out) == [("late", True), ("pair", True), ("pair", True)]


def test_prompt_longer_than_budget_is_prefilled_not_ignored() -> None:
    sched = chunked_scheduler(max_num_batched_tokens=8, max_model_len=24, num_gpu_blocks=8)
    long = make_group("long", 0, 20)
    too_long = make_group("too_long", 1, 25)
    sched.add_request(long)
    sched.add_request(too_long)
    out = step(sched)
    assert ids(out.ignored) == ["too_long"]  # max_model_len still applies
    assert plan(out) == [("long", 8)] and samples(out) == [("long", False)]
    assert long.seqs[0].output_token_ids == []
    out = step(sched)
    assert plan(out) == [("long", 8)] and samples(out) == [("long", False)]
    out = sched.schedule()
    assert plan(out) == [("long", 4)] and samples(out) == [("long", True)]
    assert out.scheduled[0].token_ids == [17, 18, 19, 20]
    sched.update_after_step(out, {0: 5})
    assert long.seqs[0].output_token_ids == [5]
    assert plan(step(sched)) == [("long", 1)]
    assert sched.max_seq_len == 24  # the budget is no limit with chunking


def test_chunked_prefill_with_a_prefix_cache_hit() -> None:
    sched = chunked_scheduler(enable_prefix_caching=True)
    a = make_group("a", 0, 9)
    sched.add_request(a)
    assert plan(step(sched)) == [("a", 8)]
    assert plan(step(sched)) == [("a", 1)]
    # The hit covers 8 of the 22 tokens; the other 14 come in chunks next to a's decode.
    b = make_group("b", 1, 22)
    sched.add_request(b)
    out = sched.schedule()
    assert plan(out) == [("a", 1), ("b", 7)]
    assert out.scheduled[1].num_computed_tokens == 8
    assert table(sched, b)[:2] == table(sched, a)[:2]
    sched.update_after_step(out, sample_all(out))
    out = sched.schedule()
    assert plan(out) == [("a", 1), ("b", 7)] and samples(out) == [("a", True), ("b", True)]
    sched.update_after_step(out, sample_all(out))
    assert b.seqs[0].num_computed_tokens == 22
    # b's own blocks got registered chunk by chunk: c hits 5 of them (not the last-token block).
    c = make_group("c", 2, 23)
    sched.add_request(c)
    out = sched.schedule()
    assert plan(out) == [("a", 1), ("b", 1), ("c", 3)]
    assert out.scheduled[2].num_computed_tokens == 20
    assert table(sched, c)[:5] == table(sched, b)[:5]


def test_a_chunk_registers_only_blocks_it_completed() -> None:
    sched = chunked_scheduler(enable_prefix_caching=True, max_num_batched_tokens=6)
    sched.add_request(make_group("a", 0, 20))
    step(sched)  # 6 tokens computed: only block 0 is full
    b = make_group("b", 1, 20)
    sched.add_request(b)
    out = sched.schedule()
    assert plan(out) == [("a", 6)]  # no budget left for b
    sched.update_after_step(out, sample_all(out))  # 12 computed: blocks 0-2
    out = sched.schedule()
    assert plan(out) == [("a", 6)]
    sched.update_after_step(out, sample_all(out))
    out = sched.schedule()
    # a's last chunk (2 tokens), then b hits a's 4 completed blocks (16 tokens).
    assert plan(out) == [("a", 2), ("b", 4)]
    assert out.scheduled[1].num_computed_tokens == 16


def test_preempting_a_partially_prefilled_sequence() -> None:
    sched = chunked_scheduler(num_gpu_blocks=8, max_num_batched_tokens=8)
    a = make_group("a", 0, 4)  # 1 block
    b = make_group("b", 1, 28)  # 7 blocks: the cache is full
    sched.add_request(a)
    sched.add_request(b)
    out = step(sched)
    assert plan(out) == [("a", 4), ("b", 4)] and samples(out) == [("a", True), ("b", False)]
    assert b.seqs[0].num_computed_tokens == 4
    # a grows into a 2nd block: b, in the middle of its prefill, is the victim.
    out = sched.schedule()
    assert ids(out.preempted) == ["b"] and plan(out) == [("a", 1)]
    assert b.seqs[0].num_computed_tokens == 0 and b.seqs[0].status is SequenceStatus.WAITING
    assert not sched.block_manager.has_block_table(b.seqs[0])
    assert table(sched, a) == [0, 1]
    assert ids(sched.waiting) == ["b"] and ids(sched.running) == ["a"]
    sched.update_after_step(out, sample_all(out))
    assert plan(step(sched)) == [("a", 1)]  # b needs 7 blocks, 6 free: LATER
    sched.abort_request("a")
    out = sched.schedule()
    assert plan(out) == [("b", 8)]  # recomputed from the start
    assert out.scheduled[0].num_computed_tokens == 0


def test_chunked_drain_to_completion_frees_everything() -> None:
    sched = chunked_scheduler(num_gpu_blocks=12, max_num_batched_tokens=5, max_num_seqs=3)
    for i in range(6):
        sched.add_request(make_group(f"r{i}", i, 3 + 5 * i))
    for _ in range(300):
        if not sched.has_unfinished_requests():
            break
        out = step(sched)
        assert out.num_batched_tokens <= 5
        for s in out.scheduled:
            if s.samples and (len(s.seq.output_token_ids) >= 4 or s.seq.num_tokens >= sched.max_seq_len):
                sched.finish_sequence(s.group, s.seq, SequenceStatus.FINISHED_LENGTH)
    assert not sched.has_unfinished_requests()
    assert sched.block_manager.num_free_gpu_blocks == 12


# -- property tests ------------------------------------------------------------------


class ChunkedPrefillMachine(SchedulerMachine):
    """The scheduler state machine with chunked prefill (prompts up to 24 tokens run)."""

    chunked_prefill = True


class SlidingWindowMachine(SchedulerMachine):
    """Chunked prefill with a 5-token sliding window: tables are rings of ceil((5 + 16 - 1) / 4) = 5 blocks.

    Sequences grow to 40 tokens (10 logical blocks), so rings wrap; the shadow
    KV check covers each sequence's window, the tokens its next step reads.
    """

    chunked_prefill = True
    sliding_window = 5
    max_model_len = 40

    @invariant()
    def tables_stay_within_the_ring(self) -> None:
        bm = self.sched.block_manager
        assert bm.ring_blocks == 5
        assert all(len(blocks) <= 5 for blocks in bm.block_tables.values())
        if any(s.num_tokens > 20 for g in self.sched.running for s in g.get_seqs(SequenceStatus.RUNNING)):
            event("ring wrapped")


class ChunkedPrefixCachingMachine(PrefixCachingMachine):
    """Both features on: hits plus chunks, registration per completed chunk."""

    chunked_prefill = True

    @rule(prefix=st.integers(0, len(PREFIXES) - 1), extra=st.integers(4, 8), max_tokens=st.integers(1, 8))
    def add_long_shared(self, prefix: int, extra: int, max_tokens: int) -> None:
        # Longer than the 16-token budget: prefilled over two or more chunks.
        self.add_prompt(PREFIXES[prefix] + [3] * extra, max_tokens)


TestChunkedPrefillMachine = ChunkedPrefillMachine.TestCase
TestChunkedPrefillMachine.settings = settings(max_examples=examples(100), stateful_step_count=40, deadline=None)
TestSlidingWindowMachine = SlidingWindowMachine.TestCase
TestSlidingWindowMachine.settings = settings(max_examples=examples(100), stateful_step_count=40, deadline=None)
TestChunkedPrefixCachingMachine = ChunkedPrefixCachingMachine.TestCase
TestChunkedPrefixCachingMachine.settings = settings(max_examples=examples(100), stateful_step_count=40, deadline=None)


def test_ring_size_covers_the_window_plus_one_step_of_tokens() -> None:
    # ceil((5 + 16 - 1) / 4) = 5 blocks; the cache (10 blocks of 4) no longer bounds a sequence's length.
    sched = make_scheduler(num_gpu_blocks=10, max_num_batched_tokens=16, max_model_len=400,
                           enable_chunked_prefill=True, sliding_window=5)
    assert sched.block_manager.ring_blocks == 5 and sched.max_seq_len == 400
    # Without a window, or when the ring would be as long as the longest sequence, blocks are kept.
    assert make_scheduler(num_gpu_blocks=10, max_model_len=400).block_manager.ring_blocks is None
    assert make_scheduler(num_gpu_blocks=40, max_num_batched_tokens=16, max_model_len=20,
                          sliding_window=5).block_manager.ring_blocks is None
    # Prefix caching keeps every block too: a reused block would betray its hash.
    assert make_scheduler(num_gpu_blocks=10, max_model_len=400, max_num_batched_tokens=16,
                          enable_prefix_caching=True, sliding_window=5).block_manager.ring_blocks is None

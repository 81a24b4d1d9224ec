"""Scheduler: FCFS admission, token budget, recompute preemption, abort, ignore."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tests.hypothesis_profiles import examples

from scheduler_service.core.config import CacheConfig, SchedulerConfig
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.core.scheduler_output import ScheduledSequence, SchedulerOutput
from scheduler_service.core.sequence import Sequence, SequenceGroup, SequenceStatus
from shared.sampling_params import SamplingParams

TOKEN = 9  # every sampled token; the values do not matter to the scheduler


def make_scheduler(
    num_gpu_blocks: int = 8,
    block_size: int = 4,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 64,
    watermark: float = 0.0,
    enable_chunked_prefill: bool = False,
    enable_prefix_caching: bool = False,
    num_cpu_blocks: int = 0,
    sliding_window: int | None = None,
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            enable_chunked_prefill=enable_chunked_prefill,
        ),
        CacheConfig(
            block_size=block_size,
            num_gpu_blocks=num_gpu_blocks,
            watermark=watermark,
            enable_prefix_caching=enable_prefix_caching,
            num_cpu_blocks=num_cpu_blocks,
            sliding_window=sliding_window,
        ),
    )


def make_group(request_id: str, seq_id: int, num_prompt: int, arrival_time: float = 0.0) -> SequenceGroup:
    return make_group_of(request_id, seq_id, list(range(1, num_prompt + 1)), arrival_time)


def make_group_of(request_id: str, seq_id: int, prompt: list[int], arrival_time: float = 0.0) -> SequenceGroup:
    return SequenceGroup(request_id, [Sequence(seq_id, prompt)], SamplingParams(), arrival_time)


def plan(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(s.group.request_id, s.num_new_tokens) for s in out.scheduled]


def ids(groups) -> list[str]:
    return [g.request_id for g in groups]


def sample_all(out: SchedulerOutput) -> dict[int, int]:
    return {s.seq.seq_id: TOKEN for s in out.scheduled if s.samples}


def step(sched: Scheduler) -> SchedulerOutput:
    out = sched.schedule()
    sched.update_after_step(out, sample_all(out))
    return out


def table(sched: Scheduler, group: SequenceGroup) -> list[int]:
    return sched.block_manager.get_block_table(group.seqs[0])


# -- configs and sequences -----------------------------------------------------


@pytest.mark.parametrize("field_name", ["max_num_seqs", "max_num_batched_tokens", "max_model_len"])
@pytest.mark.parametrize("value", [0, -3, True, 2.5])
def test_scheduler_config_rejects_non_positive(field_name: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"{field_name} must be a positive integer, got {value!r}"):
        SchedulerConfig(**{field_name: value})


def test_scheduler_config_allows_budget_below_model_len() -> None:
    config = SchedulerConfig(max_num_batched_tokens=512, max_model_len=4096)
    assert (config.max_num_seqs, config.max_num_batched_tokens, config.max_model_len) == (256, 512, 4096)
    assert config.enable_chunked_prefill is False


@pytest.mark.parametrize("value", [1, "false", None])
def test_scheduler_config_rejects_non_bool_chunked_prefill(value: object) -> None:
    with pytest.raises(ValueError, match=f"enable_chunked_prefill must be a bool, got {value!r}"):
        SchedulerConfig(enable_chunked_prefill=value)  # type: ignore[arg-type]


def test_sequence_basics_and_recompute_keeps_outputs() -> None:
    prompt = [5, 6, 7]
    seq = Sequence(3, prompt)
    prompt.append(8)  # the sequence owns a copy
    assert (seq.num_tokens, seq.last_token_id, seq.num_uncomputed_tokens) == (3, 7, 3)
    seq.num_computed_tokens = 3
    seq.append_token(11)
    seq.status = SequenceStatus.RUNNING
    assert (seq.all_token_ids, seq.last_token_id, seq.num_uncomputed_tokens) == ([5, 6, 7, 11], 11, 1)
    seq.reset_for_recompute()
    assert seq.output_token_ids == [11]
    assert (seq.status, seq.num_computed_tokens, seq.num_uncomputed_tokens) == (SequenceStatus.WAITING, 0, 4)


def test_sequence_validation() -> None:
    with pytest.raises(ValueError, match="prompt_token_ids must not be empty"):
        Sequence(0, [])
    with pytest.raises(ValueError, match="num_computed_tokens must be in \\[0, 2\\], got 3"):
        Sequence(0, [1, 2], num_computed_tokens=3)
    with pytest.raises(ValueError, match="prompt_token_ids must hold non-negative ints, got -1"):
        Sequence(0, [1, -1])
    with pytest.raises(ValueError, match="token_id must hold non-negative ints"):
        Sequence(0, [1]).append_token(-2)
    with pytest.raises(ValueError, match="distinct seq_ids"):
        SequenceGroup("r", [Sequence(0, [1]), Sequence(0, [1])], SamplingParams(), 0.0)
    with pytest.raises(ValueError, match="seqs must not be empty"):
        SequenceGroup("r", [], SamplingParams(), 0.0)


def test_status_is_finished() -> None:
    finished = {s for s in SequenceStatus if s.is_finished}
    assert SequenceStatus.WAITING not in finished and SequenceStatus.RUNNING not in finished
    assert len(finished) == 4


def test_scheduled_sequence_snapshot() -> None:
    group = make_group("a", 0, 3)
    seq = group.seqs[0]
    prefill = ScheduledSequence(group, seq, 3)
    assert (prefill.is_prefill, prefill.samples, prefill.token_ids) == (True, True, [1, 2, 3])
    seq.num_computed_tokens = 3
    seq.append_token(TOKEN)
    # Snapshot: still describes the planned prefill after the sequence moved on.
    assert (prefill.is_prefill, prefill.samples) == (True, True)
    decode = ScheduledSequence(group, seq, 1)
    assert (decode.is_prefill, decode.samples, decode.token_ids) == (False, True, [TOKEN])
    with pytest.raises(ValueError, match="num_new_tokens must be in \\[1, 1\\] for seq 0, got 2"):
        ScheduledSequence(group, seq, 2)


# -- admission -----------------------------------------------------------------


def test_prefill_then_decode_exact_blocks() -> None:
    sched = make_scheduler()
    a, b = make_group("a", 0, 5), make_group("b", 1, 3)
    sched.add_request(a)
    sched.add_request(b)
    out = step(sched)
    assert plan(out) == [("a", 5), ("b", 3)]
    assert all(s.is_prefill and s.samples for s in out.scheduled)
    assert out.num_batched_tokens == out.num_prefill_tokens == 8
    assert (table(sched, a), table(sched, b)) == ([0, 1], [2])
    assert ids(sched.running) == ["a", "b"] and not sched.waiting
    assert a.seqs[0].output_token_ids == [TOKEN] and a.seqs[0].num_computed_tokens == 5

    out = step(sched)  # a: 6 tokens fit in 2 blocks; b: 4 tokens fit in 1 block
    assert plan(out) == [("a", 1), ("b", 1)]
    assert not any(s.is_prefill for s in out.scheduled) and out.num_prefill_tokens == 0
    assert (table(sched, a), table(sched, b)) == ([0, 1], [2])
    out = step(sched)  # b's 5th token needs a new block
    assert (table(sched, a), table(sched, b)) == ([0, 1], [2, 3])
    assert out.blocks_to_copy == [] and not out.is_empty


def test_token_budget_is_respected_and_fcfs_is_kept() -> None:
    sched = make_scheduler(num_gpu_blocks=12, max_num_batched_tokens=10)
    for i, n in enumerate([4, 5, 2, 1]):
        sched.add_request(make_group(f"r{i}", i, n))
    out = step(sched)
    # r0 + r1 use 9 of 10 tokens; r2 (2) does not fit, and r3 (1) would but may not jump ahead.
    assert plan(out) == [("r0", 4), ("r1", 5)]
    assert ids(sched.waiting) == ["r2", "r3"]
    out = step(sched)
    assert plan(out) == [("r0", 1), ("r1", 1), ("r2", 2), ("r3", 1)]
    assert (out.num_batched_tokens, out.num_prefill_tokens) == (5, 3)  # two decodes, two prompts


def test_max_num_seqs_limits_admission() -> None:
    sched = make_scheduler(max_num_seqs=2)
    for i in range(3):
        sched.add_request(make_group(f"r{i}", i, 2))
    assert plan(step(sched)) == [("r0", 2), ("r1", 2)]
    assert plan(step(sched)) == [("r0", 1), ("r1", 1)]
    sched.finish_sequence(sched.running[0], sched.running[0].seqs[0], SequenceStatus.FINISHED_STOPPED)
    assert plan(step(sched)) == [("r1", 1), ("r2", 2)]


def test_later_stops_admission_without_skipping() -> None:
    sched = make_scheduler(num_gpu_blocks=8, watermark=0.0)
    sched.add_request(make_group("big", 0, 24))  # 6 blocks
    sched.add_request(make_group("mid", 1, 12))  # 3 blocks: LATER
    sched.add_request(make_group("small", 2, 4))  # 1 block would fit, but must wait its turn
    assert plan(step(sched)) == [("big", 24)]
    assert ids(sched.waiting) == ["mid", "small"]
    assert plan(step(sched)) == [("big", 1)]


def test_watermark_keeps_blocks_free_for_decodes() -> None:
    sched = make_scheduler(num_gpu_blocks=10, watermark=0.2)  # 2 watermark blocks
    sched.add_request(make_group("a", 0, 16))  # 4 blocks
    sched.add_request(make_group("b", 1, 16))  # 4 more would leave 2: OK
    sched.add_request(make_group("c", 2, 1))  # 1 more would leave 1 < 2: LATER
    assert plan(step(sched)) == [("a", 16), ("b", 16)]
    assert ids(sched.waiting) == ["c"]


# -- ignored requests ----------------------------------------------------------


def test_ignored_prompts_do_not_block_the_queue() -> None:
    sched = make_scheduler(num_gpu_blocks=8, max_num_batched_tokens=20, max_model_len=24)
    too_long = make_group("too_long", 0, 25)  # > max_model_len
    over_budget = make_group("over_budget", 1, 21)  # > max_num_batched_tokens
    ok = make_group("ok", 2, 3)
    for group in (too_long, over_budget, ok):
        sched.add_request(group)
    out = step(sched)
    assert ids(out.ignored) == ["too_long", "over_budget"]
    assert plan(out) == [("ok", 3)]
    assert too_long.seqs[0].status is SequenceStatus.FINISHED_IGNORED
    assert over_budget.seqs[0].status is SequenceStatus.FINISHED_IGNORED
    assert sched.get_num_unfinished_requests() == 1
    assert sched.abort_request("too_long") is None


def test_prompt_larger_than_cache_is_ignored() -> None:
    sched = make_scheduler(num_gpu_blocks=4, watermark=0.25)  # 3 usable blocks
    sched.add_request(make_group("huge", 0, 13))  # 4 blocks: NEVER
    sched.add_request(make_group("fits", 1, 12))
    out = step(sched)
    assert ids(out.ignored) == ["huge"] and plan(out) == [("fits", 12)]
    assert sched.max_seq_len == 12


def test_max_seq_len_is_the_tightest_limit() -> None:
    assert make_scheduler(num_gpu_blocks=100, max_num_batched_tokens=30, max_model_len=40).max_seq_len == 30
    assert make_scheduler(num_gpu_blocks=100, max_num_batched_tokens=50, max_model_len=40).max_seq_len == 40
    # Chunked prefill splits a recompute over several steps: the budget is no limit.
    chunked = make_scheduler(num_gpu_blocks=100, max_num_batched_tokens=30, max_model_len=40, enable_chunked_prefill=True)
    assert chunked.max_seq_len == 40
    assert make_scheduler(num_gpu_blocks=5, max_num_batched_tokens=8, enable_chunked_prefill=True).max_seq_len == 20


# -- preemption ----------------------------------------------------------------


def test_last_group_preempts_itself_when_it_cannot_grow() -> None:
    sched = make_scheduler(num_gpu_blocks=8)
    groups = [make_group(name, i, 8) for i, name in enumerate("abc")]  # 2 blocks each
    for group in groups:
        sched.add_request(group)
    sched.add_request(make_group("d", 3, 4))  # would need 1 of the 2 free blocks: admitted
    assert plan(step(sched)) == [("a", 8), ("b", 8), ("c", 8), ("d", 4)]
    # a, b, c each need a 3rd block; only 1 free -> a gets 7, then b needs one:
    # preempt d (last), b gets 6; c needs one and is last now: preempt c itself.
    out = sched.schedule()
    assert ids(out.preempted) == ["d", "c"]
    assert plan(out) == [("a", 1), ("b", 1)]
    assert ids(sched.waiting) == ["c", "d"]  # front of waiting, FCFS order kept
    assert ids(sched.running) == ["a", "b"]
    assert (table(sched, groups[0]), table(sched, groups[1])) == ([0, 1, 7], [2, 3, 6])
    assert sched.block_manager.num_free_gpu_blocks == 2
    c = groups[2].seqs[0]
    assert c.status is SequenceStatus.WAITING and c.num_computed_tokens == 0
    assert c.output_token_ids == [TOKEN]  # recompute keeps outputs
    assert not sched.block_manager.has_block_table(c)
    sched.update_after_step(out, sample_all(out))


def test_preemption_victim_is_last_arrived_and_recompute_replays_outputs() -> None:
    sched = make_scheduler(num_gpu_blocks=8)
    a, b = make_group("a", 0, 8), make_group("b", 1, 24)  # 2 + 6 blocks: cache full
    sched.add_request(a)
    sched.add_request(b)
    assert plan(step(sched)) == [("a", 8), ("b", 24)]
    out = step(sched)  # a needs a 3rd block: preempt b, the last arrival
    assert ids(out.preempted) == ["b"] and plan(out) == [("a", 1)]
    assert table(sched, a) == [0, 1, 2]
    assert ids(sched.waiting) == ["b"]
    # No admission in a step that preempted, and b (25 tokens = 7 blocks) is LATER now.
    out = step(sched)
    assert plan(out) == [("a", 1)] and not out.preempted
    assert ids(sched.waiting) == ["b"]
    sched.abort_request("a")
    assert sched.block_manager.num_free_gpu_blocks == 8
    out = sched.schedule()
    assert plan(out) == [("b", 25)]
    (resumed,) = out.scheduled
    assert resumed.is_prefill and resumed.samples
    assert resumed.token_ids == list(range(1, 25)) + [TOKEN]
    assert table(sched, b) == [0, 1, 2, 3, 4, 5, 6]
    sched.update_after_step(out, {1: 42})
    assert b.seqs[0].output_token_ids == [TOKEN, 42]
    assert b.seqs[0].num_computed_tokens == 25


def test_schedule_names_each_sequence_whose_kv_left_the_device_once() -> None:
    """released_seq_ids: what the worker must forget before the step (preempted, finished, aborted)."""
    sched = make_scheduler(num_gpu_blocks=8)
    a, b = make_group("a", 0, 8), make_group("b", 1, 24)
    sched.add_request(a)
    sched.add_request(b)
    assert step(sched).released_seq_ids == []
    out = step(sched)  # a grows: b is preempted (recompute) in this very step
    assert ids(out.preempted) == ["b"] and out.released_seq_ids == [1]
    assert step(sched).released_seq_ids == []  # b waits, holding nothing: nothing more to forget
    sched.finish_sequence(a, a.seqs[0], SequenceStatus.FINISHED_STOPPED)
    out = step(sched)  # b comes back (sent in full), a is forgotten
    assert out.released_seq_ids == [0] and plan(out) == [("b", 25)]
    sched.abort_request("b")
    sched.abort_request("b")  # twice: still once
    assert sched.schedule().released_seq_ids == [1]
    assert sched.schedule().released_seq_ids == []


# -- abort, finish, update -------------------------------------------------------


def test_abort_frees_blocks_and_dequeues() -> None:
    sched = make_scheduler()
    a, b, c = make_group("a", 0, 5), make_group("b", 1, 4), make_group("c", 2, 30)
    for group in (a, b, c):
        sched.add_request(group)
    step(sched)  # a: [0, 1], b: [2]; c does not fit the 5 free blocks (8 needed)
    assert sched.abort_request("a") is a
    assert a.seqs[0].status is SequenceStatus.FINISHED_ABORTED
    assert sched.block_manager.num_free_gpu_blocks == 7
    assert sched.abort_request("c") is c  # waiting
    assert ids(sched.running) == ["b"] and not sched.waiting
    assert sched.abort_request("a") is None
    assert sched.abort_request("b") is b
    assert sched.block_manager.num_free_gpu_blocks == 8
    assert not sched.has_unfinished_requests()


def test_abort_during_step_is_skipped_by_update() -> None:
    sched = make_scheduler()
    a, b = make_group("a", 0, 3), make_group("b", 1, 3)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    sched.abort_request("a")
    sched.update_after_step(out, {0: 1, 1: 2})  # the worker still returns a's sample
    assert a.seqs[0].output_token_ids == [] and b.seqs[0].output_token_ids == [2]


def test_update_requires_every_sample_and_changes_nothing_on_error() -> None:
    sched = make_scheduler()
    a, b = make_group("a", 0, 3), make_group("b", 1, 3)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    with pytest.raises(ValueError, match="no token for scheduled seq_ids \\[1\\]"):
        sched.update_after_step(out, {0: 5})
    with pytest.raises(ValueError, match="seq_ids \\[7\\] that were not scheduled"):
        sched.update_after_step(out, {0: 5, 1: 6, 7: 1})
    with pytest.raises(ValueError, match="non-negative ints"):
        sched.update_after_step(out, {0: 5, 1: -6})
    assert a.seqs[0].num_computed_tokens == 0 and a.seqs[0].output_token_ids == []
    sched.update_after_step(out, {0: 5, 1: 6})
    with pytest.raises(ValueError, match="changed since it was scheduled"):
        sched.update_after_step(out, {0: 5, 1: 6})


def test_finish_sequence_frees_and_leaves_running() -> None:
    sched = make_scheduler()
    a = make_group("a", 0, 5)
    sched.add_request(a)
    step(sched)
    with pytest.raises(ValueError, match="must be a FINISHED_\\* status, got RUNNING"):
        sched.finish_sequence(a, a.seqs[0], SequenceStatus.RUNNING)
    sched.finish_sequence(a, a.seqs[0], SequenceStatus.FINISHED_LENGTH)
    assert a.seqs[0].status is SequenceStatus.FINISHED_LENGTH
    assert not sched.running and sched.block_manager.num_free_gpu_blocks == 8
    assert sched.schedule().is_empty
    with pytest.raises(ValueError, match="not an active sequence"):
        sched.finish_sequence(a, a.seqs[0], SequenceStatus.FINISHED_STOPPED)


def test_add_request_validation() -> None:
    sched = make_scheduler()
    sched.add_request(make_group("a", 0, 2))
    with pytest.raises(ValueError, match="request_id 'a' is already scheduled"):
        sched.add_request(make_group("a", 1, 2))
    with pytest.raises(ValueError, match="seq_id 0 is already in use"):
        sched.add_request(make_group("b", 0, 2))
    done = make_group("c", 5, 2)
    done.seqs[0].status = SequenceStatus.FINISHED_ABORTED
    with pytest.raises(ValueError, match="must be WAITING, got FINISHED_ABORTED"):
        sched.add_request(done)


def test_drain_to_completion_frees_everything() -> None:
    sched = make_scheduler(num_gpu_blocks=8, max_num_batched_tokens=16, max_num_seqs=3)
    for i in range(6):
        sched.add_request(make_group(f"r{i}", i, 3 + 2 * i))
    for _ in range(200):
        if not sched.has_unfinished_requests():
            break
        out = step(sched)
        assert out.num_batched_tokens <= 16
        for s in out.scheduled:
            if len(s.seq.output_token_ids) >= 6 or s.seq.num_tokens >= sched.max_seq_len:
                sched.finish_sequence(s.group, s.seq, SequenceStatus.FINISHED_LENGTH)
    assert not sched.has_unfinished_requests()
    assert sched.block_manager.num_free_gpu_blocks == 8


# -- property test ---------------------------------------------------------------


def make_parallel_group(request_id: str, first_seq_id: int, prompt: list[int], n: int, arrival_time: float = 0.0) -> SequenceGroup:
    """A request with n sequences (parallel sampling), seq ids first_seq_id.. first_seq_id + n - 1."""
    seqs = [Sequence(first_seq_id + i, prompt) for i in range(n)]
    return SequenceGroup(request_id, seqs, SamplingParams(), arrival_time)


class SchedulerMachine(RuleBasedStateMachine):
    """Random add / schedule / update / finish / abort; blocks never leak.

    Requests have 1 to 3 sequences (parallel sampling: fork before the last
    prompt token, copy-on-write). Subclasses switch chunked prefill and prefix
    caching on. A shadow of the worker's KV cache (block -> slot -> token) is
    written by every step (copies first, as the worker does), so every
    computed token of a running sequence can be checked to sit in its table's
    blocks: forked children see the parent's tokens through the shared blocks,
    and a wrong prefix-cache hit, a missed copy or a write into a shared block
    shows up as a mismatch. Sampled tokens differ per sequence so that forked
    sequences really diverge; blocks back in the plain free list lose their
    shadow contents.

    A small CPU pool makes forked groups swap out (and sometimes fail for
    lack of CPU room) under pressure: a second shadow (CPU block -> slot ->
    token) follows the swap pairs in the worker's order (swap_out, swap_in,
    copy), so a swapped sequence's computed tokens are checked in its CPU
    blocks and, once back, in its new device blocks.
    """

    chunked_prefill = False
    prefix_caching = False
    num_cpu_blocks = 6
    max_model_len = 24
    # With a window, tables are rings: only the tokens of the window before each sequence's next
    # position must still be in its blocks.
    sliding_window: int | None = None

    def __init__(self) -> None:
        super().__init__()
        self.sched = make_scheduler(
            num_gpu_blocks=10,
            block_size=4,
            max_num_seqs=4,
            max_num_batched_tokens=16,
            max_model_len=self.max_model_len,
            watermark=0.1,
            enable_chunked_prefill=self.chunked_prefill,
            enable_prefix_caching=self.prefix_caching,
            num_cpu_blocks=self.num_cpu_blocks,
            sliding_window=self.sliding_window,
        )
        self.next_id = 0
        self.pending: SchedulerOutput | None = None
        self.pending_tables: dict[int, list[int]] = {}
        self.worker_tables: dict[int, list[int]] = {}
        self.max_tokens: dict[int, int] = {}
        self.groups: list[SequenceGroup] = []
        self.kv: dict[int, dict[int, int]] = {}
        self.cpu_kv: dict[int, dict[int, int]] = {}
        # request_id -> prompt tokens before the last one computed so far, over
        # all its sequences; checked to stay within one prompt's worth for
        # groups never preempted (the prompt is computed once, by the parent).
        self.prompt_work: Counter[str] = Counter()
        self.recomputed: set[str] = set()

    def add_prompt(self, prompt: list[int], max_tokens: int, n: int = 1) -> None:
        group = make_parallel_group(f"r{self.next_id}", self.next_id, prompt, n, arrival_time=float(self.next_id))
        for seq in group.seqs:
            self.max_tokens[seq.seq_id] = max_tokens
        self.next_id += n
        self.sched.add_request(group)
        self.groups.append(group)

    # Mostly prompts that fit, some that must be ignored (> 16-token budget
    # without chunking, > 24-token model length); long outputs create the cache
    # pressure that forces preemption.
    @rule(prompt_len=st.integers(1, 14) | st.integers(1, 30), max_tokens=st.integers(1, 24), n=st.integers(1, 3))
    def add(self, prompt_len: int, max_tokens: int, n: int) -> None:
        self.add_prompt(list(range(1, prompt_len + 1)), max_tokens, n)

    def classify_running(self) -> tuple[set[int], set[int]]:
        """seq_ids that the next step decodes (1 token, sampled) and that it prefills."""
        decoding: set[int] = set()
        prefilling: set[int] = set()
        for group in self.sched.running:
            running = group.get_seqs(SequenceStatus.RUNNING)
            pending = group.pending_fork_seqs()
            if pending:
                (parent,) = running
                if parent.num_computed_tokens == len(parent.prompt_token_ids) - 1:
                    decoding.update(s.seq_id for s in running + pending)  # forks into n decodes
                else:
                    prefilling.add(parent.seq_id)
                continue
            for seq in running:
                (decoding if seq.num_uncomputed_tokens == 1 else prefilling).add(seq.seq_id)
        return decoding, prefilling

    @precondition(lambda self: self.pending is None)
    @rule()
    def schedule(self) -> None:
        running_before = list(self.sched.running)
        swapped_before = list(self.sched.swapped)
        pending_before = {s.seq_id for g in running_before for s in g.pending_fork_seqs()}
        decoding, prefilling = self.classify_running()
        out = self.sched.schedule()
        config = self.sched.scheduler_config
        alloc = self.sched.block_manager.block_pool
        assert out.num_batched_tokens == sum(s.num_new_tokens for s in out.scheduled)
        assert out.num_batched_tokens <= config.max_num_batched_tokens
        assert len(out.scheduled) <= config.max_num_seqs
        assert len({s.seq.seq_id for s in out.scheduled}) == len(out.scheduled)
        # What the worker sees when the step runs: swaps and copies are applied first.
        kv, cpu_kv = dict(self.kv), dict(self.cpu_kv)
        self.apply_block_ops(out, kv, cpu_kv)
        # Never both swap directions in one step, no swap-in in a step that preempted.
        assert not (out.blocks_to_swap_out and out.blocks_to_swap_in)
        if out.preempted or out.swap_failed:
            assert not out.blocks_to_swap_in
        swapped_in = [g for g in swapped_before if any(g is r for r in self.sched.running)]
        assert bool(swapped_in) == bool(out.blocks_to_swap_in)
        for g in swapped_in:
            # Resumed as 1-token decodes of every sequence, computed tokens kept.
            items = [s for s in out.scheduled if s.group is g]
            assert {s.seq.seq_id for s in items} == {s.seq_id for s in g.get_seqs(SequenceStatus.RUNNING)}
            assert len(items) > 1 and all(s.num_new_tokens == 1 and s.samples for s in items)
        for s in out.scheduled:
            if not any(s.group is g for g in running_before + swapped_in):
                # An admission: only once nothing is swapped out (swapped in or ignored as NEVER).
                assert not self.sched.swapped
                assert all(any(g is x for x in swapped_in + out.ignored) for g in swapped_before)
        for s in out.scheduled:
            prompt_len = len(s.seq.prompt_token_ids)
            # The parent of a group that has not forked stops before its last prompt token.
            capped = bool(s.group.pending_fork_seqs())
            if capped:
                assert s.num_computed_tokens + s.num_new_tokens <= prompt_len - 1 and not s.samples
            if not self.chunked_prefill:
                assert s.samples or capped  # without chunking every other scheduled seq samples
            elif not s.samples and not capped:
                # A chunk is cut short only by the budget, which it then used up (up
                # to the remainder of splitting it evenly between a group's sequences).
                assert config.max_num_batched_tokens - out.num_batched_tokens < len(s.group.seqs)
            if s.seq.seq_id in pending_before:
                # The fork step: every child computes the last prompt token and samples.
                assert (s.num_computed_tokens, s.num_new_tokens, s.samples) == (prompt_len - 1, 1, True)
                event("forked")
            table = list(self.sched.block_manager.logical_block_table(s.seq))
            assert len(table) * 4 >= s.num_computed_tokens + s.num_new_tokens
            # Never write into a block another table holds (copy-on-write came first).
            for pos in range(s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens):
                assert alloc.get_ref_count(table[pos // 4]) == 1, (s.seq.seq_id, pos)
            self.check_computed_kv(s.seq, kv)
            if s.seq.seq_id not in decoding and s.seq.seq_id not in prefilling and s.num_computed_tokens:
                event("admitted with a prefix-cache hit")
            start, end = s.num_computed_tokens, min(s.num_computed_tokens + s.num_new_tokens, prompt_len - 1)
            self.prompt_work[s.group.request_id] += max(0, end - start)
        # Decodes first, then running prefills, then admissions; a budget of 16
        # covers 4 decodes, so no running decode is ever left out.
        ranks = [0 if s.seq.seq_id in decoding else 1 if s.seq.seq_id in prefilling else 2 for s in out.scheduled]
        if self.chunked_prefill:
            assert ranks == sorted(ranks)
        still_running = {s.seq_id for g in self.sched.running for s in g.get_seqs(SequenceStatus.RUNNING)}
        assert decoding & still_running <= {s.seq.seq_id for s in out.scheduled}
        for name, happened in (
            ("preempted", out.preempted),
            ("preempted a forked group", [g for g in out.preempted if any(s.output_token_ids for s in g.seqs[1:])]),
            ("ignored", out.ignored),
            ("cow", out.blocks_to_copy),
            ("partial chunk", [s for s in out.scheduled if not s.samples]),
            ("parallel sampling", [s for s in out.scheduled if len(s.group.seqs) > 1]),
            ("swapped out", out.blocks_to_swap_out),
            ("swapped in", out.blocks_to_swap_in),
            ("swap failed", out.swap_failed),
        ):
            if happened:
                event(name)
        victims = out.preempted + out.swap_failed
        if victims:
            # Victims are taken from the back of the running list.
            n = len(victims)
            assert sorted(ids(victims)) == sorted(ids(running_before[-n:]))
            swapped_now = [g for g in running_before[-n:] if any(g is w for w in self.sched.swapped)]
            recomputed = [g for g in running_before[-n:] if any(g is w for w in self.sched.waiting)]
            assert len(swapped_now) + len(recomputed) == len(out.preempted)
            assert ids(list(self.sched.waiting)[: len(recomputed)]) == ids(recomputed)
            assert ids(list(self.sched.swapped)[: len(swapped_now)]) == ids(swapped_now)
            for g in swapped_now:
                # Swapped only forked groups, all decoding.
                assert len(g.get_seqs(SequenceStatus.SWAPPED)) > 1
            for g in out.swap_failed:
                assert g.is_finished() and all(s.status is not SequenceStatus.SWAPPED for s in g.seqs)
            assert not any(s.group in victims for s in out.scheduled)
            # No admission in a step that preempted.
            assert all(any(s.group is g for g in running_before) for s in out.scheduled)
            if not self.chunked_prefill:
                assert all(s.num_new_tokens == 1 for s in out.scheduled)
            self.recomputed.update(g.request_id for g in recomputed)
        for group in running_before + list(self.sched.running):
            if group.request_id not in self.recomputed:
                assert self.prompt_work[group.request_id] <= len(group.seqs[0].prompt_token_ids) - 1
        self.pending = out
        # The worker's tables are built from what the plans tell it (dropped ids, tables in full, deltas) and
        # must be the scheduler's logical tables; the shadow KV is written through them.
        for seq_id in out.released_seq_ids:
            self.worker_tables.pop(seq_id, None)
        for s in out.scheduled:
            update = s.table
            if update.in_full:
                self.worker_tables[s.seq.seq_id] = list(update.block_ids)
                continue
            held = self.worker_tables[s.seq.seq_id]
            assert update.start == len(held) and all(i < len(held) for i in update.replaced)
            for index, block_id in update.replaced.items():
                held[index] = block_id
            held.extend(update.block_ids)
            event("delta with new blocks" if update.block_ids else "delta without new blocks")
            if update.replaced:
                event("delta replaces a block")
        self.pending_tables = {s.seq.seq_id: list(self.worker_tables[s.seq.seq_id]) for s in out.scheduled}
        # A ring's copy-on-write also renames the entry's older logical blocks, which the window never reads.
        recent = -(self.sched.block_manager.ring_blocks or 0)
        for s in out.scheduled:
            view = self.sched.block_manager.logical_block_table(s.seq)
            assert self.pending_tables[s.seq.seq_id][recent:] == view[recent:] and len(view) == len(
                self.pending_tables[s.seq.seq_id])

    def replace_scheduler(self, rebuilt: Scheduler) -> None:
        """Go on with a scheduler rebuilt from the live one's state, as a new owner after a takeover."""
        by_id = {g.request_id: g for g in (*rebuilt.waiting, *rebuilt.running, *rebuilt.swapped)}
        self.groups = [by_id.get(g.request_id, g) for g in self.groups]
        self.sched = rebuilt
        # As after the takeover's Resume: the worker holds each device table as the rebuilt scheduler has it.
        bm = rebuilt.block_manager
        self.worker_tables = {s.seq_id: list(bm.logical_block_table(s))
                              for g in rebuilt.running for s in g.seqs if bm.has_block_table(s)}

    @staticmethod
    def token_for(seq: Sequence) -> int:
        """A sampled token that differs between the sequences of a group."""
        return 100 + (seq.seq_id * 7 + seq.num_tokens) % 13

    @precondition(lambda self: self.pending is not None)
    @rule()
    def update(self) -> None:
        out, self.pending = self.pending, None
        # The worker: swaps and copies first, then the KV of every scheduled
        # token, even for sequences aborted since (it ran the step anyway).
        self.apply_block_ops(out, self.kv, self.cpu_kv)
        for s in out.scheduled:
            table = self.pending_tables[s.seq.seq_id]
            for pos in range(s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens):
                self.kv.setdefault(table[pos // 4], {})[pos % 4] = s.seq.all_token_ids[pos]
        sampled = {s.seq.seq_id: self.token_for(s.seq) for s in out.scheduled if s.samples and not s.seq.is_finished}
        self.sched.update_after_step(out, sampled)
        for s in out.scheduled:
            seq = s.seq
            if seq.is_finished:
                continue
            if len(seq.output_token_ids) >= self.max_tokens[seq.seq_id] or seq.num_tokens >= self.sched.max_seq_len:
                self.sched.finish_sequence(s.group, seq, SequenceStatus.FINISHED_LENGTH)

    @rule(data=st.data())
    def finish_one(self, data: st.DataObject) -> None:
        # Any unfinished sequence of a running group, a pending-fork one or a
        # parent still prefilling for its siblings included.
        live = [(g, s) for g in self.sched.running for s in g.unfinished_seqs()]
        if live:
            group, seq = data.draw(st.sampled_from(live))
            if group.pending_fork_seqs() and seq.status is SequenceStatus.RUNNING:
                event("finished a parent before its fork")
                if self.steps_outstanding():
                    # The heir takes over the parent's table, but not the in-flight step's progress.
                    self.recomputed.add(group.request_id)
            self.sched.finish_sequence(group, seq, SequenceStatus.FINISHED_STOPPED)

    def steps_outstanding(self) -> bool:
        """A planned step has not been applied yet."""
        return self.pending is not None

    @rule(data=st.data())
    def abort_one(self, data: st.DataObject) -> None:
        if self.groups:
            group = data.draw(st.sampled_from(self.groups))
            result = self.sched.abort_request(group.request_id)
            assert result is None or result is group

    @staticmethod
    def apply_block_ops(
        out: SchedulerOutput, kv: dict[int, dict[int, int]], cpu_kv: dict[int, dict[int, int]]
    ) -> None:
        """The worker's order: swap_out (device -> cpu), swap_in (cpu -> device), then copies."""
        for dev, cpu in out.blocks_to_swap_out:
            cpu_kv[cpu] = dict(kv.get(dev, {}))
        for cpu, dev in out.blocks_to_swap_in:
            kv[dev] = dict(cpu_kv.get(cpu, {}))
        for src, dst in out.blocks_to_copy:
            kv[dst] = dict(kv.get(src, {}))

    def check_computed_kv(self, seq: Sequence, kv: dict[int, dict[int, int]] | None = None) -> None:
        """Every computed token of seq is in the shadow KV (self.kv by default) of its table's blocks.

        A swapped-out sequence is checked in the CPU shadow of its CPU table.
        """
        bm = self.sched.block_manager
        if seq.status is SequenceStatus.SWAPPED:
            kv, table = self.cpu_kv, bm.swapper.cpu_tables[seq.seq_id]
        else:
            kv = self.kv if kv is None else kv
            table = bm.get_block_table(seq)
        ring = bm.ring_blocks or len(table)
        tokens = seq.all_token_ids
        first = 0 if self.sliding_window is None else max(0, seq.num_computed_tokens - self.sliding_window + 1)
        for pos in range(first, seq.num_computed_tokens):
            assert kv.get(table[(pos // 4) % ring], {}).get(pos % 4) == tokens[pos], (seq.seq_id, pos)

    @invariant()
    def blocks_are_consistent(self) -> None:
        bm = self.sched.block_manager
        alloc = bm.block_pool
        owners = Counter(b for table in bm.block_tables.values() for b in table)
        for block_id in range(bm.num_gpu_blocks):
            ref = alloc.get_ref_count(block_id)
            assert ref >= 0
            # A block in several tables must be ref counted that many times.
            assert ref == owners[block_id]
        free = alloc.free_block_ids()
        assert len(set(free)) == len(free) and not set(free) & set(owners)
        assert bm.num_free_gpu_blocks == len(free) == sum(1 for b in range(bm.num_gpu_blocks) if owners[b] == 0)
        assert bm.num_free_gpu_blocks + bm.get_num_used_blocks() == bm.num_gpu_blocks
        if self.pending is None:
            # Plain free blocks hold garbage: forget their shadow (cached, evictable ones keep it).
            # Not while a step is in flight: its copies may still read a block freed since it was planned.
            evictable = set(alloc.evictor.block_ids())
            for block_id in set(free) - evictable:
                self.kv.pop(block_id, None)
        running_seqs = {s.seq_id for g in self.sched.running for s in g.get_seqs(SequenceStatus.RUNNING)}
        assert set(bm.block_tables) == running_seqs
        # The CPU pool: same accounting, tables of exactly the swapped sequences.
        cpu = bm.swapper.cpu_pool
        assert cpu is not None and bm.num_cpu_blocks == self.num_cpu_blocks
        cpu_owners = Counter(b for t in bm.swapper.cpu_tables.values() for b in t)
        for block_id in range(bm.num_cpu_blocks):
            assert cpu.get_ref_count(block_id) == cpu_owners[block_id]
        cpu_free = cpu.free_block_ids()
        assert len(set(cpu_free)) == len(cpu_free) and not set(cpu_free) & set(cpu_owners)
        assert bm.num_free_cpu_blocks == len(cpu_free) == bm.num_cpu_blocks - len(cpu_owners)
        assert bm.num_free_cpu_blocks + (bm.num_cpu_blocks - bm.num_free_cpu_blocks) == bm.num_cpu_blocks
        if self.pending is None:
            for block_id in cpu_free:
                self.cpu_kv.pop(block_id, None)
        swapped_seqs = {s.seq_id for g in self.sched.swapped for s in g.get_seqs(SequenceStatus.SWAPPED)}
        assert set(bm.swapper.cpu_tables) == swapped_seqs
        for group in self.sched.swapped:
            assert all(s.status is SequenceStatus.SWAPPED for s in group.unfinished_seqs())
            if self.pending is None:
                for seq in group.unfinished_seqs():
                    self.check_computed_kv(seq)
        # max_num_seqs counts sequences, pending-fork ones included.
        assert sum(len(g.unfinished_seqs()) for g in self.sched.running) <= self.sched.scheduler_config.max_num_seqs
        for group in self.sched.running:
            pending = group.pending_fork_seqs()
            if pending:
                # Not forked yet: one parent prefilling the prompt (but its last token) for all.
                (parent,) = group.get_seqs(SequenceStatus.RUNNING)
                assert not parent.output_token_ids
                assert parent.num_computed_tokens <= len(parent.prompt_token_ids) - 1
                assert all(not s.output_token_ids and s.num_computed_tokens == 0 for s in pending)
            else:
                assert all(s.status is SequenceStatus.RUNNING for s in group.unfinished_seqs())
            for seq in group.get_seqs(SequenceStatus.RUNNING):
                assert len(bm.logical_block_table(seq)) * 4 >= seq.num_computed_tokens
                if self.pending is None:
                    self.check_computed_kv(seq)
        for group in self.sched.waiting:
            assert all(s.status is SequenceStatus.WAITING for s in group.unfinished_seqs())

    def teardown(self) -> None:
        # Drive everything to completion as an engine loop would.
        if self.pending is not None:
            self.update()
        for _ in range(500):
            if not self.sched.has_unfinished_requests():
                break
            self.schedule()
            self.update()
        assert not self.sched.has_unfinished_requests()
        assert self.sched.block_manager.num_free_gpu_blocks == 10
        assert self.sched.block_manager.get_num_used_blocks() == 0
        assert self.sched.block_manager.block_tables == {}
        assert self.sched.block_manager.swapper.cpu_tables == {}
        assert self.sched.block_manager.num_free_cpu_blocks == self.num_cpu_blocks


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(max_examples=examples(150), stateful_step_count=40, deadline=None)


def test_kv_occupancy_counts_filled_slots_of_allocated_blocks_once() -> None:
    sched = make_scheduler(num_gpu_blocks=8, block_size=4)
    sched.add_request(make_group("a", 1, 6))  # 6 tokens: 2 blocks, 6 of 8 slots hold a token
    sched.add_request(make_group("b", 2, 4))  # 4 tokens: 1 full block
    step(sched)
    # After the step each has one sampled token more: a's fits its second block (7 of 8 slots), b's
    # needs a block the next schedule() allocates (its one block counts as full).
    assert sched.kv_occupancy() == (12, 11)
    sched.schedule()
    assert sched.kv_occupancy() == (16, 12)

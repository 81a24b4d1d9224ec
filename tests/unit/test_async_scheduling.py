"""Async scheduling in the scheduler core: step N+1 planned while step N runs (Scheduler.advance / resolve)."""

from __future__ import annotations

import pytest
from hypothesis import event, settings
from hypothesis.stateful import precondition, rule

from tests.hypothesis_profiles import examples

from scheduler_service.core.scheduler import Scheduler
from scheduler_service.core.scheduler_output import SchedulerOutput
from scheduler_service.core.sequence import SequenceGroup, SequenceStatus
from scheduler_service.planner import Planner
from shared.sampling_params import SamplingParams
from tests.unit.test_scheduler import SchedulerMachine, make_group, make_parallel_group, make_scheduler, plan


def token_at(seq_id: int, position: int) -> int:
    """The token a sequence samples at a position: the same whichever mode planned the step."""
    return 100 + (seq_id * 7 + position) % 13


def sampled(out: SchedulerOutput) -> dict[int, int]:
    # item.num_tokens (a snapshot, in-flight tokens included) is the position of the token it samples.
    return {s.seq.seq_id: token_at(s.seq.seq_id, s.num_tokens) for s in out.scheduled if s.samples}


def test_the_next_step_decodes_the_token_in_flight() -> None:
    sched = make_scheduler()
    group = make_group("a", 1, 6)
    sched.add_request(group)
    first = sched.schedule()
    sched.advance(first)
    seq = group.seqs[0]
    assert (seq.num_computed_tokens, seq.num_inflight_tokens, seq.output_token_ids) == (6, 1, [])
    assert seq.num_tokens == 7
    second = sched.schedule()  # planned before the first step's result
    assert plan(second) == [("a", 1)] and second.scheduled[0].samples
    sched.resolve(first, {1: 42})
    assert (seq.num_inflight_tokens, seq.output_token_ids) == (0, [42])
    sched.advance(second)
    sched.resolve(second, {1: 43})
    assert seq.output_token_ids == [42, 43] and seq.num_computed_tokens == 7


def test_a_preempted_sequence_keeps_its_token_and_a_finished_one_drops_it() -> None:
    sched = make_scheduler()
    a, b = make_group("a", 1, 4), make_group("b", 2, 4)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    sched.advance(out)
    sched.abort_request("b")
    # Preempted by recompute while its token was in flight: the token stays the sequence's.
    a.seqs[0].reset_for_recompute()
    sched.resolve(out, {1: 7, 2: 8})
    assert a.seqs[0].output_token_ids == [7] and a.seqs[0].num_inflight_tokens == 0
    assert b.seqs[0].output_token_ids == [] and b.seqs[0].num_inflight_tokens == 0


def test_resolve_checks_the_sampled_tokens() -> None:
    sched = make_scheduler()
    sched.add_request(make_group("a", 1, 4))
    out = sched.schedule()
    sched.advance(out)
    with pytest.raises(ValueError, match="no token for scheduled seq_ids"):
        sched.resolve(out, {})
    with pytest.raises(ValueError, match="not scheduled to sample"):
        sched.resolve(out, {1: 3, 5: 3})


def test_a_token_in_flight_that_ends_the_sequence_by_length_is_not_decoded() -> None:
    sched = make_scheduler()
    group = SequenceGroup("a", [make_group("a", 1, 4).seqs[0]], SamplingParams(max_tokens=1), 0.0)
    sched.add_request(group)
    out = sched.schedule()
    sched.advance(out)
    # Its one token is in flight: whatever it is, the request ends with it.
    assert sched.schedule().scheduled == []
    sched.resolve(out, {1: 5})
    sched.finish_sequence(group, group.seqs[0], SequenceStatus.FINISHED_LENGTH)
    assert not sched.has_unfinished_requests()


def test_the_planner_refuses_to_send_a_token_in_flight_in_full() -> None:
    sched = make_scheduler()
    group = make_group("a", 1, 4)
    sched.add_request(group)
    sched.advance(sched.schedule())
    out = sched.schedule()
    assert Planner(epoch=1).build(out).cached_sequences[0].seq_id == 1  # the worker holds it: a delta is fine
    out.scheduled[0].table.in_full = True  # as if the worker had never seen seq 1
    with pytest.raises(RuntimeError, match="in flight"):
        Planner(epoch=1).build(out)


def _drive(sched: Scheduler, groups: list[SequenceGroup], overlap: bool) -> dict[int, tuple[str, list[int]]]:
    """Runs every request to its end, synchronously or one step ahead; (status, outputs) per seq_id."""
    for g in groups:
        sched.add_request(g)
    inflight: SchedulerOutput | None = None
    for _ in range(2000):
        if inflight is None and not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        if not overlap:
            sched.update_after_step(out, sampled(out))
            _finish_by_length(sched, out)
            continue
        if inflight is not None:
            sched.resolve(inflight, sampled(inflight))
            _finish_by_length(sched, inflight)
        sched.advance(out)
        inflight = out if out.scheduled else None
    assert not sched.has_unfinished_requests() and inflight is None
    assert sched.block_manager.num_free_gpu_blocks == sched.cache_config.num_gpu_blocks
    return {s.seq_id: (s.status.name, list(s.output_token_ids)) for g in groups for s in g.seqs}


def _finish_by_length(sched: Scheduler, out: SchedulerOutput) -> None:
    for item in out.scheduled:
        seq, params = item.seq, item.group.sampling_params
        if not item.samples or seq.is_finished or seq.num_inflight_tokens:
            continue
        if len(seq.output_token_ids) >= (params.max_tokens or 1 << 30) or seq.num_tokens >= sched.max_seq_len:
            sched.finish_sequence(item.group, seq, SequenceStatus.FINISHED_LENGTH)


def _requests() -> list[SequenceGroup]:
    groups = []
    for i in range(8):
        n = 1 + i % 3
        group = make_parallel_group(f"r{i}", 10 * i, [1 + (i * 5 + j) % 17 for j in range(3 + 3 * i)], n, float(i))
        group.sampling_params = SamplingParams(max_tokens=4 + 3 * i, n=n)
        groups.append(group)
    return groups


@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("prefix", [False, True])
def test_one_step_ahead_gives_the_outputs_of_the_synchronous_loop(chunked: bool, prefix: bool) -> None:
    """Same tokens, preemptions and all, whether each step waits for the last result or not."""
    # A CPU pool that always has room: a swap that fails ends its request, at a point that depends on timing.
    kwargs = dict(num_gpu_blocks=12, block_size=4, max_num_seqs=6, max_num_batched_tokens=24, max_model_len=40,
                  enable_chunked_prefill=chunked, enable_prefix_caching=prefix, num_cpu_blocks=48)
    sync = _drive(make_scheduler(**kwargs), _requests(), overlap=False)
    ahead = _drive(make_scheduler(**kwargs), _requests(), overlap=True)
    assert ahead == sync
    # Most sequences ran to max_tokens (some groups outgrow what a swap can bring back and are ignored).
    assert sum(status == "FINISHED_LENGTH" for status, _ in sync.values()) >= 7
    assert sum(len(tokens) for _, tokens in sync.values()) > 100


class AsyncSchedulerMachine(SchedulerMachine):
    """The scheduler machine driven as an engine loop with async scheduling drives it.

    `schedule` plans the next step while the last one is in flight; `update` is the loop's turn: the step
    in flight lands (its tokens resolved, the length limits applied) and the planned one is sent, which the
    shadow worker runs at once, in plan order: its swaps and copies, then the KV of its tokens, the token in
    flight included. Every check of the base machine holds as before: computed tokens sit in their blocks
    when a step is planned, blocks never leak, the prompt is computed once.
    """

    prefix_caching = True

    def __init__(self) -> None:
        super().__init__()
        self.inflight: SchedulerOutput | None = None

    def add_prompt(self, prompt: list[int], max_tokens: int, n: int = 1) -> None:
        super().add_prompt(prompt, max_tokens, n)
        # The scheduler knows max_tokens: it skips decoding a token in flight that ends the sequence.
        self.groups[-1].sampling_params = SamplingParams(max_tokens=max_tokens)

    def steps_outstanding(self) -> bool:
        return self.pending is not None or self.inflight is not None

    def classify_running(self) -> tuple[set[int], set[int]]:
        decoding, prefilling = super().classify_running()
        for group in self.sched.running:
            for seq in group.seqs:
                outputs = len(seq.output_token_ids) + seq.num_inflight_tokens
                if seq.num_inflight_tokens and (outputs >= self.max_tokens[seq.seq_id]
                                                or seq.num_tokens >= self.sched.max_seq_len):
                    decoding.discard(seq.seq_id)
        return decoding, prefilling

    @precondition(lambda self: self.pending is not None or self.inflight is not None)
    @rule()
    def update(self) -> None:
        if self.inflight is not None:
            self.land(self.inflight)
            self.inflight = None
        if self.pending is not None:
            out, self.pending = self.pending, None
            self.run_on_worker(out)
            self.sched.advance(out)
            if any(s.samples for s in out.scheduled):
                event("a step in flight")
            self.inflight = out

    def run_on_worker(self, out: SchedulerOutput) -> None:
        self.apply_block_ops(out, self.kv, self.cpu_kv)
        for s in out.scheduled:
            table = self.pending_tables[s.seq.seq_id]
            known = s.seq.all_token_ids
            for pos in range(s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens):
                token = known[pos] if pos < len(known) else token_at(s.seq.seq_id, pos)
                self.kv.setdefault(table[pos // 4], {})[pos % 4] = token

    def land(self, out: SchedulerOutput) -> None:
        resolving = [s for s in out.scheduled if s.samples and s.seq.num_inflight_tokens and not s.seq.is_finished]
        if any(s.seq.status is not SequenceStatus.RUNNING for s in resolving):
            event("a token resolved after its sequence was preempted")
        self.sched.resolve(out, sampled(out))
        for s in resolving:
            seq = s.seq
            assert seq.output_token_ids[-1] == token_at(seq.seq_id, s.num_tokens)
            if len(seq.output_token_ids) >= self.max_tokens[seq.seq_id] or seq.num_tokens >= self.sched.max_seq_len:
                self.sched.finish_sequence(s.group, seq, SequenceStatus.FINISHED_LENGTH)

    def teardown(self) -> None:
        for _ in range(500):
            if not self.sched.has_unfinished_requests() and not self.steps_outstanding():
                break
            if self.pending is None and self.sched.has_unfinished_requests():
                self.schedule()
            self.update()
        self.pending = self.inflight = None
        super().teardown()


TestAsyncSchedulerMachine = AsyncSchedulerMachine.TestCase
TestAsyncSchedulerMachine.settings = settings(max_examples=examples(150), stateful_step_count=40, deadline=None)

"""Multi-step scheduling in the scheduler core: which steps one worker call takes (scheduler_service/multi_step.py)."""

from __future__ import annotations

from scheduler_service.core.scheduler import Scheduler
from scheduler_service.core.scheduler_output import SchedulerOutput
from scheduler_service.core.sequence import SequenceGroup
from scheduler_service.multi_step import PlannedCall, is_steady_decode, plan_call
from scheduler_service.planner import Planner
from shared.sampling_params import SamplingParams
from tests.unit.test_async_scheduling import sampled
from tests.unit.test_scheduler import make_group, make_scheduler, plan


def _call(sched: Scheduler, max_steps: int) -> PlannedCall | None:
    planner = Planner(epoch=1)

    def plan_step() -> tuple[SchedulerOutput, object]:
        out = sched.schedule()
        return out, planner.build(out) if out.scheduled or out.released_seq_ids else None

    return plan_call(sched, plan_step, max_steps, lambda out: is_steady_decode(sched, out))  # type: ignore[arg-type]


def _land(sched: Scheduler, call: PlannedCall) -> None:
    for i, out in enumerate(call.outs):
        if i < call.num_advanced:
            sched.resolve(out, sampled(out))
        else:
            sched.update_after_step(out, sampled(out))


def _prefilled(sched: Scheduler, *groups: SequenceGroup) -> None:
    for group in groups:
        sched.add_request(group)
    first = sched.schedule()
    sched.update_after_step(first, sampled(first))


def test_a_steady_decode_batch_takes_every_step_each_counted_as_run() -> None:
    sched = make_scheduler(num_gpu_blocks=16, max_model_len=64)
    a, b = make_group("a", 1, 6), make_group("b", 2, 3)
    _prefilled(sched, a, b)
    call = _call(sched, 4)
    assert call is not None and len(call.outs) == 4 and call.num_advanced == 4
    assert all(plan(out) == [("a", 1), ("b", 1)] for out in call.outs)
    # Each step decodes the token the one before sampled: one more in flight per step.
    assert [s.num_tokens for out in call.outs for s in out.scheduled] == [7, 4, 8, 5, 9, 6, 10, 7]
    assert a.seqs[0].num_inflight_tokens == 4 and a.seqs[0].num_computed_tokens == 10
    _land(sched, call)
    # After the prompt's token, the call's four, in order.
    assert a.seqs[0].output_token_ids[1:] == [sampled(out)[1] for out in call.outs]
    assert len(a.seqs[0].output_token_ids) == 5 and a.seqs[0].num_inflight_tokens == 0


def test_prefills_and_waiting_requests_end_a_call() -> None:
    sched = make_scheduler(num_gpu_blocks=16, max_model_len=64)
    sched.add_request(make_group("a", 1, 6))
    call = _call(sched, 4)  # the prompt's step: its first token is not held back for later steps
    assert call is not None and len(call.outs) == 1 and call.num_advanced == 0 and call.outs[0].scheduled[0].is_prefill
    _land(sched, call)
    sched.add_request(make_group("b", 2, 3))
    call = _call(sched, 4)  # a's decode and b's prompt in one step
    assert call is not None and len(call.outs) == 1
    _land(sched, call)
    sched.add_request(make_group("c", 3, 3))
    # c is admitted in the call's first step (a prefill beside a's and b's decodes): the call is that step alone.
    call = _call(sched, 4)
    assert call is not None and len(call.outs) == 1


def test_a_sequence_that_ends_by_length_leaves_the_later_steps() -> None:
    sched = make_scheduler(num_gpu_blocks=16, max_model_len=64)
    short = SequenceGroup("short", make_group("x", 1, 4).seqs, SamplingParams(max_tokens=3), 0.0)
    _prefilled(sched, short, make_group("long", 2, 4))
    call = _call(sched, 4)
    assert call is not None and len(call.outs) == 4
    # short has 1 output: its 2nd and 3rd outputs are the first two steps' samples, then it ends.
    assert [plan(out) for out in call.outs] == [[("short", 1), ("long", 1)]] * 2 + [[("long", 1)]] * 2
    _land(sched, call)
    assert len(short.seqs[0].output_token_ids) == 3


def test_every_sequence_ending_with_a_token_in_flight_ends_the_call_there() -> None:
    sched = make_scheduler(num_gpu_blocks=16, max_model_len=64)
    group = SequenceGroup("a", make_group("a", 1, 4).seqs, SamplingParams(max_tokens=3), 0.0)
    _prefilled(sched, group)
    call = _call(sched, 8)
    assert call is not None and len(call.outs) == 2 and call.num_advanced == 2
    _land(sched, call)
    assert len(group.seqs[0].output_token_ids) == 3


def test_one_step_a_call_plans_as_before() -> None:
    sched = make_scheduler(num_gpu_blocks=16, max_model_len=64)
    _prefilled(sched, make_group("a", 1, 4))
    call = _call(sched, 1)
    assert call is not None and len(call.outs) == 1 and call.num_advanced == 0


def test_requests_waiting_behind_a_full_batch_do_not_end_the_call() -> None:
    sched = make_scheduler(num_gpu_blocks=16, max_num_seqs=2, max_model_len=64)
    _prefilled(sched, make_group("a", 1, 4), make_group("b", 2, 4))
    sched.add_request(make_group("c", 3, 4))  # max_num_seqs running: c waits for one of them to finish
    call = _call(sched, 4)
    assert call is not None and len(call.outs) == 4
    assert all(plan(out) == [("a", 1), ("b", 1)] for out in call.outs)
    assert [g.request_id for g in sched.waiting] == ["c"]
    _land(sched, call)
    sched.abort_request("b")
    call = _call(sched, 4)  # room for c: its prompt's step, with a's decode, ends the call
    assert call is not None and len(call.outs) == 1 and plan(call.outs[0]) == [("a", 1), ("c", 4)]


def test_a_request_waiting_for_blocks_ends_the_call_at_its_first_step() -> None:
    # 4 blocks of 4 tokens: a holds 2 once decoding, b's 12-token prompt needs 3 and waits for blocks, not for
    # a sequence slot: a step that frees blocks (a landed finish) admits it, so no call runs ahead of it.
    sched = make_scheduler(num_gpu_blocks=4, max_model_len=16)
    _prefilled(sched, make_group("a", 1, 5))
    sched.add_request(make_group("b", 2, 12))
    call = _call(sched, 4)
    assert call is not None and len(call.outs) == 1 and plan(call.outs[0]) == [("a", 1)]
    assert [g.request_id for g in sched.waiting] == ["b"]

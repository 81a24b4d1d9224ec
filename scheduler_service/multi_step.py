"""Multi-step scheduling: a steady batch of decodes runs several steps per call to the worker.

Each step after the first is planned once the one before counts as run (Scheduler.advance), as async
scheduling plans the step ahead: the worker decodes it on its own samples of the step before. One
round trip, one Redis commit and one postprocessing then serve every step of the call; on a CPU
worker sharing its cores with the scheduler this is what the services cost per token, beside a
step of one sequence that takes little more (docs/benchmarks.md, single stream). Every step of a
multi-step call is advanced, so that a new owner lands them alike (resume.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from protos import worker_pb2
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.core.scheduler_output import SchedulerOutput


@dataclass
class PlannedCall:
    """The steps of one worker call, in order; the first num_advanced count as run (Scheduler.advance)."""

    outs: list[SchedulerOutput]
    plans: list[worker_pb2.StepPlan]
    num_advanced: int


def is_steady_decode(scheduler: Scheduler, out: SchedulerOutput) -> bool:
    """Whether the call holding step `out` may take the step after it: only a batch of decodes with nothing
    else to do. Prefills end the call (their first tokens would wait for all of it), as do swapped requests
    and waiting ones that could start (their admission would wait), a preemption (the cache is under
    pressure) and beam search (its next beams come from each result). Requests waiting behind a full batch
    (max_num_seqs running sequences) wait for a sequence to finish, which only a landed step tells."""
    if not out.scheduled or out.preempted or out.swap_failed or out.ignored:
        return False
    if scheduler.swapped or any(item.is_prefill for item in out.scheduled):
        return False
    if scheduler.waiting:
        running = sum(len(g.unfinished_seqs()) for g in scheduler.running)
        if running < scheduler.scheduler_config.max_num_seqs:
            return False
    return not any(g.sampling_params.use_beam_search for g in scheduler.running)


def plan_call(scheduler: Scheduler, plan_step: Callable[[], tuple[SchedulerOutput, worker_pb2.StepPlan | None]],
              max_steps: int, may_continue: Callable[[SchedulerOutput], bool]) -> PlannedCall | None:
    """Plans up to max_steps steps with plan_step (schedule + build the plan), the next one while
    may_continue(the last step); None when the first has nothing for the worker."""
    out, plan = plan_step()
    if plan is None:
        return None
    call = PlannedCall([out], [plan], 0)
    while len(call.outs) < max_steps and may_continue(out):
        scheduler.advance(out)
        call.num_advanced += 1
        out, plan = plan_step()
        if plan is None:  # every sequence ends with a token in flight (max_tokens)
            break
        call.outs.append(out)
        call.plans.append(plan)
    if 0 < call.num_advanced < len(call.outs):
        scheduler.advance(call.outs[-1])
        call.num_advanced += 1
    return call

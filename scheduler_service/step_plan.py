"""From a scheduled step to the worker's plan: what the step ended, what the worker must forget.

One place for the engine loop of the services and the in-process engine of the offline API
(llmserve/engine.py): both schedule, then build the plan here, run it, and land its result with
OutputProcessor.process.
"""

from __future__ import annotations

from protos import worker_pb2
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.core.scheduler_output import SchedulerOutput
from scheduler_service.core.sequence import SequenceGroup, SequenceStatus
from scheduler_service.output_processor import OutputProcessor
from scheduler_service.planner import Planner
from scheduler_service.store_types import StepCommit

SWAP_FULL = "the request was preempted and the worker's CPU swap space is full; retry, or raise --swap-space"


def build_step(out: SchedulerOutput, scheduler: Scheduler, processor: OutputProcessor, planner: Planner,
               commit: StepCommit) -> worker_pb2.StepPlan | None:
    """The plan of a scheduled step (None: nothing for the worker); its failures and preemptions go into `commit`."""
    commit.num_preemptions += len(out.preempted)
    commit.num_swaps += sum(1 for g in out.preempted if any(s.status is SequenceStatus.SWAPPED for s in g.seqs))
    for group in out.swap_failed:
        processor.fail(group, commit, SWAP_FULL)
    for group in out.ignored:
        processor.fail(group, commit, ignored_message(scheduler, group))
    plan = planner.build(out)
    # A plan with only finished_seq_ids still goes out, so an idle worker drops finished sequences.
    has_work = (plan.new_sequences or plan.cached_sequences or plan.swap_in or plan.swap_out or plan.copy
                or plan.finished_seq_ids)
    return plan if has_work else None


def ignored_message(scheduler: Scheduler, group: SequenceGroup) -> str:
    """Why a request can never run on this worker."""
    num_tokens = group.seqs[0].num_tokens
    cfg = scheduler.scheduler_config
    cache = scheduler.cache_config
    budget = "" if cfg.enable_chunked_prefill else f", one step's token budget {cfg.max_num_batched_tokens}"
    return (
        f"the request needs {num_tokens} tokens of KV cache, more than this worker can ever hold "
        f"(max_model_len {cfg.max_model_len}{budget}, KV cache {cache.num_gpu_blocks * cache.block_size} tokens)"
    )

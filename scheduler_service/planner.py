"""From a scheduled step to the worker's protobuf StepPlan.

The scheduler core says what the worker learns of each table
(ScheduledSequence.table: a new sequence in full, a known one as the entries
appended and replaced since) and which sequences it forgets
(released_seq_ids); the planner numbers the steps of its epoch and writes the
protobuf. build_step is the one place for the engine loop of the services and
the in-process engine of the offline API (llmserve/engine.py): both schedule,
build the plan here, run it, and land its result with OutputProcessor.process.
"""

from __future__ import annotations

from protos import common_pb2, worker_pb2
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.core.scheduler_output import SchedulerOutput
from scheduler_service.core.sequence import Sequence, SequenceGroup, SequenceStatus
from scheduler_service.output_processor import OutputProcessor
from scheduler_service.store_types import StepCommit
from shared.sampling_params import seed_for_sequence
from shared.sampling_proto import sampling_to_proto


def sequence_sampling(group: SequenceGroup, seq: Sequence) -> common_pb2.SamplingParams:
    """The group's sampling parameters, with a seed of the sequence's own when the request is seeded."""
    msg = sampling_to_proto(group.sampling_params)
    if msg.HasField("seed") and len(group.seqs) > 1:
        index = next(i for i, s in enumerate(group.seqs) if s is seq)
        msg.seed = seed_for_sequence(msg.seed, index)
    return msg


class Planner:
    """Builds step plans for one worker."""

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch
        # The step id of the last plan built (0: none yet); the ids go on across epochs.
        self.last_step_id = 0

    def reset(self, epoch: int) -> None:
        """A new epoch: the worker was fenced."""
        self.epoch = epoch

    def build(self, out: SchedulerOutput) -> worker_pb2.StepPlan:
        """The plan of a scheduled step (schedule() set each sequence's table update)."""
        self.last_step_id += 1
        plan = worker_pb2.StepPlan(epoch=self.epoch, step_id=self.last_step_id, finished_seq_ids=out.released_seq_ids)
        for pairs, block_map in ((out.blocks_to_swap_in, plan.swap_in), (out.blocks_to_swap_out, plan.swap_out),
                                 (out.blocks_to_copy, plan.copy)):
            for src, dst in pairs:
                block_map.add(src=src, dst=dst)
        for item in out.scheduled:
            seq, table = item.seq, item.table
            if table is None:
                raise RuntimeError(f"seq {seq.seq_id} was scheduled without a table update")
            if table.in_full:
                if seq.num_inflight_tokens:
                    # Its tokens go out in full: one not known yet would be missing (see Scheduler.advance).
                    raise RuntimeError(f"seq {seq.seq_id} is sent in full with a token still in flight")
                plan.new_sequences.add(
                    seq_id=seq.seq_id,
                    prompt_token_ids=seq.prompt_token_ids,
                    output_token_ids=seq.output_token_ids,
                    sampling=sequence_sampling(item.group, seq),
                    block_table=table.block_ids,
                    num_computed_tokens=item.num_computed_tokens,
                    num_new_tokens=item.num_new_tokens,
                )
                continue
            delta = plan.cached_sequences.add(
                seq_id=seq.seq_id, new_block_ids=table.block_ids, num_new_tokens=item.num_new_tokens,
                num_tokens=seq.num_tokens,
            )
            if table.replaced:  # rare (copy-on-write of a block the worker holds); an empty map costs a decode
                delta.replaced_blocks.update(table.replaced)
            if item.group.sampling_params.use_beam_search and seq.output_token_ids:
                # The beam may go on with another candidate than the worker's own sample.
                delta.last_token_id = seq.last_token_id
        return plan


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

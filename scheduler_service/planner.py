"""Turns a SchedulerOutput into a protobuf StepPlan.

The scheduler core says what the worker learns of each table
(ScheduledSequence.table: a new sequence in full, a known one as the entries
appended and replaced since) and which sequences it forgets
(released_seq_ids); the planner only numbers the steps of its epoch and
writes the protobuf.
"""

from __future__ import annotations

from protos import common_pb2, worker_pb2
from scheduler_service.core.scheduler_output import SchedulerOutput
from scheduler_service.core.sequence import Sequence, SequenceGroup
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
        self._step_id = 0

    @property
    def last_step_id(self) -> int:
        """The step id of the last plan built in this epoch (0: none yet)."""
        return self._step_id

    def reset(self, epoch: int) -> None:
        """A new epoch: the worker was fenced."""
        self.epoch = epoch

    def build(self, out: SchedulerOutput) -> worker_pb2.StepPlan:
        """The plan of a scheduled step (schedule() set each sequence's table update)."""
        self._step_id += 1
        plan = worker_pb2.StepPlan(epoch=self.epoch, step_id=self._step_id, finished_seq_ids=out.released_seq_ids)
        for src, dst in out.blocks_to_swap_in:
            plan.swap_in.add(src=src, dst=dst)
        for src, dst in out.blocks_to_swap_out:
            plan.swap_out.add(src=src, dst=dst)
        for src, dst in out.blocks_to_copy:
            plan.copy.add(src=src, dst=dst)
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
                seq_id=seq.seq_id, new_block_ids=table.block_ids, num_new_tokens=item.num_new_tokens
            )
            if table.replaced:  # rare (copy-on-write of a block the worker holds); an empty map costs a decode
                delta.replaced_blocks.update(table.replaced)
            if item.group.sampling_params.use_beam_search and seq.output_token_ids:
                # The beam may go on with another candidate than the worker's own sample.
                delta.last_token_id = seq.last_token_id
        return plan

"""Step plans as domain objects, converted from protobuf at the servicer edge."""

from __future__ import annotations

from dataclasses import dataclass, field

from protos import worker_pb2
from shared.errors import InvalidRequestError
from shared.sampling_params import SamplingParams
from shared.sampling_proto import sampling_from_proto


class PlanError(InvalidRequestError):
    """A plan that contradicts the worker's cached state or its cache (a scheduler bug or a lost reset):
    the plan is the worker's request, so INVALID_ARGUMENT."""


@dataclass
class NewSequenceData:
    """A sequence sent in full: the worker (re)learns it."""

    seq_id: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling: SamplingParams
    block_table: list[int]
    num_computed_tokens: int
    num_new_tokens: int


@dataclass
class SequenceDeltaData:
    """What changed for a sequence the worker already caches."""

    seq_id: int
    new_block_ids: list[int]
    num_new_tokens: int
    replaced_blocks: dict[int, int] = field(default_factory=dict)
    # Replaces the token the worker sampled last step (beam search); None keeps it.
    last_token_id: int | None = None
    # The sequence's tokens as the scheduler counts them (in-flight ones included); 0: not checked.
    num_tokens: int = 0


@dataclass
class StepPlanData:
    """One step: block operations, then the sequences to run."""

    epoch: int
    step_id: int
    swap_in: list[tuple[int, int]]
    swap_out: list[tuple[int, int]]
    copy: list[tuple[int, int]]
    new_sequences: list[NewSequenceData]
    cached_sequences: list[SequenceDeltaData]
    finished_seq_ids: list[int]


def pairs_from_proto(pairs: object) -> list[tuple[int, int]]:
    """Block pairs as (src, dst) tuples."""
    return [(p.src, p.dst) for p in pairs]  # type: ignore[attr-defined]


def new_sequence_from_proto(s: worker_pb2.NewSequence) -> NewSequenceData:
    """A sequence sent in full, as a domain object."""
    try:
        sampling = sampling_from_proto(s.sampling)
    except ValueError as exc:
        raise PlanError(f"sequence {s.seq_id}: {exc}") from exc
    return NewSequenceData(
        seq_id=s.seq_id,
        prompt_token_ids=list(s.prompt_token_ids),
        output_token_ids=list(s.output_token_ids),
        sampling=sampling,
        block_table=list(s.block_table),
        num_computed_tokens=s.num_computed_tokens,
        num_new_tokens=s.num_new_tokens,
    )


def plan_from_proto(msg: worker_pb2.StepPlan) -> StepPlanData:
    """Converts the wire plan into domain objects."""
    return StepPlanData(
        epoch=msg.epoch,
        step_id=msg.step_id,
        swap_in=pairs_from_proto(msg.swap_in),
        swap_out=pairs_from_proto(msg.swap_out),
        copy=pairs_from_proto(msg.copy),
        new_sequences=[new_sequence_from_proto(s) for s in msg.new_sequences],
        cached_sequences=[
            SequenceDeltaData(
                seq_id=s.seq_id,
                new_block_ids=list(s.new_block_ids),
                num_new_tokens=s.num_new_tokens,
                replaced_blocks=dict(s.replaced_blocks),
                last_token_id=s.last_token_id if s.HasField("last_token_id") else None,
                num_tokens=s.num_tokens,
            )
            for s in msg.cached_sequences
        ],
        finished_seq_ids=list(msg.finished_seq_ids),
    )


def check_block_ids(plan: StepPlanData, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
    """Every block id of the plan names a block of the cache: checked once per step, before anything moves."""
    check_pairs("swap_in", plan.swap_in, num_cpu_blocks, num_gpu_blocks)
    check_pairs("swap_out", plan.swap_out, num_gpu_blocks, num_cpu_blocks)
    check_pairs("copy", plan.copy, num_gpu_blocks, num_gpu_blocks)
    device = range(num_gpu_blocks)
    for s in plan.new_sequences:
        _check_table(s.seq_id, s.block_table, device)
    # A decode's delta usually adds no block: only those that do are looked at.
    for d in plan.cached_sequences:
        if d.new_block_ids:
            _check_table(d.seq_id, d.new_block_ids, device)
        if d.replaced_blocks:
            _check_table(d.seq_id, list(d.replaced_blocks.values()), device)


def check_pairs(what: str, pairs: list[tuple[int, int]], num_src: int, num_dst: int) -> None:
    """Every (src, dst) pair of a block operation names a block: of num_src source and num_dst destination blocks."""
    for src, dst in pairs:
        if not (0 <= src < num_src and 0 <= dst < num_dst):
            raise PlanError(f"{what} pair ({src}, {dst}) is out of range ({num_src} -> {num_dst} blocks)")


def _check_table(seq_id: int, blocks: list[int], device: range) -> None:
    bad = [b for b in blocks if b not in device]
    if bad:
        raise PlanError(f"sequence {seq_id}: block ids {bad[:5]} are out of range (the cache has {len(device)})")

"""The worker's per-sequence state, so plans only carry deltas.

The worker knows every token it sampled, so after the first step of a sequence
the scheduler only sends what changed: new block ids and how many tokens to
compute. A recomputed sequence is re-sent in full and replaces the entry.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.sampling_params import SamplingParams
from worker_service.plan import NewSequenceData, SequenceDeltaData


class PlanError(ValueError):
    """A plan that contradicts the worker's cached state (a scheduler bug or a lost reset)."""


@dataclass
class CachedSequence:
    """What the worker remembers about one running sequence."""

    seq_id: int
    token_ids: list[int]
    num_prompt_tokens: int
    block_table: list[int]
    num_computed_tokens: int
    sampling: SamplingParams
    # Set by the current step: tokens to compute this step.
    num_new_tokens: int = 0

    @property
    def computes_prompt_logprobs(self) -> bool:
        """True while prompt tokens are computed for a request that asked for their logprobs.

        Only before the first output: a sequence recomputed with outputs already
        had its prompt logprobs sent, and a forked child starts at the last
        prompt token, whose logits predict an output, not a prompt token.
        """
        return self.sampling.prompt_logprobs is not None and len(self.token_ids) == self.num_prompt_tokens

    @property
    def samples_this_step(self) -> bool:
        """True when this step computes up to the last known token, so a new one is sampled."""
        return self.num_computed_tokens + self.num_new_tokens == len(self.token_ids)


class SequenceCache:
    """seq_id -> CachedSequence, updated from each plan."""

    def __init__(self, block_size: int) -> None:
        self._block_size = block_size
        self._seqs: dict[int, CachedSequence] = {}

    def __len__(self) -> int:
        return len(self._seqs)

    def num_used_blocks(self) -> int:
        """Distinct blocks referenced by the cached sequences."""
        # list() copies the values in one step under the GIL: Describe and heartbeats call this from the event
        # loop while a step thread may be adding or dropping sequences.
        return len({b for seq in list(self._seqs.values()) for b in seq.block_table})

    def clear(self) -> None:
        self._seqs.clear()

    def drop(self, seq_ids: list[int]) -> None:
        for seq_id in seq_ids:
            self._seqs.pop(seq_id, None)

    def add(self, new: NewSequenceData) -> CachedSequence:
        """Learns (or re-learns after recompute) a sequence sent in full."""
        seq = CachedSequence(
            seq_id=new.seq_id,
            token_ids=list(new.prompt_token_ids) + list(new.output_token_ids),
            num_prompt_tokens=len(new.prompt_token_ids),
            block_table=list(new.block_table),
            num_computed_tokens=new.num_computed_tokens,
            sampling=new.sampling,
            num_new_tokens=new.num_new_tokens,
        )
        self._check(seq)
        self._seqs[new.seq_id] = seq
        return seq

    def update(self, delta: SequenceDeltaData) -> CachedSequence:
        """Applies a delta to a known sequence."""
        seq = self._seqs.get(delta.seq_id)
        if seq is None:
            raise PlanError(f"sequence {delta.seq_id} is not cached on this worker; it must be sent in full")
        for index, block_id in delta.replaced_blocks.items():
            if index >= len(seq.block_table):
                raise PlanError(f"sequence {delta.seq_id}: replaced block index {index} is out of range")
            seq.block_table[index] = block_id
        seq.block_table.extend(delta.new_block_ids)
        if delta.last_token_id is not None:
            if len(seq.token_ids) <= seq.num_prompt_tokens:
                raise PlanError(f"sequence {delta.seq_id}: last_token_id sent but no token was sampled for it")
            seq.token_ids[-1] = delta.last_token_id
        seq.num_new_tokens = delta.num_new_tokens
        self._check(seq)
        return seq

    def commit_step(self, seq: CachedSequence, sampled_token: int | None) -> None:
        """Advances a sequence after its step ran."""
        seq.num_computed_tokens += seq.num_new_tokens
        seq.num_new_tokens = 0
        if sampled_token is not None:
            seq.token_ids.append(sampled_token)

    def _check(self, seq: CachedSequence) -> None:
        end = seq.num_computed_tokens + seq.num_new_tokens
        if seq.num_new_tokens < 1:
            raise PlanError(f"sequence {seq.seq_id}: num_new_tokens must be at least 1")
        if end > len(seq.token_ids):
            raise PlanError(
                f"sequence {seq.seq_id}: computing up to token {end} but only {len(seq.token_ids)} are known"
            )
        if end > len(seq.block_table) * self._block_size:
            raise PlanError(
                f"sequence {seq.seq_id}: {end} tokens do not fit in {len(seq.block_table)} blocks"
            )

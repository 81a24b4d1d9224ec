"""The worker's per-sequence state, so plans only carry deltas.

The worker knows every token it sampled, so after the first step of a sequence
the scheduler only sends what changed: new block ids and how many tokens to
compute. A recomputed sequence is re-sent in full and replaces the entry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shared.sampling_params import SamplingParams
from worker_service.plan import NewSequenceData, PlanError, SequenceDeltaData

# Resume's reason for a sequence the worker does not hold at all.
NOT_CACHED = "not cached on this worker"


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
    # The structured output's matcher (grammar_masks.GrammarState), made at the first sample; a sequence
    # learned again starts without one and its matcher catches up from the tokens.
    grammar: Any = None

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


def _learn(new: NewSequenceData, num_new_tokens: int) -> CachedSequence:
    """The worker's entry for a sequence sent in full (a step's new sequence, or a view Resume keeps)."""
    return CachedSequence(
        seq_id=new.seq_id,
        token_ids=list(new.prompt_token_ids) + list(new.output_token_ids),
        num_prompt_tokens=len(new.prompt_token_ids),
        block_table=list(new.block_table),
        num_computed_tokens=new.num_computed_tokens,
        sampling=new.sampling,
        num_new_tokens=num_new_tokens,
    )


class SequenceCache:
    """seq_id -> CachedSequence, updated from each plan.

    It also counts recomputed tokens: positions computed again for a sequence whose KV the worker still
    held (_high). A change of owner that resumes on the cache computes none; one that recomputes shows here.
    """

    def __init__(self, block_size: int) -> None:
        self._block_size = block_size
        self._seqs: dict[int, CachedSequence] = {}
        # seq_id -> most of its tokens computed since a plan last told the worker to forget it.
        self._high: dict[int, int] = {}
        self.num_recomputed_tokens = 0

    def __len__(self) -> int:
        return len(self._seqs)

    def num_used_blocks(self) -> int:
        """Distinct blocks referenced by the cached sequences."""
        # list() copies the values in one step under the GIL: Describe and heartbeats call this from the event
        # loop while a step thread may be adding or dropping sequences.
        return len({b for seq in list(self._seqs.values()) for b in seq.block_table})

    def clear(self) -> None:
        """Forgets every sequence (a new owner recomputes them: their positions stay counted as computed)."""
        # The high-water marks of older, forgotten sequences go: only the ones just held may come back.
        self._high = {seq_id: high for seq_id, high in self._high.items() if seq_id in self._seqs}
        self._seqs = {}

    def drop(self, seq_ids: list[int]) -> None:
        """Forgets sequences a plan finished or preempted."""
        for seq_id in seq_ids:
            self._seqs.pop(seq_id, None)
            self._high.pop(seq_id, None)

    def get(self, seq_id: int) -> CachedSequence | None:
        return self._seqs.get(seq_id)

    def resume(self, views: list[NewSequenceData], copies: dict[int, int]) -> list[tuple[int, str]]:
        """Keeps the sequences whose view matches the cache, as the view has them; forgets all others.

        A view matches when the worker caches the sequence, has computed at least the view's computed
        tokens, holds the same tokens there and the same blocks for them (or a block `copies` copied
        into the view's, src -> dst). A sequence the worker does not cache matches when another cached
        sequence holds its computed tokens that way (a fork's child sent by a step never run). Returns
        (seq id, reason) of each view refused.
        """
        refused: list[tuple[int, str]] = []
        kept: dict[int, CachedSequence] = {}
        for view in views:
            reason = self._mismatch(view, copies)
            if reason:
                refused.append((view.seq_id, reason))
                continue
            kept[view.seq_id] = _learn(view, num_new_tokens=0)
        self.clear()
        self._seqs = kept
        return refused

    def _mismatch(self, view: NewSequenceData, copies: dict[int, int]) -> str:
        cached = self._seqs.get(view.seq_id)
        if cached is None:
            if view.num_computed_tokens and any(not self._differs(view, other, copies) for other in self._seqs.values()):
                return ""
            return NOT_CACHED
        return self._differs(view, cached, copies)

    def _differs(self, view: NewSequenceData, cached: CachedSequence, copies: dict[int, int]) -> str:
        """Why `cached` does not hold the view's computed tokens in the view's blocks ("" when it does)."""
        computed = view.num_computed_tokens
        if computed > cached.num_computed_tokens:
            return f"{computed} tokens computed in the view, {cached.num_computed_tokens} on the worker"
        tokens = list(view.prompt_token_ids) + list(view.output_token_ids)
        if tokens[:computed] != cached.token_ids[:computed]:
            return "its computed tokens differ"
        num_blocks = -(-computed // self._block_size)
        if len(view.block_table) < num_blocks:
            return f"its table of {len(view.block_table)} blocks cannot hold {computed} tokens"
        for index in range(num_blocks):
            mine, theirs = cached.block_table[index], view.block_table[index]
            if mine != theirs and copies.get(mine) != theirs:
                return f"block {index} of its table is {theirs} in the view, {mine} on the worker"
        return ""

    def add(self, new: NewSequenceData) -> CachedSequence:
        """Learns (or re-learns after recompute) a sequence sent in full."""
        seq = _learn(new, new.num_new_tokens)
        self._check(seq)
        self._seqs[new.seq_id] = seq
        return seq

    def update(self, delta: SequenceDeltaData) -> CachedSequence:
        """Applies a delta to a known sequence."""
        seq = self._seqs.get(delta.seq_id)
        if seq is None:
            raise PlanError(f"sequence {delta.seq_id} is not cached on this worker; it must be sent in full")
        if delta.num_tokens and delta.num_tokens != len(seq.token_ids):
            # Computing on would sample from tokens the scheduler never streamed: the step fails instead, and the
            # scheduler resets the worker and recomputes from its own tokens (the ones its clients were sent).
            raise PlanError(f"sequence {delta.seq_id}: the scheduler counts {delta.num_tokens} tokens, the worker "
                            f"holds {len(seq.token_ids)}")
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
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + seq.num_new_tokens
        high = self._high.get(seq.seq_id, 0)
        if start < high:
            self.num_recomputed_tokens += min(end, high) - start
        self._high[seq.seq_id] = max(high, end)
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

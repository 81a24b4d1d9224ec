"""Flattens the scheduled sequences of a step into model inputs.

Slot mapping: token at position p of a sequence lives in cache slot

    slot = block_table[p // block_size] * block_size + p % block_size

    block_table = [7, 2]        block_size = 4
    positions     0 1 2 3 | 4 5
    slots        28 ... 31 | 8 9
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from worker_service.attention import AttentionMetadata
from worker_service.cache_engine import CacheEngine
from worker_service.sequence_cache import CachedSequence


@dataclass
class ModelInputs:
    """Tensors for one forward pass plus which rows to sample."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    attn: AttentionMetadata
    # Row in the hidden states of the last token of each sampling sequence.
    sample_indices: torch.Tensor
    # The sequences sampled, in the order of sample_indices.
    sampling_seqs: list[CachedSequence]
    # Prompt tokens whose logprobs this step computes (requests with prompt_logprobs).
    prompt_logprobs: PromptLogprobRows


@dataclass
class PromptLogprobSpan:
    """Consecutive prompt tokens of one sequence whose logprobs come from this step's hidden rows."""

    seq: CachedSequence
    # Prompt index of the first token (its logits are at the hidden row of the token before it).
    start: int
    count: int


@dataclass
class PromptLogprobRows:
    """Hidden-state rows whose logits predict prompt tokens, and those tokens; spans in row order."""

    rows: torch.Tensor
    targets: torch.Tensor
    spans: list[PromptLogprobSpan]


def _block_table_tensor(seqs: list[CachedSequence], device: torch.device) -> torch.Tensor:
    width = max((len(s.block_table) for s in seqs), default=0)
    rows = [s.block_table + [0] * (width - len(s.block_table)) for s in seqs]
    return torch.tensor(rows, dtype=torch.int32, device=device).reshape(len(seqs), width)


def build_inputs(scheduled: list[CachedSequence], cache: CacheEngine, device: torch.device) -> ModelInputs:
    """Orders the batch prefills-first and computes ids, positions and slots in ``cache``'s blocks."""
    block_size = cache.block_size
    prefills = [s for s in scheduled if s.num_new_tokens > 1]
    decodes = [s for s in scheduled if s.num_new_tokens == 1]
    seqs = prefills + decodes

    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    sample_rows: list[int] = []
    sampling_seqs: list[CachedSequence] = []
    prompt_rows: list[int] = []
    prompt_targets: list[int] = []
    prompt_spans: list[PromptLogprobSpan] = []
    query_start = [0]
    seq_lens: list[int] = []
    for seq in seqs:
        start = seq.num_computed_tokens
        end = start + seq.num_new_tokens
        table = seq.block_table
        if seq.computes_prompt_logprobs:
            # The hidden state at position p predicts token p + 1: positions start .. P - 2 predict
            # prompt tokens (P - 1 predicts the first output).
            last = min(end, seq.num_prompt_tokens - 1)
            if last > start:
                prompt_rows.extend(range(len(input_ids), len(input_ids) + last - start))
                prompt_targets.extend(seq.token_ids[start + 1 : last + 1])
                prompt_spans.append(PromptLogprobSpan(seq, start + 1, last - start))
        input_ids.extend(seq.token_ids[start:end])
        pos = range(start, end)
        positions.extend(pos)
        slots.extend(table[p // block_size] * block_size + p % block_size for p in pos)
        if seq.samples_this_step:
            sample_rows.append(len(input_ids) - 1)
            sampling_seqs.append(seq)
        if seq.num_new_tokens > 1:
            query_start.append(len(input_ids))
        seq_lens.append(end)

    num_prefill_tokens = query_start[-1]
    # Normal tensors, not inference tensors: their version counters let the kernels' argument checks
    # reduce them once per step instead of once per layer (kernels/metadata_memo.py).
    with torch.inference_mode(False):
        attn = AttentionMetadata(
            backend=cache.backend,
            key_caches=cache.key_caches,
            value_caches=cache.value_caches,
            block_size=block_size,
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            num_prefill_tokens=num_prefill_tokens,
            prefill_block_tables=_block_table_tensor(prefills, device),
            prefill_query_start_loc=torch.tensor(query_start, dtype=torch.int32, device=device),
            prefill_seq_lens=torch.tensor(seq_lens[: len(prefills)], dtype=torch.int32, device=device),
            decode_block_tables=_block_table_tensor(decodes, device),
            decode_context_lens=torch.tensor(seq_lens[len(prefills):], dtype=torch.int32, device=device),
            decode_max_context_len=max(seq_lens[len(prefills):], default=0),
            wait_for_layer=cache.wait_for_layer,
        )
    return ModelInputs(
        input_ids=torch.tensor(input_ids, dtype=torch.int64, device=device),
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        attn=attn,
        sample_indices=torch.tensor(sample_rows, dtype=torch.int64, device=device),
        sampling_seqs=sampling_seqs,
        prompt_logprobs=PromptLogprobRows(
            rows=torch.tensor(prompt_rows, dtype=torch.int64, device=device),
            targets=torch.tensor(prompt_targets, dtype=torch.int64, device=device),
            spans=prompt_spans,
        ),
    )

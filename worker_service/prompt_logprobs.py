"""Log-probabilities of prompt tokens, for requests with prompt_logprobs.

The LM head normally runs on the sampled rows only; these requests also need
it on their prompt positions. It runs in slices so that a long prefill never
materialises a [prompt tokens, vocab] logits tensor at once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from worker_service.input_builder import PromptLogprobRows

# Prompt positions per LM-head slice: bounds the logits held at once (rows * vocab floats).
_ROWS_PER_SLICE = 512


@dataclass
class PromptLogprobsData:
    """Logprobs of prompt tokens start, start + 1, ... of one sequence."""

    seq_id: int
    start: int
    # Per token: its log-probability given the tokens before it.
    logprobs: list[float]
    # Per token: the most likely (token, logprob) pairs at its position, best first.
    top: list[list[tuple[int, float]]]
    # Per token: 1 + the tokens at least as likely as it at its position (vLLM's rank); empty: not computed.
    ranks: list[int] = field(default_factory=list)


def compute_prompt_logprobs(
    hidden: torch.Tensor, compute_logits: Callable[[torch.Tensor], torch.Tensor], wanted: PromptLogprobRows
) -> list[PromptLogprobsData]:
    """Raw-distribution logprobs of the prompt tokens in `wanted`, from the step's hidden states."""
    if not wanted.spans:
        return []
    k = max(span.seq.sampling.prompt_logprobs or 0 for span in wanted.spans)
    token_lps, ranks, top_lps, top_ids = [], [], [], []
    for begin in range(0, len(wanted.rows), _ROWS_PER_SLICE):
        rows = wanted.rows[begin : begin + _ROWS_PER_SLICE]
        logprobs = torch.log_softmax(compute_logits(hidden[rows]), dim=-1)
        targets = wanted.targets[begin : begin + _ROWS_PER_SLICE]
        token_lp = logprobs.gather(1, targets.unsqueeze(1))
        token_lps.append(token_lp.squeeze(1))
        # Ties count ahead of the token, as vLLM's rank: the token itself makes it at least 1.
        ranks.append((logprobs >= token_lp).sum(dim=-1))
        values, ids = logprobs.topk(k, dim=-1)
        top_lps.append(values)
        top_ids.append(ids)
    token_list, rank_list = torch.cat(token_lps).tolist(), torch.cat(ranks).tolist()
    values_list, ids_list = torch.cat(top_lps).tolist(), torch.cat(top_ids).tolist()
    out, offset = [], 0
    for span in wanted.spans:
        width = span.seq.sampling.prompt_logprobs or 0
        rows = range(offset, offset + span.count)
        out.append(PromptLogprobsData(
            seq_id=span.seq.seq_id,
            start=span.start,
            logprobs=token_list[offset : offset + span.count],
            top=[list(zip(ids_list[r][:width], values_list[r][:width])) for r in rows],
            ranks=rank_list[offset : offset + span.count],
        ))
        offset += span.count
    return out

"""Batched logit transforms of vLLM's sampler, each one tensor pass over the rows that need it.

Order (vLLM v0): min_tokens mask and penalties on the raw logits (they decide
greedy rows too), then temperature, top-k / top-p, min-p on the sampled rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from worker_service._numba_nucleus import nucleus_cut


def _row_token_pairs(token_lists: Sequence[Sequence[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index, token id) of every token of every row, flattened without a per-token Python loop."""
    lengths = torch.tensor([len(t) for t in token_lists], dtype=torch.int64)
    tokens = torch.tensor(list(chain.from_iterable(token_lists)), dtype=torch.int64)
    rows = torch.repeat_interleave(torch.arange(len(token_lists)), lengths)
    return rows.to(device), tokens.to(device)


def token_counts(token_lists: Sequence[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[rows, vocab] float: how often each token occurs in each row's list."""
    rows, tokens = _row_token_pairs(token_lists, device)
    counts = torch.zeros(len(token_lists), vocab, dtype=torch.float32, device=device)
    return counts.index_put_((rows, tokens), torch.ones_like(tokens, dtype=torch.float32), accumulate=True)


def mask_tokens(logits: torch.Tensor, token_lists: Sequence[Sequence[int]]) -> torch.Tensor:
    """Sets logits[i, t] = -inf for every t in token_lists[i] (in place; returns logits)."""
    rows, tokens = _row_token_pairs(token_lists, logits.device)
    return logits.index_put_((rows, tokens), torch.tensor(float("-inf"), device=logits.device))


def apply_penalties(
    logits: torch.Tensor,
    prompt_mask: torch.Tensor,
    output_counts: torch.Tensor,
    repetition: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
) -> torch.Tensor:
    """vLLM's penalties: repetition over prompt + output tokens (transformers' rule), then
    frequency * count and presence * (count > 0) over output tokens. Per-row penalties are [rows]."""
    output_mask = output_counts > 0
    seen = prompt_mask | output_mask
    factor = torch.where(seen, repetition.unsqueeze(1), torch.ones_like(logits))
    logits = torch.where(logits > 0, logits / factor, logits * factor)
    logits = logits - frequency.unsqueeze(1) * output_counts
    return logits - presence.unsqueeze(1) * output_mask.to(logits.dtype)


# How many of a row's most likely tokens apply_top_k_top_p takes first, then for the rows left undecided:
# a nucleus of top_p <= 0.95 usually closes well inside the first; a row whose nucleus is wider than the
# last (a flat distribution) is sorted whole.
CANDIDATE_COUNTS = (256, 4096)


# The widest top-k / nucleus the compiled cut returns; a row whose sets are wider goes to torch's candidates.
COMPILED_CUT_WIDTH = 4096


@dataclass
class TopCut:
    """Each row's top-k, nucleus (top-p) and min-p sets, as top_k_top_p_cut decides them.

    Most rows are decided on their few most likely tokens: ``chunks`` hold those rows' indices with their
    candidates' (tempered) logits (-inf outside the sets) and token ids, ``[rows, count]`` each. ``uncut`` rows
    keep their whole row (not tempered); ``masked_logits`` are the ``masked_rows`` whole, tempered and masked
    (rows sorted whole, and min-p's rows that no compiled cut decided).
    """

    uncut: torch.Tensor
    chunks: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    masked_rows: torch.Tensor
    masked_logits: torch.Tensor


def top_k_top_p_cut(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                    inverse_temperature: torch.Tensor | None = None, min_p: torch.Tensor | None = None) -> TopCut:
    """The top-k, then nucleus (top-p), then min-p sets of each row of ``logits * inverse_temperature`` (per
    row; none: the logits as they are; top_k <= 0 keeps every token, min_p none or 0 applies no floor).

    The nucleus is taken on the distribution renormalised over the top-k, as vLLM does. Float32 rows on a CPU
    are cut by one compiled pass each (_numba_nucleus.py). The others, and the rows it leaves, are decided
    on their most likely tokens (CANDIDATE_COUNTS, or the whole top-k if larger) when their top-k or nucleus
    ends among them, and sorted whole otherwise: sorting 64 rows of a 49k vocabulary took 170 ms on a
    2-core CPU, their top 256 with torch 9 ms, the compiled cut 3.3 ms on a Zen 5. min-p is applied to
    those by apply_min_p.
    """
    vocab = logits.shape[-1]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    cutting = (k < vocab) | (top_p < 1.0)
    floor = torch.zeros(len(logits), device=logits.device) if min_p is None else min_p.to(torch.float32)
    filtered = cutting | (floor > 0.0)
    rows = filtered.nonzero().squeeze(1)
    scale = (torch.ones(len(logits), device=logits.device) if inverse_temperature is None
             else inverse_temperature.to(torch.float32))
    chunks = []
    if rows.numel() and _compiled_cut_for(logits):
        chunks, rows = _cut_compiled(logits, rows, k[rows], top_p[rows], floor[rows], scale[rows])

    def tempered(at: torch.Tensor) -> torch.Tensor:
        return logits[at] if inverse_temperature is None else logits[at] * scale[at].unsqueeze(1)

    def floored(at: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        return values if min_p is None else apply_min_p(values, floor[at])

    floor_only, rows = rows[~cutting[rows]], rows[cutting[rows]]
    for candidates in CANDIDATE_COUNTS:
        if not rows.numel():
            break
        rows_k = k[rows]
        count = max(candidates, int(rows_k.masked_fill(rows_k >= vocab, 0).max()))
        if count >= vocab // 2:
            break
        values, order, decided = _top_candidates(tempered(rows), rows_k, top_p[rows], count)
        if decided.any():
            chunks.append((rows[decided], floored(rows[decided], values[decided]), order[decided]))
        rows = rows[~decided]
    masked = [floored(rows, _top_k_top_p_sorted(tempered(rows), k[rows], top_p[rows])) if rows.numel() else logits[:0],
              floored(floor_only, tempered(floor_only))]
    return TopCut((~filtered).nonzero().squeeze(1), chunks, torch.cat([rows, floor_only]), torch.cat(masked))


def _compiled_cut_for(logits: torch.Tensor) -> bool:
    """Whether these logits take the compiled cut (float32 on a CPU) before torch's candidates."""
    return logits.device.type == "cpu" and logits.dtype == torch.float32


def _cut_compiled(logits: torch.Tensor, rows: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
                  scale: torch.Tensor) -> tuple[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], torch.Tensor]:
    """_numba_nucleus.nucleus_cut over ``rows``: the chunk of the rows it decided (TopCut's layout, as wide as
    the widest of their sets), and the rows it left to torch."""
    values = np.empty((len(rows), COMPILED_CUT_WIDTH), dtype=np.float32)
    ids = np.empty((len(rows), COMPILED_CUT_WIDTH), dtype=np.int64)
    kept = np.empty(len(rows), dtype=np.int64)
    nucleus_cut(logits.contiguous().numpy(), rows.numpy(), k.to(torch.int64).numpy(),
                top_p.to(torch.float32).contiguous().numpy(), min_p.contiguous().numpy(), scale.contiguous().numpy(),
                values, ids, kept)
    decided = kept > 0
    if not decided.any():
        return [], rows
    kept = kept[decided]
    widest = int(kept.max())
    values, ids = values[:, :widest][decided], ids[:, :widest][decided]  # only the columns any row keeps
    outside = np.arange(widest) >= kept[:, None]
    chunk = (rows[torch.from_numpy(decided)],
             torch.from_numpy(np.where(outside, np.float32(-np.inf), values)),
             torch.from_numpy(np.where(outside, 0, ids)))
    return [chunk], rows[torch.from_numpy(~decided)]


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Masks logits outside each row's top-k and then nucleus (top-p) sets with -inf (top_k_top_p_cut's sets)."""
    cut = top_k_top_p_cut(logits, top_k, top_p)
    out = torch.full_like(logits, float("-inf"))
    out[cut.uncut] = logits[cut.uncut]
    for rows, values, order in cut.chunks:
        out[rows] = out[rows].scatter_(-1, order, values)
    out[cut.masked_rows] = cut.masked_logits
    return out


def _top_candidates(logits: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor,
                    count: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's ``count`` most likely tokens ``(logits masked to the row's top-k and nucleus, their ids)``,
    and whether that decides the row (its top-k or its nucleus ends among them)."""
    values, order = logits.topk(count, dim=-1)  # most likely first
    in_top_k = torch.arange(count, device=logits.device) < k.unsqueeze(1)
    weights = (values - values[:, :1]).exp().masked_fill(~in_top_k, 0.0)
    # The renormaliser: over the top-k where it lies among the candidates, else over the whole row.
    whole_row = (logits - values[:, :1]).exp().sum(dim=-1)
    probs = weights / torch.where(k <= count, weights.sum(dim=-1), whole_row).unsqueeze(1)
    mass = probs.cumsum(dim=-1)
    # Keep a token when the mass strictly before it is below top_p (so the top token always stays); top_p = 1
    # keeps the whole top-k, even where rounding brings the mass before its last tokens to 1.
    keep = in_top_k & ((mass - probs < top_p.unsqueeze(1)) | (top_p >= 1.0).unsqueeze(1))
    decided = (k <= count) | (mass[:, -1] >= top_p)
    return values.masked_fill(~keep, float("-inf")), order, decided


def _top_k_top_p_sorted(logits: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """apply_top_k_top_p over the whole sorted rows (``k``: each row's top-k, the vocabulary size for none)."""
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[-1], device=logits.device).expand_as(sorted_logits)
    mask = ranks >= k.unsqueeze(1)
    probs = sorted_logits.masked_fill(mask, float("-inf")).softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    mask |= (mass_before >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(mask, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, sorted_idx, sorted_logits)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Masks tokens whose probability is below min_p times the row's highest probability."""
    probs = logits.softmax(dim=-1)
    threshold = min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(probs < threshold, float("-inf"))

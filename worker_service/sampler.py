"""Batched token sampling: greedy, temperature, top-k, top-p, per-request seeds.

Beam-search rows are sampled greedily and also report their most likely
tokens (SamplingParams.num_beam_candidates of them, in top_logprobs): the
scheduler picks the next beams from those candidates.

Random sampling uses the exponential race (argmax of p / E with E ~ Exp(1)),
which equals sampling from p and lets each seeded sequence draw its noise from
its own generator while the rest of the batch shares one draw.

A seeded sequence's noise for output position i comes from a generator seeded
with (seed, i) alone: the token at each position is a function of the seed and
the logits only, so it is the same whatever shares the batch, and the same
again when the sequence is recomputed after a preemption or a restart.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.sampling_params import SamplingParams


@dataclass
class SamplerOutput:
    """Sampled token ids and their log-probabilities under the raw model distribution."""

    token_ids: list[int]
    logprobs: list[float]
    # Per row: the most likely (token, logprob) pairs, best first; empty unless the row asked for them.
    top_logprobs: list[list[tuple[int, float]]]


def _apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Masks logits outside each row's top-k and nucleus (top-p) sets with -inf."""
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device).expand_as(sorted_logits)
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).unsqueeze(1)
    mask = ranks >= k
    probs = sorted_logits.masked_fill(mask, float("-inf")).softmax(dim=-1)
    # Keep a token when the mass strictly before it is below top_p (so the top token always stays).
    mass_before = probs.cumsum(dim=-1) - probs
    mask |= mass_before >= top_p.unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(mask, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, sorted_idx, sorted_logits)


def _position_generator(seed: int, position: int) -> torch.Generator:
    # A fixed odd multiplier spreads (seed, position) pairs over the 63-bit seed space.
    return torch.Generator().manual_seed((seed * 0x9E3779B97F4A7C15 + position) % (1 << 63))


def sample(logits: torch.Tensor, params: list[SamplingParams], positions: list[int]) -> SamplerOutput:
    """Samples one token per row of `logits` ([num_seqs, vocab], float32).

    positions[i]: index among the sequence's output tokens of the token being sampled (seeded rows).
    """
    logprobs_all = torch.log_softmax(logits, dim=-1)
    greedy_ids = logits.argmax(dim=-1)
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    chosen = greedy_ids.clone()
    if random_rows:
        rows = torch.tensor(random_rows, device=logits.device)
        sub = logits[rows]
        temps = torch.tensor([params[i].temperature for i in random_rows], device=logits.device)
        sub = sub / temps.unsqueeze(1)
        top_k = torch.tensor([params[i].top_k for i in random_rows], device=logits.device)
        top_p = torch.tensor([params[i].top_p for i in random_rows], device=logits.device)
        if bool((top_k > 0).any()) or bool((top_p < 1.0).any()):
            sub = _apply_top_k_top_p(sub, top_k, top_p)
        probs = sub.softmax(dim=-1)
        noise = torch.empty_like(probs).exponential_()
        for j, i in enumerate(random_rows):
            seed = params[i].seed
            if seed is not None:
                gen = _position_generator(seed, positions[i])
                noise[j] = torch.empty(probs.shape[1]).exponential_(generator=gen).to(probs.device)
        chosen[rows] = (probs / noise).argmax(dim=-1)
    token_logprobs = logprobs_all.gather(1, chosen.unsqueeze(1)).squeeze(1)
    return SamplerOutput(chosen.tolist(), token_logprobs.tolist(), _top_logprobs(logprobs_all, params))


def _top_logprobs(logprobs: torch.Tensor, params: list[SamplingParams]) -> list[list[tuple[int, float]]]:
    """One batched top-k over the rows that asked (logprobs, or a beam's candidates), each cut to its own k."""
    vocab = logprobs.shape[-1]
    wanted = [min(p.num_top_logprobs, vocab) for p in params]
    k = max(wanted, default=0)
    if k == 0:
        return [[] for _ in params]
    values, indices = logprobs.topk(k, dim=-1)
    values, indices = values.tolist(), indices.tolist()
    return [list(zip(indices[i][:w], values[i][:w])) for i, w in enumerate(wanted)]

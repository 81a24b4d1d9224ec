"""Batched token sampling with vLLM's parameters, as tensor ops over the whole batch.

Per step, in vLLM's order: min_tokens (EOS and stop tokens masked until enough
tokens exist), presence / frequency / repetition penalties, the structured
outputs' grammar masks (grammar_masks.py), then greedy rows
take the argmax and random rows apply temperature, top-k, top-p and min-p and
draw. Only building the per-row parameter tensors touches each row in Python.

A random row draws with the exponential race (argmax of p / E, E ~ Exp(1)).
Unseeded rows take E from torch's global generator; a seeded row's E is a
hash of (seed, output position, token id) alone (seeded_noise), so its token
is a function of the seed, the position and the logits only: the same
whatever shares the batch, and again when the sequence is recomputed after a
preemption. On a CPU the race runs as one compiled pass per row
(_numba_race.py), every row's E from that hash (unseeded rows with random
keys); torch's ops took ~10x longer there (64 rows of a 49k vocabulary:
133 ms against 13 ms on a 2-core Zen 1).

Reported log-probabilities are those of the raw model distribution.
Beam-search rows are sampled greedily and also report their most likely
tokens (SamplingParams.num_beam_candidates of them, in top_logprobs): the
scheduler picks the next beams from those candidates.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from shared.sampling_params import SamplingParams
from worker_service._numba_log_normalizer import first_max_log_normalizer
from worker_service._numba_race import race_candidates, race_tokens
from worker_service.grammar_masks import TokenMasks
from worker_service.logits_processing import (
    apply_min_p,
    apply_penalties,
    TopCut,
    apply_top_k_top_p,
    mask_tokens,
    token_counts,
    top_k_top_p_cut,
)
from worker_service.models.fused_ops import full_team
from worker_service.seeded_noise import row_keys, seeded_exponentials
from worker_service.token_bitmask import apply_token_bitmask


class TokenHistory(Protocol):
    """A sequence's tokens so far: the prompt, then the outputs (the worker's CachedSequence)."""

    token_ids: list[int]
    num_prompt_tokens: int


@dataclass
class SamplerOutput:
    """Sampled token ids and their log-probabilities under the raw model distribution."""

    token_ids: list[int]
    logprobs: list[float]
    # Per row: the most likely (token, logprob) pairs, best first; empty unless the row asked for them.
    top_logprobs: list[list[tuple[int, float]]]


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    seqs: Sequence[TokenHistory],
    eos_token_ids: Sequence[int] = (),
    grammar_masks: TokenMasks | None = None,
) -> SamplerOutput:
    """Samples one token per row of `logits` ([num_seqs, vocab], float32).

    seqs[i]: row i's tokens so far (penalties; its number of outputs is the
    position of the token being sampled). eos_token_ids: masked with each
    row's stop_token_ids while the row has fewer than min_tokens outputs.
    grammar_masks: the tokens the structured outputs of some rows allow.
    """
    raw = logits
    first_max, log_normalizer = _first_max_log_normalizer(raw)
    positions = [len(s.token_ids) - s.num_prompt_tokens for s in seqs]
    constrained = _constrain(logits, params, seqs, positions, eos_token_ids)
    if grammar_masks is not None:
        constrained = apply_grammar(logits, constrained, grammar_masks)
    logits = constrained
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if len(random_rows) == len(params):
        # Every row samples: no argmax, and no copy of the rows (12.5 MB for 64 rows of a 49k vocabulary).
        chosen = _sample_random(logits, params, positions)
    else:
        # Unconstrained rows' argmax is the raw rows' first maximum, found with their normaliser.
        chosen = first_max.clone() if logits is raw and first_max is not None else _argmax(logits)
        if random_rows:
            rows = torch.tensor(random_rows, device=logits.device)
            chosen[rows] = _sample_random(
                logits[rows], [params[i] for i in random_rows], [positions[i] for i in random_rows]
            )
    token_logprobs = raw.gather(1, chosen.unsqueeze(1)).squeeze(1) - log_normalizer
    return SamplerOutput(chosen.tolist(), token_logprobs.tolist(), _top_logprobs(raw, log_normalizer, params))


def _first_max_log_normalizer(logits: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Each row's first maximum (None where it is not computed on the way) and its logsumexp.

    A raw log-probability is ``logits - logsumexp``: nothing vocabulary-wide is written for it. On a CPU one
    compiled pass per row (_numba_log_normalizer.py), torch's ops for the rows it leaves (a NaN, an infinity);
    elsewhere torch's ``logsumexp``.
    """
    if logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.shape[0] == 0:
        return None, torch.logsumexp(logits, dim=-1)
    rows = logits.contiguous()
    first = torch.empty(rows.shape[0], dtype=torch.int64)
    normalizer = torch.empty(rows.shape[0], dtype=torch.float32)
    first_max_log_normalizer(rows.numpy(), first.numpy(), normalizer.numpy(), full_team())
    left = (first < 0).nonzero().flatten()
    if len(left):
        first[left] = _argmax(rows[left])
        normalizer[left] = torch.logsumexp(rows[left], dim=-1)
    return first, normalizer


def _constrain(
    logits: torch.Tensor,
    params: list[SamplingParams],
    seqs: Sequence[TokenHistory],
    positions: list[int],
    eos_token_ids: Sequence[int],
) -> torch.Tensor:
    """logit_bias and allowed_token_ids, then min_tokens masks and penalties, on a copy, for the rows that have
    them (greedy rows included): vLLM's order, its logits processors before the sampler's penalties."""
    shifted = [i for i, p in enumerate(params) if p.shifts_logits]
    early = [i for i, p in enumerate(params) if positions[i] < p.min_tokens]
    penalized = [i for i, p in enumerate(params) if p.has_penalties]
    if not shifted and not early and not penalized:
        return logits
    logits = logits.clone()
    for i in shifted:
        p = params[i]
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), device=logits.device)
            logits[i, ids] += torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype, device=logits.device)
        if p.allowed_token_ids:
            allowed = torch.tensor(p.allowed_token_ids, device=logits.device)
            kept = logits[i, allowed]
            logits[i] = float("-inf")
            logits[i, allowed] = kept
        history, num_prompt = seqs[i].token_ids, seqs[i].num_prompt_tokens
        for bad in p.bad_words_token_ids:
            # The token that would complete the word after the tokens generated so far (vLLM's rule): only the
            # word's length of the history is compared, never the prompt.
            *prefix, last = bad
            if not prefix or (len(history) - num_prompt >= len(prefix) and history[-len(prefix):] == prefix):
                logits[i, last] = float("-inf")
    if early:
        rows = torch.tensor(early, device=logits.device)
        stops = [[*eos_token_ids, *params[i].stop_token_ids] for i in early]
        masked = mask_tokens(logits[rows], stops)  # indexing by a tensor copies the rows
        # Where allowed_token_ids (or bad words) left only stop tokens, min_tokens gives way, as it does to a
        # grammar (apply_grammar): a row with every token masked would emit token 0, which the request excludes.
        kept = ~torch.isneginf(masked.amax(dim=-1))
        logits[rows[kept]] = masked[kept]
    if penalized:
        rows = torch.tensor(penalized, device=logits.device)
        vocab, device = logits.shape[-1], logits.device
        hist = [seqs[i] for i in penalized]
        output_counts = token_counts([s.token_ids[s.num_prompt_tokens:] for s in hist], vocab, device)
        if any(params[i].repetition_penalty != 1.0 for i in penalized):
            prompt_mask = token_counts([s.token_ids[: s.num_prompt_tokens] for s in hist], vocab, device) > 0
        else:
            prompt_mask = torch.zeros_like(output_counts, dtype=torch.bool)

        def per_row(name: str) -> torch.Tensor:
            return torch.tensor([getattr(params[i], name) for i in penalized], device=device)

        logits[rows] = apply_penalties(
            logits[rows], prompt_mask, output_counts,
            per_row("repetition_penalty"), per_row("frequency_penalty"), per_row("presence_penalty"),
        )
    return logits


def apply_grammar(raw: torch.Tensor, logits: torch.Tensor, masks: TokenMasks) -> torch.Tensor:
    """Masks the tokens each constrained row's grammar refuses, last (on a copy of the raw logits if needed).

    Where the other constraints leave the grammar no token (min_tokens hiding the EOS that ends a
    complete output, allowed_token_ids outside the grammar), the grammar wins: the row keeps only its
    mask, so the output stays valid.
    """
    if logits is raw:
        logits = raw.clone()
    left = apply_token_bitmask(logits, masks.rows, masks.bitmask)
    for j, row in enumerate(masks.rows):
        if not left[j]:
            logits[row] = raw[row]
            apply_token_bitmask(logits, [row], masks.bitmask[j : j + 1])
    return logits


def _sample_random(logits: torch.Tensor, params: list[SamplingParams], positions: list[int]) -> torch.Tensor:
    """Temperature, top-k / top-p, min-p, then one exponential-race draw per row."""
    device = logits.device
    temps = torch.tensor([p.temperature for p in params], device=device)
    top_k = torch.tensor([p.top_k for p in params], device=device)
    top_p = torch.tensor([p.top_p for p in params], device=device)
    cut = bool((top_k > 0).any()) or bool((top_p < 1.0).any())
    floor = any(p.min_p > 0.0 for p in params)
    on_cpu = _compiled_race_for(logits)
    if on_cpu:
        # The compiled race and cut take the temperature themselves: no tempered copy of the rows.
        inverse_temperature = 1.0 / temps
        if not cut and not floor:
            return _race_on_cpu(logits, inverse_temperature, params, positions)
        min_p = torch.tensor([p.min_p for p in params]) if floor else None
        return _race_cut_on_cpu(logits, inverse_temperature,
                                top_k_top_p_cut(logits, top_k, top_p, inverse_temperature, min_p), params, positions)
    logits = logits / temps.unsqueeze(1)
    if cut:
        logits = apply_top_k_top_p(logits, top_k, top_p)
    if floor:
        logits = apply_min_p(logits, torch.tensor([p.min_p for p in params], device=device))
    probs = logits.softmax(dim=-1)
    noise = torch.empty_like(probs).exponential_()
    seeded = [j for j, p in enumerate(params) if p.seed is not None]
    if seeded:
        seeds = [params[j].seed for j in seeded]
        noise[torch.tensor(seeded, device=device)] = seeded_exponentials(
            seeds, [positions[j] for j in seeded], probs.shape[1], device  # type: ignore[arg-type]
        )
    # Exponential race: argmax of p / E with E ~ Exp(1) is a sample from p. A token's odds depend on
    # its own probability only, so the tiny logit differences a recompute brings flip a draw only at
    # a genuine near-tie (a cumulative-sum draw would add up every token's rounding instead).
    return _argmax(probs / noise)


def _compiled_race_for(logits: torch.Tensor) -> bool:
    """Whether these logits take the compiled race (float32 on a CPU) rather than torch's ops."""
    return logits.device.type == "cpu" and logits.dtype == torch.float32


def _race_keys(params: list[SamplingParams], positions: list[int], device: torch.device) -> np.ndarray:
    """Each row's two 32-bit race keys ``[2, rows]``: seeded rows from (seed, position), the others at random."""
    keys = torch.randint(0, 1 << 32, (2, len(params)), dtype=torch.int64)
    seeded = [j for j, p in enumerate(params) if p.seed is not None]
    if seeded:
        a, b = row_keys([params[j].seed for j in seeded], [positions[j] for j in seeded],  # type: ignore[misc]
                        device)
        keys[0, seeded], keys[1, seeded] = a, b
    return keys.numpy().astype(np.uint32)


def _race_on_cpu(logits: torch.Tensor, inverse_temperature: torch.Tensor, params: list[SamplingParams],
                 positions: list[int]) -> torch.Tensor:
    """The exponential race of _sample_random's torch path, compiled (_numba_race.py): ~10x faster on a CPU.

    Seeded rows hash their (seed, position) keys into the same noise as seeded_exponentials; unseeded
    rows take random keys from torch's generator.
    """
    words = _race_keys(params, positions, logits.device)
    chosen = np.empty(len(params), dtype=np.int64)
    race_tokens(logits.contiguous().numpy(), inverse_temperature.to(torch.float32).contiguous().numpy(), words[0],
                words[1], chosen)
    return torch.from_numpy(chosen)


def _race_cut_on_cpu(logits: torch.Tensor, inverse_temperature: torch.Tensor, cut: TopCut,
                     params: list[SamplingParams], positions: list[int]) -> torch.Tensor:
    """_race_on_cpu over the rows masked to their top-k / nucleus / min-p sets (``cut`` of ``logits`` at
    ``inverse_temperature``): rows decided on their candidates race over those only, the rest over their whole
    rows (uncut ones at their temperature, masked ones already tempered). 64 top-p rows of the
    default model's vocabulary: the race ~5 ms over whole rows, ~0.1 ms over nuclei."""
    words = _race_keys(params, positions, logits.device)
    chosen = np.empty(len(params), dtype=np.int64)
    whole = torch.cat([cut.uncut, cut.masked_rows]).numpy()
    if len(whole):
        rows = torch.cat([logits[cut.uncut], cut.masked_logits]).to(torch.float32).contiguous().numpy()
        scale = torch.cat([inverse_temperature[cut.uncut], torch.ones(len(cut.masked_rows))])
        picked = np.empty(len(whole), dtype=np.int64)
        race_tokens(rows, scale.to(torch.float32).contiguous().numpy(), words[0, whole], words[1, whole], picked)
        chosen[whole] = picked
    for index, values, order in cut.chunks:
        at = index.numpy()
        picked = np.empty(len(at), dtype=np.int64)
        race_candidates(values.to(torch.float32).contiguous().numpy(), order.contiguous().numpy(), words[0, at],
                        words[1, at], picked)
        chosen[at] = picked
    return torch.from_numpy(chosen)


def _argmax(values: torch.Tensor) -> torch.Tensor:
    """Index of each row's maximum, the first one on a tie (a NaN counts as the maximum), as ``argmax``.

    ``max(dim)`` gives the same indices as ``argmax(dim)`` but is ~3x faster on a CPU over a
    vocabulary-wide row (measured with torch 2.13: 0.4 vs 1.2 ms for [16, 49152]).
    """
    return values.max(dim=-1).indices


def _top_logprobs(logits: torch.Tensor, log_normalizer: torch.Tensor,
                  params: list[SamplingParams]) -> list[list[tuple[int, float]]]:
    """One batched top-k over the rows that asked (logprobs, or a beam's candidates), each cut to its own k.

    The raw logits' top-k less each row's normaliser: the log-probabilities' top-k, as log_softmax keeps the order.
    """
    vocab = logits.shape[-1]
    wanted = [min(p.num_top_logprobs, vocab) for p in params]
    k = max(wanted, default=0)
    if k == 0:
        return [[] for _ in params]
    values, indices = logits.topk(k, dim=-1)
    values = values - log_normalizer.unsqueeze(1)
    values, indices = values.tolist(), indices.tolist()
    return [list(zip(indices[i][:w], values[i][:w])) for i, w in enumerate(wanted)]

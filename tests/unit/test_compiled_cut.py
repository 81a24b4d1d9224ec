"""The compiled top-k / top-p cut (_numba_nucleus.py) against a float64 reference on float32 rows of a real vocabulary's size."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from worker_service import logits_processing
from worker_service.logits_processing import TopCut, top_k_top_p_cut

VOCAB = 49_152  # the default model's: the whole-row sums the cut's boundary rests on are this long
# Rows whose reference nucleus has a token whose preceding mass lies this close to top_p are left out of the
# exact comparison: float32 exponentials and another summation order may put it on either side.
NEAR_TIE = 1e-6


def reference(row: np.ndarray, top_k: int, top_p: float, min_p: float) -> tuple[set[int], float]:
    """The top-k, then the shortest prefix of the renormalised top-k whose mass reaches top_p, then the tokens
    at least min_p times as likely as the first, in float64; and how close (relatively) any token's preceding
    mass came to top_p or its probability ratio to min_p (the margin of those decisions)."""
    order = np.argsort(-row, kind="stable")
    candidates = order[:top_k] if 0 < top_k < len(row) else order
    finite = candidates[np.isfinite(row[candidates])]
    weights = np.exp(row[finite] - row[finite[0]])
    before = np.concatenate([[0.0], np.cumsum(weights / weights.sum())[:-1]])
    keep = before < top_p if top_p < 1.0 else np.ones(len(finite), dtype=bool)
    margin = float(np.abs(before - top_p).min()) if top_p < 1.0 else math.inf
    if min_p > 0.0:
        keep &= weights >= min_p
        margin = min(margin, float(np.abs(weights / min_p - 1.0).min()))
    return set(finite[keep].tolist()), margin


def kept_sets(cut: TopCut, logits: torch.Tensor) -> dict[int, set[int]]:
    sets = {int(r): set(range(logits.shape[1])) - set(torch.nonzero(logits[r] == -math.inf).flatten().tolist())
            for r in cut.uncut}
    for rows, values, ids in cut.chunks:
        for r, v, i in zip(rows.tolist(), values, ids):
            sets[r] = set(i[v > -math.inf].tolist())
    for r, row in zip(cut.masked_rows.tolist(), cut.masked_logits):
        sets[r] = set(torch.nonzero(row > -math.inf).flatten().tolist())
    return sets


def test_the_compiled_cut_keeps_the_reference_sets_at_each_rows_temperature(monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(3)
    spreads = [9.0, 5.0, 3.0, 2.0, 1.0, 0.05]  # from a nucleus of one token to one of most of the vocabulary
    params = [(0, 0.9, 0.0), (0, 0.5, 0.0), (0, 0.99, 0.0), (1, 1.0, 0.0), (50, 1.0, 0.0), (300, 0.95, 0.0),
              (2000, 0.8, 0.0), (0, 1.0, 0.05), (0, 0.9, 0.1), (50, 0.95, 0.3)]
    cases = [(spread, k, p, m, temperature) for spread in spreads for k, p, m in params for temperature in (0.7, 1.3)]
    logits = torch.stack([torch.randn(VOCAB, generator=g) * case[0] for case in cases])
    logits[0, 1::2] = -math.inf  # masked tokens (a grammar, min_tokens) take no part
    logits[1, 1:] = -math.inf  # one token left
    logits[2, :400] = logits[2, :400].round()  # ties across the boundary
    top_k = torch.tensor([case[1] for case in cases])
    top_p = torch.tensor([case[2] for case in cases])
    min_p = torch.tensor([case[3] for case in cases])
    inverse = torch.tensor([1.0 / case[4] for case in cases])
    decided: dict[int, int] = {}
    real_cut = logits_processing.nucleus_cut

    def spy(*args: np.ndarray) -> None:
        real_cut(*args)
        decided.update((int(r), int(n)) for r, n in zip(args[1], args[-1]) if n > 0)  # kept = -1: left to torch

    monkeypatch.setattr(logits_processing, "nucleus_cut", spy)
    cut = top_k_top_p_cut(logits, top_k, top_p, inverse, min_p)
    sets = kept_sets(cut, logits)
    tempered = (logits * inverse.unsqueeze(1)).double().numpy()
    references = [reference(tempered[r], int(top_k[r]), float(top_p[r]), float(min_p[r])) for r in range(len(cases))]
    ties = 0
    for r in decided:
        expected, margin = references[r]
        if margin < NEAR_TIE:
            ties += 1
            continue
        assert sets[r] == expected, (r, cases[r], len(sets[r]), len(expected))
        assert len(expected) == decided[r]
    assert ties <= 2, ties
    # The compiled cut decided every row that keeps up to a few thousand tokens (the flat rows' top-k lie in
    # bins wider than its output: those go to torch) and none that keeps more than its output holds.
    for r, (spread, *_) in enumerate(cases):
        size = len(references[r][0])
        if size <= 2000 and spread > 0.1:
            assert r in decided, (cases[r], size)
        if size > logits_processing.COMPILED_CUT_WIDTH:
            assert r not in decided, (cases[r], size)
    assert len(decided) > len(cases) // 2
    # Kept tokens keep their tempered logits, as torch's product gives them.
    for rows, values, ids in cut.chunks:
        for r, v, i in zip(rows.tolist(), values, ids):
            finite = v > -math.inf
            assert torch.equal(v[finite], logits[r, i[finite]] * inverse[r])

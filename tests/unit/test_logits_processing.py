"""Batched logit transforms against straightforward per-row reference implementations on random logits."""

from __future__ import annotations

import math
import random

import pytest
import torch

from worker_service import logits_processing
from worker_service.logits_processing import (
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
    mask_tokens,
    token_counts,
)

ROWS = 24
VOCAB = 50


@pytest.fixture()
def rng() -> random.Random:
    return random.Random(7)


def random_logits(rng: random.Random, rows: int = ROWS, vocab: int = VOCAB) -> torch.Tensor:
    # float64 on both sides: the comparisons are exact, not within rounding of a cut boundary.
    return torch.tensor([[rng.gauss(0.0, 2.0) for _ in range(vocab)] for _ in range(rows)], dtype=torch.float64)


def softmax(row: list[float]) -> list[float]:
    finite = [x for x in row if x != -math.inf]
    top = max(finite)
    exps = [math.exp(x - top) if x != -math.inf else 0.0 for x in row]
    total = sum(exps)
    return [e / total for e in exps]


def kept(row: torch.Tensor) -> set[int]:
    return {i for i, x in enumerate(row.tolist()) if x != -math.inf}


def reference_top_k_top_p(row: list[float], top_k: int, top_p: float) -> set[int]:
    """Top-k by logit, then the smallest prefix of the renormalised top-k whose mass reaches top_p (top_p = 1:
    the whole top-k)."""
    order = sorted(range(len(row)), key=lambda i: -row[i])
    candidates = order[:top_k] if top_k > 0 else order
    if top_p >= 1.0:
        return set(candidates)
    probs = softmax([row[i] for i in candidates])
    keep, mass = set(), 0.0
    for token, p in zip(candidates, probs):
        if mass >= top_p:
            break
        keep.add(token)
        mass += p
    return keep


def reference_min_p(row: list[float], min_p: float) -> set[int]:
    probs = softmax(row)
    return {i for i, p in enumerate(probs) if p >= min_p * max(probs)}


def reference_penalties(
    row: list[float], prompt: list[int], output: list[int], repetition: float, frequency: float, presence: float
) -> list[float]:
    """transformers' repetition penalty over prompt + output, then OpenAI's frequency / presence over output."""
    out = list(row)
    for token in set(prompt) | set(output):
        out[token] = out[token] / repetition if out[token] > 0 else out[token] * repetition
    for token in set(output):
        out[token] -= frequency * output.count(token) + presence
    return out


def test_top_k_top_p_keep_the_reference_sets(rng: random.Random) -> None:
    logits = random_logits(rng)
    top_k = [rng.choice([0, 1, 2, 5, 17, VOCAB, VOCAB + 3]) for _ in range(ROWS)]
    top_p = [rng.choice([1.0, 0.95, 0.6, 0.3, 0.01]) for _ in range(ROWS)]
    out = apply_top_k_top_p(logits, torch.tensor(top_k), torch.tensor(top_p, dtype=torch.float64))
    for i in range(ROWS):
        assert kept(out[i]) == reference_top_k_top_p(logits[i].tolist(), top_k[i], top_p[i]), (top_k[i], top_p[i])
        # Kept tokens keep their logits: renormalising is the softmax's job.
        assert all(out[i, t] == logits[i, t] for t in kept(out[i]))


def test_top_k_top_p_on_a_large_vocabulary_decide_rows_on_their_most_likely_tokens(
    rng: random.Random, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Rows peaked enough that their nucleus closes among the first 256 candidates, wider ones among 4096, flat
    # ones only over the whole sorted row; top-k both below and above the candidate counts.
    vocab = 12_000
    spreads = [9.0, 5.0, 3.0, 2.0, 1.5, 1.0, 0.3]
    cases = [(spread, k, p) for spread in spreads for k, p in [(0, 0.9), (0, 0.5), (300, 0.95), (2000, 0.99),
                                                              (3, 1.0), (0, 1.0)]]
    logits = torch.tensor([[rng.gauss(0.0, spread) for _ in range(vocab)] for spread, _, _ in cases],
                          dtype=torch.float64)
    top_k = torch.tensor([k for _, k, _ in cases])
    top_p = torch.tensor([p for _, _, p in cases], dtype=torch.float64)
    sorted_rows, candidate_calls = [], []
    whole, candidates = logits_processing._top_k_top_p_sorted, logits_processing._top_candidates

    def spy_sorted(rows: torch.Tensor, *args: torch.Tensor) -> torch.Tensor:
        sorted_rows.append(rows.shape[0])
        return whole(rows, *args)

    def spy_candidates(rows: torch.Tensor, k: torch.Tensor, p: torch.Tensor, count: int) -> tuple:
        values, order, decided = candidates(rows, k, p, count)
        candidate_calls.append((count, int(decided.sum())))
        return values, order, decided

    monkeypatch.setattr(logits_processing, "_top_k_top_p_sorted", spy_sorted)
    monkeypatch.setattr(logits_processing, "_top_candidates", spy_candidates)
    out = apply_top_k_top_p(logits, top_k, top_p)
    for i, (_, k, p) in enumerate(cases):
        row = logits[i].tolist()
        assert kept(out[i]) == reference_top_k_top_p(row, k, p), cases[i]
        assert all(out[i, t] == logits[i, t] for t in kept(out[i]))
    # Each way of deciding a row was taken: the first candidates, the wider ones, the whole sort.
    assert candidate_calls[0][0] == 2000 and candidate_calls[0][1] > 0
    assert len(candidate_calls) == 2 and candidate_calls[1][1] > 0
    assert sum(sorted_rows) > 0


def test_min_p_keeps_the_reference_sets(rng: random.Random) -> None:
    logits = random_logits(rng)
    min_p = [rng.choice([0.0, 0.01, 0.1, 0.5, 0.9, 1.0]) for _ in range(ROWS)]
    out = apply_min_p(logits, torch.tensor(min_p, dtype=torch.float64))
    sizes = []
    for i in range(ROWS):
        expected = reference_min_p(logits[i].tolist(), min_p[i])
        assert kept(out[i]) == expected, min_p[i]
        sizes.append(len(expected))
    assert min(sizes) == 1 and max(sizes) == VOCAB  # min_p = 1 keeps the top token, 0 keeps all


def test_penalties_match_the_reference(rng: random.Random) -> None:
    logits = random_logits(rng)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(1, 30))] for _ in range(ROWS)]
    outputs = [[rng.randrange(VOCAB) for _ in range(rng.randint(0, 40))] for _ in range(ROWS)]
    repetition = [rng.choice([1.0, 0.5, 1.3, 2.0]) for _ in range(ROWS)]
    frequency = [rng.uniform(-2.0, 2.0) for _ in range(ROWS)]
    presence = [rng.uniform(-2.0, 2.0) for _ in range(ROWS)]
    out = apply_penalties(
        logits,
        token_counts(prompts, VOCAB, logits.device) > 0,
        token_counts(outputs, VOCAB, logits.device).double(),
        torch.tensor(repetition, dtype=torch.float64),
        torch.tensor(frequency, dtype=torch.float64),
        torch.tensor(presence, dtype=torch.float64),
    )
    for i in range(ROWS):
        expected = reference_penalties(logits[i].tolist(), prompts[i], outputs[i], repetition[i], frequency[i], presence[i])
        assert out[i].tolist() == pytest.approx(expected, abs=1e-12)


def test_token_counts_and_masks() -> None:
    counts = token_counts([[3, 1, 3, 3], [], [0]], 5, torch.device("cpu"))
    assert counts.tolist() == [[0, 1, 0, 3, 0], [0] * 5, [1, 0, 0, 0, 0]]
    logits = torch.zeros(3, 5)
    mask_tokens(logits, [[4, 2], [], [4]])
    assert [kept(row) for row in logits] == [{0, 1, 3}, {0, 1, 2, 3, 4}, {0, 1, 2, 3}]

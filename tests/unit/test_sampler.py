"""Sampler: greedy, temperature, top-k / top-p masks, per-request seeds, logprobs."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from shared.sampling_params import SamplingParams
from worker_service import sampler as sampler_module
from worker_service.grammar_masks import TokenMasks
from worker_service.sampler import SamplerOutput, sample

# A small vocabulary with distinct logits; the argmax (token 1) is not at index 0.
LOGITS = torch.tensor([0.3, 2.0, -1.0, 1.2, 0.0, 1.6, -0.4, 0.9], dtype=torch.float32)
VOCAB = LOGITS.numel()
ARGMAX = int(LOGITS.argmax())
NUM_DRAWS = 20000
# Each empirical frequency has a standard deviation of at most sqrt(0.25 / 20000) ~ 0.0035.
TOLERANCE = 0.02


def reference_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Straightforward reference: temperature, keep top-k, renormalise, keep the nucleus, renormalise."""
    probs = torch.softmax(logits.double() / temperature, dim=-1).tolist()
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    kept = order[:top_k] if top_k > 0 else order
    total = sum(probs[i] for i in kept)
    renorm = {i: probs[i] / total for i in kept}
    nucleus, mass = [], 0.0
    for i in kept:
        if mass >= top_p:
            break
        nucleus.append(i)
        mass += renorm[i]
    total = sum(renorm[i] for i in nucleus)
    out = torch.zeros(len(probs), dtype=torch.float64)
    for i in nucleus:
        out[i] = renorm[i] / total
    return out


def nucleus_margin(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> float:
    """Distance of top_p from every cumulative-mass boundary (so float rounding cannot flip the cut)."""
    probs = torch.softmax(logits.double() / temperature, dim=-1).sort(descending=True).values
    if top_k > 0:
        probs = probs[:top_k] / probs[:top_k].sum()
    cums = probs.cumsum(0).tolist()
    return min(abs(c - top_p) for c in cums)


@dataclass
class History:
    """A row's tokens so far (what the worker's CachedSequence gives the sampler)."""

    token_ids: list[int]
    num_prompt_tokens: int


def at(positions: list[int]) -> list[History]:
    """Rows about to sample output position positions[i] (their earlier outputs are token 0)."""
    return [History([0] * p, 0) for p in positions]


def draw(params: SamplingParams, n: int = NUM_DRAWS, logits: torch.Tensor = LOGITS) -> SamplerOutput:
    batch = logits.unsqueeze(0).repeat(n, 1)
    return sample(batch, [params] * n, at([0] * n))


def frequencies(token_ids: list[int], vocab: int = VOCAB) -> torch.Tensor:
    return torch.bincount(torch.tensor(token_ids), minlength=vocab).double() / len(token_ids)


@pytest.fixture(autouse=True)
def _seed_global_rng() -> None:
    torch.manual_seed(1234)


@pytest.fixture(autouse=True, params=["compiled", "torch"])
def race(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test runs with the CPU's compiled exponential race and with torch's ops (a GPU's path)."""
    if request.param == "torch":
        monkeypatch.setattr(sampler_module, "_compiled_race_for", lambda logits: False)
    return str(request.param)


# -- greedy ------------------------------------------------------------------------------


def test_greedy_rows_return_argmax_and_its_raw_logprob() -> None:
    logits = torch.tensor(
        [
            [0.1, 0.2, 3.0, -1.0],
            [5.0, 4.0, 3.0, 2.0],
            [-2.0, -1.0, -3.0, -0.5],
        ],
        dtype=torch.float32,
    )
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0), SamplingParams(temperature=1e-6)]
    out = sample(logits, params, at([0, 0, 0]))
    assert out.token_ids == [2, 0, 3]
    expected = torch.log_softmax(logits, dim=-1)[torch.arange(3), torch.tensor([2, 0, 3])]
    assert out.logprobs == pytest.approx(expected.tolist(), abs=1e-6)
    assert all(isinstance(t, int) for t in out.token_ids)
    assert len(out.logprobs) == 3


def test_greedy_ignores_top_k_top_p_and_seed() -> None:
    params = SamplingParams(temperature=0.0, top_k=3, top_p=0.1, seed=5)
    out = sample(LOGITS.unsqueeze(0), [params], at([5]))
    assert out.token_ids == [ARGMAX]
    assert out.logprobs[0] == pytest.approx(float(torch.log_softmax(LOGITS, -1)[ARGMAX]), abs=1e-6)


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_top_k_1_always_returns_argmax(temperature: float) -> None:
    out = draw(SamplingParams(temperature=temperature, top_k=1), n=500)
    assert set(out.token_ids) == {ARGMAX}


def test_tiny_top_p_always_returns_argmax() -> None:
    out = draw(SamplingParams(temperature=1.0, top_p=1e-3), n=500)
    assert set(out.token_ids) == {ARGMAX}


# -- distributions -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [
        (1.0, 0, 1.0),  # plain softmax sampling
        (0.5, 0, 1.0),  # temperature sharpens
        (2.0, 0, 1.0),  # temperature flattens
        (1.0, 3, 1.0),  # top-k only
        (1.0, -1, 1.0),  # -1 disables top-k
        (1.0, 0, 0.8),  # top-p only
        (1.5, 0, 0.8),  # top-p on the tempered distribution (5 tokens kept; 4 without temperature)
        (1.0, 5, 0.7),  # top-k then top-p on the renormalised top-k distribution
        (0.7, 4, 0.85),  # top-p on the renormalised top-4 keeps 3 (4 on the full distribution)
        (1.5, 20, 0.95),  # top_k larger than the vocabulary keeps everything
    ],
)
def test_empirical_distribution_matches_reference(temperature: float, top_k: int, top_p: float) -> None:
    k = max(top_k, 0)
    if top_p < 1.0:
        assert nucleus_margin(LOGITS, temperature, k, top_p) > 0.01, "test case sits on a cut boundary"
    expected = reference_probs(LOGITS, temperature, k, top_p)
    out = draw(SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p))
    freq = frequencies(out.token_ids)
    # Tokens outside the kept set never appear.
    assert set(out.token_ids) <= {i for i in range(VOCAB) if expected[i] > 0}
    assert float((freq - expected).abs().max()) < TOLERANCE, (freq.tolist(), expected.tolist())
    # Logprobs are always those of the raw (unfiltered, untempered) model distribution.
    raw = torch.log_softmax(LOGITS, dim=-1)
    assert torch.allclose(torch.tensor(out.logprobs), raw[torch.tensor(out.token_ids)], atol=1e-6)


def test_per_row_filters_in_a_mixed_batch() -> None:
    # Rows with different filters share one batch: each row follows its own distribution.
    configs = [(1.0, 2, 1.0), (1.0, 0, 1.0), (0.5, 0, 0.6), (2.0, 4, 1.0)]
    n = 8000
    params = [SamplingParams(temperature=t, top_k=k, top_p=p) for t, k, p in configs] * n
    out = sample(LOGITS.unsqueeze(0).repeat(len(params), 1), params, at([0] * len(params)))
    for j, (t, k, p) in enumerate(configs):
        tokens = out.token_ids[j :: len(configs)]
        expected = reference_probs(LOGITS, t, k, p)
        assert set(tokens) <= {i for i in range(VOCAB) if expected[i] > 0}
        assert float((frequencies(tokens) - expected).abs().max()) < 0.03, (j, frequencies(tokens), expected)


def test_reference_keeps_expected_sets() -> None:
    """Pins the reference itself on hand-checked cases."""
    # Sorted by logit: 1 (2.0), 5 (1.6), 3 (1.2), 7 (0.9), 0 (0.3), 4 (0.0), 6 (-0.4), 2 (-1.0).
    assert set(torch.nonzero(reference_probs(LOGITS, 1.0, 3, 1.0)).flatten().tolist()) == {1, 5, 3}
    p = torch.softmax(LOGITS.double(), -1)
    top3 = reference_probs(LOGITS, 1.0, 3, 1.0)
    assert top3[[1, 5, 3]].tolist() == pytest.approx((p[[1, 5, 3]] / p[[1, 5, 3]].sum()).tolist())
    # Top-p 0.8: cumulative masses 0.34, 0.57, 0.73, 0.84, ... -> the mass before the fifth is >= 0.8.
    assert set(torch.nonzero(reference_probs(LOGITS, 1.0, 0, 0.8)).flatten().tolist()) == {1, 5, 3, 7}


def test_masked_tokens_never_appear_even_when_almost_likely() -> None:
    # Two near-equal leaders and a long flat tail: top_k=2 must never emit the tail.
    logits = torch.tensor([1.0, 5.0, 4.999, 4.99, 4.98, 1.0], dtype=torch.float32)
    out = draw(SamplingParams(top_k=2), n=5000, logits=logits)
    assert set(out.token_ids) == {1, 2}


def test_top_p_always_keeps_the_top_token_when_it_alone_exceeds_top_p() -> None:
    logits = torch.tensor([0.0, 10.0, 0.0, 0.0], dtype=torch.float32)
    out = draw(SamplingParams(top_p=0.5), n=200, logits=logits)
    assert set(out.token_ids) == {1}


# -- seeds -------------------------------------------------------------------------------


def _seeded_run(seed: int, layouts: list[tuple[int, list[SamplingParams]]], steps: int = 12) -> list[int]:
    """Samples `steps` tokens for one seeded row; each step places it among other rows.

    layouts[step % len] = (row index of the seeded row, params of the other rows).
    The seeded row samples output positions 0, 1, 2, ... as the worker does.
    """
    mine = SamplingParams(temperature=1.0, seed=seed)
    flat = torch.zeros(VOCAB)  # uniform: every token equally likely, so runs are informative
    tokens = []
    for step in range(steps):
        index, others = layouts[step % len(layouts)]
        params = list(others)
        params.insert(index, mine)
        positions = [1000 + j for j in range(len(params))]
        positions[index] = step
        logits = torch.randn(len(params), VOCAB)
        logits[index] = flat
        out = sample(logits, params, at(positions))
        tokens.append(out.token_ids[index])
    return tokens


def test_same_seed_gives_same_tokens_whatever_shares_the_batch() -> None:
    alone = _seeded_run(42, [(0, [])])
    crowded = _seeded_run(
        42,
        [
            (2, [SamplingParams(), SamplingParams(temperature=0.0), SamplingParams(seed=7), SamplingParams(top_k=2)]),
            (0, [SamplingParams(top_p=0.5)]),
            (1, [SamplingParams(seed=42), SamplingParams(), SamplingParams(temperature=0.0)]),
        ],
    )
    torch.manual_seed(999)  # a different global RNG state must not matter either
    reordered = _seeded_run(42, [(3, [SamplingParams(), SamplingParams(), SamplingParams(seed=1)])])
    assert alone == crowded == reordered
    assert len(set(alone)) > 1  # the runs actually sample


def test_different_seeds_differ() -> None:
    runs = {seed: tuple(_seeded_run(seed, [(0, [])])) for seed in (1, 2, 3)}
    assert len(set(runs.values())) == 3


def test_seeded_rows_follow_the_distribution() -> None:
    # Each seeded row draws its own noise: 4000 distinct seeds sample the masked distribution.
    n = 4000
    params = [SamplingParams(top_k=3, seed=s) for s in range(n)]
    out = sample(LOGITS.unsqueeze(0).repeat(n, 1), params, at([0] * n))
    expected = reference_probs(LOGITS, 1.0, 3, 1.0)
    assert set(out.token_ids) <= {1, 5, 3}
    assert float((frequencies(out.token_ids) - expected).abs().max()) < 0.04


def test_mixed_greedy_seeded_and_random_rows_in_one_batch() -> None:
    rows = torch.tensor(
        [
            [0.0, 0.0, 9.0, 0.0, 0.0, 0.0, 0.0, 0.0],  # greedy -> 2
            LOGITS.tolist(),  # random, top_k=2 -> {1, 5}
            [0.0] * VOCAB,  # seeded, uniform
            [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 3.0],  # greedy -> 7
            LOGITS.tolist(),  # random, top_p tiny -> argmax
        ],
        dtype=torch.float32,
    )
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(top_k=2),
        SamplingParams(seed=11),
        SamplingParams(temperature=0.0, seed=3),
        SamplingParams(top_p=1e-3, temperature=0.9),
    ]
    solo = sample(rows[2:3], [params[2]], at([4])).token_ids[0]
    for _ in range(50):
        out = sample(rows, params, at([0, 0, 4, 4, 0]))
        assert out.token_ids[0] == 2
        assert out.token_ids[1] in (1, 5)
        assert out.token_ids[2] == solo
        assert out.token_ids[3] == 7
        assert out.token_ids[4] == ARGMAX
        expected = torch.log_softmax(rows, dim=-1)[torch.arange(5), torch.tensor(out.token_ids)]
        assert out.logprobs == pytest.approx(expected.tolist(), abs=1e-6)


def test_single_random_row_and_all_random_batch_shapes() -> None:
    out = sample(LOGITS.unsqueeze(0), [SamplingParams()], at([0]))
    assert len(out.token_ids) == 1 and 0 <= out.token_ids[0] < VOCAB
    logits = torch.randn(3, 16)
    out = sample(logits, [SamplingParams(top_k=1)] * 3, at([0] * 3))
    assert out.token_ids == logits.argmax(-1).tolist()


def test_seeded_token_depends_only_on_seed_position_and_logits() -> None:
    """Recomputing a preempted seeded sequence samples the same token at the same position."""
    params = [SamplingParams(seed=5)]
    flat = torch.zeros(1, 64)
    first = [sample(flat, params, at([pos])).token_ids[0] for pos in range(20)]
    torch.manual_seed(123)
    again = [sample(flat, params, at([pos])).token_ids[0] for pos in range(20)]
    assert first == again
    assert len(set(first)) > 5


def test_top_logprobs_per_row() -> None:
    logits = torch.stack([LOGITS, LOGITS.flip(0), LOGITS])
    params = [SamplingParams(temperature=0.0, logprobs=3), SamplingParams(temperature=0.0), SamplingParams(logprobs=0)]
    out = sample(logits, params, at([0, 0, 0]))
    expected = torch.log_softmax(LOGITS, dim=-1)
    values, ids = expected.topk(3)
    assert [t for t, _ in out.top_logprobs[0]] == ids.tolist()
    assert [lp for _, lp in out.top_logprobs[0]] == pytest.approx(values.tolist(), abs=1e-6)
    assert out.top_logprobs[1] == [] and out.top_logprobs[2] == []


# -- penalties, min-p, min_tokens --------------------------------------------------------


def reference_distribution(
    logits: torch.Tensor, prompt: list[int], output: list[int], params: SamplingParams
) -> torch.Tensor:
    """Straightforward vLLM pipeline: penalties, temperature, top-k, top-p, min-p, renormalise."""
    row = logits.double().tolist()
    for token in set(prompt) | set(output):
        row[token] = row[token] / params.repetition_penalty if row[token] > 0 else row[token] * params.repetition_penalty
    for token in set(output):
        row[token] -= params.frequency_penalty * output.count(token) + params.presence_penalty
    probs = reference_probs(torch.tensor(row, dtype=torch.float64), params.temperature, params.top_k, params.top_p)
    probs[probs < params.min_p * probs.max()] = 0.0
    return probs / probs.sum()


def test_penalized_min_p_distribution_matches_reference() -> None:
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(3)) * 1.5
    prompt, output = [1, 2, 2, 6], [7, 7, 0, 3]
    params = SamplingParams(
        temperature=0.8, top_k=7, top_p=0.97, min_p=0.08,
        repetition_penalty=1.4, frequency_penalty=0.3, presence_penalty=-0.5,
    )
    expected = reference_distribution(logits, prompt, output, params)
    # The filters bite: some tokens are cut, several remain, and penalties moved the probabilities.
    assert 2 < int((expected > 0).sum()) < VOCAB - 1
    plain = reference_distribution(logits, [], [], params)
    assert float((expected - plain).abs().max()) > 0.05
    n = NUM_DRAWS
    out = sample(logits.unsqueeze(0).repeat(n, 1), [params] * n, [History(prompt + output, len(prompt))] * n)
    assert set(out.token_ids) <= {i for i in range(VOCAB) if expected[i] > 0}
    assert float((frequencies(out.token_ids) - expected).abs().max()) < TOLERANCE
    # Logprobs stay those of the raw model distribution.
    raw = torch.log_softmax(logits, dim=-1)
    assert torch.allclose(torch.tensor(out.logprobs), raw[torch.tensor(out.token_ids)], atol=1e-6)


def test_penalties_steer_greedy_rows_only_where_set() -> None:
    # Token 1 leads; it was generated twice, so a frequency penalty of 1 hands the argmax to token 5.
    history = History([7, 1, 1], 1)
    params = [SamplingParams(temperature=0.0, frequency_penalty=1.0), SamplingParams(temperature=0.0)]
    out = sample(LOGITS.unsqueeze(0).repeat(2, 1), params, [history, history])
    assert out.token_ids == [5, ARGMAX]
    # Repetition over the prompt too: dividing token 1's positive logit by 2 leaves 1.0 < 1.6.
    out = sample(LOGITS.unsqueeze(0), [SamplingParams(temperature=0.0, repetition_penalty=2.0)], [History([1], 1)])
    assert out.token_ids == [5]
    assert out.logprobs[0] == pytest.approx(float(torch.log_softmax(LOGITS, -1)[5]), abs=1e-6)


def test_min_tokens_masks_eos_and_stop_tokens_until_reached() -> None:
    eos = ARGMAX
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[5])
    tokens = [sample(LOGITS.unsqueeze(0), [params], at([p]), eos_token_ids=[eos]).token_ids[0] for p in range(5)]
    # Outputs 0-2 cannot be EOS (1) or the stop token (5): the next best is 3; from the third on, EOS.
    assert tokens == [3, 3, 3, eos, eos]
    random_rows = sample(
        LOGITS.unsqueeze(0).repeat(2000, 1), [SamplingParams(min_tokens=1, stop_token_ids=[3])] * 2000,
        at([0] * 2000), eos_token_ids=[eos],
    )
    assert not {eos, 3} & set(random_rows.token_ids)


def test_min_tokens_gives_way_where_the_allowed_tokens_are_all_stop_tokens() -> None:
    # Masking them would leave the row nothing and emit token 0, outside allowed_token_ids; as with a grammar
    # (below), the hard constraint wins and the request may end before min_tokens.
    eos = ARGMAX
    only_stops = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[5], allowed_token_ids=[5, eos])
    one_left = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[5], allowed_token_ids=[5, 6])
    out = sample(LOGITS.unsqueeze(0).repeat(2, 1), [only_stops, one_left], at([0, 0]), eos_token_ids=[eos])
    assert out.token_ids == [eos, 6]
    drawn = sample(LOGITS.unsqueeze(0).repeat(500, 1), [SamplingParams(min_tokens=2, allowed_token_ids=[5])] * 500,
                   at([0] * 500), eos_token_ids=[5])
    assert set(drawn.token_ids) == {5}


def test_seeded_rows_with_every_knob_match_alone_and_in_a_mixed_batch() -> None:
    logits = torch.randn(6, 64, generator=torch.Generator().manual_seed(11))
    histories = [History(list(range(i, i + 9)), 4) for i in range(6)]
    params = [
        SamplingParams(seed=3, top_k=20, top_p=0.9, min_p=0.05, repetition_penalty=1.2, presence_penalty=0.5),
        SamplingParams(temperature=0.0, frequency_penalty=1.0),
        SamplingParams(seed=4, temperature=0.7, min_tokens=8, stop_token_ids=[10]),
        SamplingParams(top_p=0.5, min_p=0.2),
        SamplingParams(seed=3, frequency_penalty=-1.0),
        SamplingParams(temperature=1.3, min_tokens=10),
    ]
    batch = sample(logits, params, histories, eos_token_ids=[0]).token_ids
    for i in (0, 2, 4):
        alone = sample(logits[i : i + 1], [params[i]], [histories[i]], eos_token_ids=[0]).token_ids[0]
        assert batch[i] == alone, i
    reversed_batch = sample(logits.flip(0), params[::-1], histories[::-1], eos_token_ids=[0]).token_ids[::-1]
    assert [reversed_batch[i] for i in (0, 2, 4)] == [batch[i] for i in (0, 2, 4)]


# -- seeded noise ------------------------------------------------------------------------


@pytest.mark.parametrize("race", ["compiled"], indirect=True)
def test_compiled_and_torch_races_draw_the_same_seeded_tokens(race: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Both paths hash (seed, position, token) into the same noise: a seeded request samples the same
    # tokens on a CPU worker and a GPU one, barring near-ties of p / E (none in random logits of this size).
    logits = torch.randn(48, 3000) * 2
    params = [SamplingParams(temperature=0.5 + 0.02 * i, seed=1000 + i) for i in range(48)]
    histories = at(list(range(48)))
    compiled = sample(logits, params, histories).token_ids
    monkeypatch.setattr(sampler_module, "_compiled_race_for", lambda logits: False)
    assert sample(logits, params, histories).token_ids == compiled
    assert len(set(compiled)) > 20


@pytest.mark.parametrize("race", ["compiled"], indirect=True)
@pytest.mark.parametrize("trial", range(6))
def test_the_race_over_nuclei_draws_the_tokens_of_the_race_over_masked_rows(race: str, trial: int) -> None:
    # Rows decided on their candidates race over those only (race_candidates); the tokens must be exactly
    # those of race_tokens over the same rows masked to their top-k / nucleus / min-p sets, seeded and unseeded
    # rows alike, beside rows that are not cut and rows whose nucleus is too wide for the candidates (sorted
    # whole), or whose min-p keeps too many tokens (masked whole).
    from worker_service.logits_processing import apply_min_p, apply_top_k_top_p

    g = torch.Generator().manual_seed(trial)
    rows, vocab = 42, 6000
    peaked = torch.randn(rows, vocab, generator=g) * 4
    flat = torch.randn(rows, vocab, generator=g) * 0.05
    logits = torch.where((torch.arange(rows) % 7 >= 5).unsqueeze(1), flat, peaked)
    cuts = [(0, 0.9, 0.0), (40, 1.0, 0.0), (0, 1.0, 0.0), (300, 0.95, 0.1), (0, 1.0, 0.05), (0, 0.999, 0.0),
            (0, 1.0, 0.9)]
    params = [SamplingParams(temperature=0.7 + 0.01 * i, top_k=cuts[i % 7][0], top_p=cuts[i % 7][1],
                             min_p=cuts[i % 7][2], seed=None if i % 3 == 0 else 50 * trial + i) for i in range(rows)]
    positions = list(range(rows))
    temps = torch.tensor([p.temperature for p in params]).unsqueeze(1)
    top_k = torch.tensor([p.top_k for p in params])
    top_p = torch.tensor([p.top_p for p in params])
    torch.manual_seed(trial)  # the unseeded rows' keys: the same draw on both paths
    masked = apply_min_p(apply_top_k_top_p(logits / temps, top_k, top_p), torch.tensor([p.min_p for p in params]))
    expected = sampler_module._race_on_cpu(masked, torch.ones(rows), params, positions).tolist()
    torch.manual_seed(trial)
    assert sampler_module._sample_random(logits, params, positions).tolist() == expected
    assert all(masked[r, t] > float("-inf") for r, t in enumerate(expected))
    assert len(set(expected)) > rows // 2


def test_seeded_noise_is_exponential_and_depends_only_on_seed_and_position() -> None:
    from worker_service.seeded_noise import seeded_exponentials

    seeds = [s * 7919 for s in range(300)] + [2**64 - 1 - s for s in range(100)]
    positions = [0, 1, 2, 500]
    rows_seeds = [s for s in seeds for _ in positions]
    rows_positions = positions * len(seeds)
    noise = seeded_exponentials(rows_seeds, rows_positions, 64, torch.device("cpu"))
    assert noise.shape == (1600, 64) and bool(((noise > 0) & torch.isfinite(noise)).all())
    # exp(-E) of Exp(1) noise is uniform: 102 400 values in 20 bins of 5% each (std ~0.07%).
    bins = torch.histc(torch.exp(-noise.double()), bins=20, min=0.0, max=1.0) / noise.numel()
    assert float((bins - 0.05).abs().max()) < 0.003
    # Neighbouring tokens, positions and seeds are uncorrelated.
    def corr(x: torch.Tensor, y: torch.Tensor) -> float:
        return abs(float(torch.corrcoef(torch.stack([x.flatten(), y.flatten()]))[0, 1]))

    grid = noise.reshape(len(seeds), len(positions), 64)
    assert corr(grid[..., :-1], grid[..., 1:]) < 0.02
    assert corr(grid[:, :-1], grid[:, 1:]) < 0.02
    assert corr(grid[:-1], grid[1:]) < 0.02
    # A row depends only on its own (seed, position): recomputing some rows in any order agrees.
    picks = [1234, 7, 999, 500]
    again = seeded_exponentials([rows_seeds[i] for i in picks], [rows_positions[i] for i in picks], 64,
                                torch.device("cpu"))
    assert torch.equal(again, noise[picks])


# -- logit_bias and allowed_token_ids ----------------------------------------------------------


def test_logit_bias_shifts_the_distribution_and_keeps_raw_logprobs() -> None:
    # Greedy: +1.0 on token 5 (1.6 -> 2.6) beats the argmax (2.0); -100 on token 1 removes it.
    biased = SamplingParams(temperature=0.0, logit_bias={5: 1.0})
    banned = SamplingParams(temperature=0.0, logit_bias={1: -100.0})
    plain = SamplingParams(temperature=0.0)
    out = sample(LOGITS.unsqueeze(0).repeat(3, 1), [biased, banned, plain], at([0, 0, 0]))
    assert out.token_ids == [5, 5, ARGMAX]
    # Logprobs are the model's, as vLLM returns them by default (raw_logprobs).
    assert out.logprobs[0] == pytest.approx(float(torch.log_softmax(LOGITS, -1)[5]), abs=1e-6)
    # Sampled rows follow softmax(logits + bias).
    bias = {3: 2.0, 6: -1.5}
    got = frequencies(draw(SamplingParams(temperature=1.0, logit_bias=bias)).token_ids)
    shifted = LOGITS.clone()
    for token, b in bias.items():
        shifted[token] += b
    assert torch.allclose(got, torch.softmax(shifted.double(), -1), atol=TOLERANCE)


def test_allowed_token_ids_restrict_every_row_that_sets_them() -> None:
    allowed = [0, 6, 7]
    greedy = sample(LOGITS.unsqueeze(0), [SamplingParams(temperature=0.0, allowed_token_ids=allowed)], at([0]))
    assert greedy.token_ids == [7]  # 0.9 is the best of 0.3, -0.4, 0.9
    got = frequencies(draw(SamplingParams(temperature=1.0, allowed_token_ids=allowed)).token_ids)
    expected = torch.zeros(VOCAB, dtype=torch.float64)
    expected[allowed] = torch.softmax(LOGITS[allowed].double(), -1)
    assert torch.allclose(got, expected, atol=TOLERANCE)


def test_logit_bias_and_allowed_token_ids_are_validated() -> None:
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={3: 101.0})
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[-1])
    with pytest.raises(ValueError, match="not supported with beam search"):
        SamplingParams(use_beam_search=True, best_of=2, temperature=0.0, logit_bias={1: 1.0})


def test_bad_words_mask_the_token_that_would_complete_them() -> None:
    # Greedy picks token 1 (logit 2.0), then 5 (1.6) when 1 is masked.
    single = SamplingParams(temperature=0.0, bad_words=["x"], bad_words_token_ids=[[1]])
    # A two-token word [3, 1]: token 1 is masked only right after a generated 3.
    pair = SamplingParams(temperature=0.0, bad_words=["xy"], bad_words_token_ids=[[3, 1]])
    rows = [History([0, 0], 2), History([0, 0, 3], 2), History([0, 0, 2], 2), History([3], 1)]
    out = sample(LOGITS.unsqueeze(0).repeat(4, 1), [single, pair, pair, pair], rows)
    # The last row's 3 is in the prompt, not generated: nothing to complete.
    assert out.token_ids == [5, 5, ARGMAX, ARGMAX]


# -- structured outputs' grammar masks ------------------------------------------------------


def _bits(*allowed: list[int]) -> torch.Tensor:
    """A packed mask per row (one 32-bit word covers the 8-token vocabulary)."""
    return torch.tensor([[sum(1 << t for t in row) - (1 << 32 if 31 in row else 0)] for row in allowed],
                        dtype=torch.int32)


def test_grammar_masks_restrict_only_their_rows_and_keep_raw_logprobs() -> None:
    free = SamplingParams(temperature=0.0)
    params = [free, SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)]
    masks = TokenMasks(rows=[1, 2], bitmask=_bits([0, 6, 7], [3, 4]))
    out = sample(LOGITS.unsqueeze(0).repeat(3, 1), params, at([0, 0, 0]), grammar_masks=masks)
    assert out.token_ids[0] == ARGMAX and out.token_ids[1] == 7 and out.token_ids[2] in (3, 4)
    assert out.logprobs[1] == pytest.approx(float(torch.log_softmax(LOGITS, -1)[7]), abs=1e-6)
    # A sampled constrained row follows the distribution renormalised over what the grammar allows.
    n = NUM_DRAWS
    got = frequencies(sample(LOGITS.unsqueeze(0).repeat(n, 1), [SamplingParams(temperature=1.0)] * n, at([0] * n),
                             grammar_masks=TokenMasks(list(range(n)), _bits(*[[3, 4]] * n))).token_ids)
    expected = torch.zeros(VOCAB, dtype=torch.float64)
    expected[[3, 4]] = torch.softmax(LOGITS[[3, 4]].double(), -1)
    assert torch.allclose(got, expected, atol=TOLERANCE)


def test_the_grammar_wins_where_other_constraints_leave_it_no_token() -> None:
    """min_tokens masks EOS (token 2) but the grammar is complete and allows only EOS: the row ends anyway;
    allowed_token_ids outside the grammar give way to it too."""
    eos_only = SamplingParams(temperature=0.0, min_tokens=5)
    disjoint = SamplingParams(temperature=0.0, allowed_token_ids=[0, 1])
    compatible = SamplingParams(temperature=0.0, allowed_token_ids=[4, 5])
    masks = TokenMasks(rows=[0, 1, 2], bitmask=_bits([2], [6, 7], [3, 4]))
    out = sample(LOGITS.unsqueeze(0).repeat(3, 1), [eos_only, disjoint, compatible], at([0, 0, 0]), eos_token_ids=[2],
                 grammar_masks=masks)
    assert out.token_ids == [2, 7, 4]


def test_raw_logprobs_and_greedy_tokens_against_float64_over_a_full_vocabulary() -> None:
    """The compiled per-row maximum and logsumexp (CPU): logprobs within 1e-5 of float64's log_softmax, the
    first of tied maxima taken, and rows with a NaN or an infinity left to torch's semantics."""
    torch.manual_seed(0)
    logits = torch.randn(6, 49152) * 4
    logits[1, 7] = logits[1, 40000] = logits[1].max() + 1.0  # a tie: the first index wins
    logits[2, 123] = float("nan")  # torch: a NaN is the maximum, every logprob NaN
    logits[3, 5] = float("-inf")  # a masked-out token: the row is still a distribution
    params = [SamplingParams(temperature=0.0, max_tokens=4, logprobs=3)] * 6
    out = sample(logits, params, [History([1, 2], num_prompt_tokens=1)] * 6)
    reference = torch.log_softmax(logits.double(), dim=-1)
    for row in (0, 1, 3, 4, 5):
        token = int(logits[row].argmax())
        assert out.token_ids[row] == token
        assert out.logprobs[row] == pytest.approx(float(reference[row, token]), abs=1e-5)
        top = reference[row].topk(3)
        assert [t for t, _ in out.top_logprobs[row]] == top.indices.tolist()
        assert [v for _, v in out.top_logprobs[row]] == pytest.approx(top.values.tolist(), abs=1e-5)
    assert out.token_ids[1] == 7
    assert out.token_ids[2] == 123 and out.logprobs[2] != out.logprobs[2]

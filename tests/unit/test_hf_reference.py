"""The batched reference (greedy_many) gives greedy()'s tokens, cut at the same stop, in the prompts' order."""

from __future__ import annotations

import random
from pathlib import Path

from tests.hf_reference import HFReference, compare_greedy


def test_greedy_many_matches_greedy_prompt_by_prompt(tiny_llama_dir: Path) -> None:
    reference = HFReference(str(tiny_llama_dir))
    rng = random.Random(5)
    # Lengths out of order and batches of 3: sorting, padding and the return order are all exercised.
    prompts = [[rng.randrange(3, 40000) for _ in range(n)] for n in (37, 4, 90, 12, 12, 61, 5)]
    many = reference.greedy_many(prompts, 24, stop_at_eos=False, batch_size=3)
    assert len(many) == len(prompts)
    for prompt, batched in zip(prompts, many):
        single = reference.greedy(prompt, 24, stop_at_eos=False)
        assert batched.token_ids == single.token_ids
        assert batched.logprobs.shape == single.logprobs.shape
        # Padding changes the logits by rounding only (the tiny model's logits are large: ~1e-5 relative).
        assert float((batched.logprobs - single.logprobs).abs().max()) < 1e-3
        assert compare_greedy(batched.token_ids, single).matched


def test_greedy_many_cuts_each_row_at_its_own_stop(tiny_llama_dir: Path) -> None:
    reference = HFReference(str(tiny_llama_dir))
    rng = random.Random(9)
    prompts = [[rng.randrange(3, 40000) for _ in range(rng.randint(4, 30))] for _ in range(6)]
    # A random tiny model hardly ever samples its EOS: the stop becomes a token one row generates early.
    stop = reference.greedy(prompts[2], 12, stop_at_eos=False).token_ids[3]
    reference.model.generation_config.eos_token_id = stop
    singles = [reference.greedy(p, 12) for p in prompts]
    many = reference.greedy_many(prompts, 12, batch_size=3)
    assert [m.token_ids for m in many] == [s.token_ids for s in singles]
    for m in many:
        assert m.logprobs.shape[0] == len(m.token_ids)
    # That row stopped while its batch went on: the cut was exercised.
    assert many[2].token_ids[-1] == stop and len(many[2].token_ids) == 4
    assert max(len(m.token_ids) for m in many) == 12

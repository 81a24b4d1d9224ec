"""The simulated worker's model (worker_service/simulation.py): profiles, step times, tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from worker_service.simulation import PROFILES_DIR, SimulationProfile, simulated_continuation, simulated_token


@pytest.mark.parametrize("name", sorted(p.stem for p in PROFILES_DIR.glob("*.json")))
def test_every_bundled_profile_loads_states_its_sources_and_holds_blocks(name: str) -> None:
    profile = SimulationProfile.load(name)
    assert profile.name == name and json.loads((PROFILES_DIR / f"{name}.json").read_text())["sources"]
    assert profile.num_gpu_blocks(16) > 1000


def test_llama_3_8b_on_an_h100_by_hand() -> None:
    p = SimulationProfile.load("llama-3-8b-h100")
    assert p.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2  # 128 KiB
    # (80 GiB x 0.9 - 16.06 GB of weights) / 2 MiB blocks of 16 tokens.
    assert p.num_gpu_blocks(16) == int((80 * 2**30 * 0.9 - 8.03e9 * 2) // (131072 * 16))
    # One decode token at context 1: memory-bound, the weights over 80 % of 3.35 TB/s, plus 1 ms.
    one = p.step_seconds([(1, 1)])
    assert one == pytest.approx(1e-3 + (8.03e9 * 2 + 2 * 131072) / (3350e9 * 0.8))
    # A 4096-token prefill: compute-bound, 2 FLOPs per parameter per token plus attention's, at 60 % of peak.
    prefill = p.step_seconds([(4096, 4096)])
    flops = 2 * 8.03e9 * 4096 + 4 * 32 * 32 * 128 * 4096 * 4096
    assert prefill == pytest.approx(1e-3 + flops / (989e12 * 0.6))
    # 64 decodes at context 2048: the KV reads add to the weights.
    batch = p.step_seconds([(2048, 1)] * 64)
    assert batch == pytest.approx(1e-3 + (8.03e9 * 2 + 64 * 2049 * 131072) / (3350e9 * 0.8))


def test_profiles_by_path_and_clear_errors(tmp_path: Path) -> None:
    data = json.loads((PROFILES_DIR / "llama-3-8b-h100.json").read_text())
    data["name"] = "custom"
    (tmp_path / "custom.json").write_text(json.dumps(data))
    assert SimulationProfile.load(str(tmp_path / "custom.json")).name == "custom"
    with pytest.raises(ValueError, match="no simulation profile 'nope'.*llama-3-8b-h100"):
        SimulationProfile.load("nope")
    data["sources"] = []
    (tmp_path / "unsourced.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="states no sources"):
        SimulationProfile.load(str(tmp_path / "unsourced.json"))


def test_tokens_are_a_function_of_the_last_token_position_and_seed_and_never_end_a_sequence() -> None:
    avoid = frozenset({2})
    tokens = {simulated_token(prev, pos, seed, 50, avoid) for prev in range(20) for pos in range(20) for seed in (0, 1)}
    assert 2 not in tokens and len(tokens) > 40  # spread over the vocabulary, EOS avoided
    assert simulated_token(7, 11, 3, 50, avoid) == simulated_token(7, 11, 3, 50, avoid)
    run = simulated_continuation([5, 9], 6, 0, 50, avoid)
    assert len(run) == 6 and run[0] == simulated_token(9, 2, 0, 50, avoid)
    assert run[1] == simulated_token(run[0], 3, 0, 50, avoid)
    # A continuation resumed from its middle (a recompute, a takeover) goes on with the same tokens.
    assert simulated_continuation([5, 9, *run[:3]], 3, 0, 50, avoid) == run[3:]

"""The beam-search core (core.beam_search) driven by a tiny model's log-probabilities equals transformers.

No services: each step asks the model for every running beam's next-token
log-probabilities, lets beam_step pick, and keeps the beams as token lists.
The end-to-end test then shows the served path gives the same beams.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from scheduler_service.core.beam_search import BeamParams, Hypothesis, RunningBeam, beam_step, hypothesis_score
from tests.beam_cases import MAX_NEW, BeamCase, beam_case, hf_beams, stop_token_for
from tests.hf_reference import HFReference


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: Path) -> HFReference:
    return HFReference(str(tiny_llama_dir))


def _search(reference: HFReference, case: BeamCase, stop: int) -> list[list[int]]:
    width = case.width
    params = BeamParams(width, case.length_penalty, case.early_stopping, frozenset({stop}), MAX_NEW, 2 * width)
    beams: dict[int, list[int]] = {0: []}
    cumulative = {0: 0.0}
    hypotheses: dict[int, tuple[list[int], float]] = {}
    next_id, generated = 1, 0
    while True:
        running = []
        for seq_id in sorted(beams, key=lambda i: -cumulative[i]):
            with torch.inference_mode():
                logits = reference.model(torch.tensor([case.prompt + beams[seq_id]])).logits[0, -1].float()
            values, tokens = torch.log_softmax(logits, dim=-1).topk(3 * width)
            running.append(RunningBeam(seq_id, cumulative[seq_id], list(zip(tokens.tolist(), values.tolist()))))
        kept = [Hypothesis(i, cum, len(tokens)) for i, (tokens, cum) in hypotheses.items()]
        result = beam_step(params, running, kept, generated)
        for seq_id in result.dropped_hypotheses:
            del hypotheses[seq_id]
        for child in result.finished:
            hypotheses[next_id] = (beams[child.parent_id] + [child.token_id], child.cumulative_logprob)
            next_id += 1
        new_beams, new_cumulative = {}, {}
        for child in result.running:
            new_beams[next_id] = beams[child.parent_id] + [child.token_id]
            new_cumulative[next_id] = child.cumulative_logprob
            next_id += 1
        beams, cumulative = new_beams, new_cumulative
        generated += 1
        if result.done:
            break
    ranked = sorted(hypotheses.values(), key=lambda h: -hypothesis_score(h[1], len(h[0]), case.length_penalty))
    return [tokens for tokens, _ in ranked[: case.n]]


@pytest.mark.parametrize("index", range(6))
def test_beam_step_equals_transformers_beam_search(reference: HFReference, index: int) -> None:
    case = beam_case(index)
    stop = stop_token_for(reference, case)
    assert _search(reference, case, stop) == hf_beams(reference, case, stop)

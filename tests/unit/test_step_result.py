"""The worker's StepResult, built in place: the same message as one built from whole sub-messages."""

from __future__ import annotations

import random

import pytest

from protos import common_pb2, worker_pb2
from worker_service.model_runner import SampledTokenData, StepOutput
from worker_service.prompt_logprobs import PromptLogprobsData
from worker_service.servicer import step_result


def _reference(out: StepOutput) -> worker_pb2.StepResult:
    """The straightforward construction (every sub-message first, then its parent)."""
    return worker_pb2.StepResult(
        step_id=out.step_id,
        execute_seconds=out.execute_seconds,
        sampled=[
            worker_pb2.SampledToken(
                seq_id=s.seq_id, token_id=s.token_id, logprob=s.logprob,
                top_logprobs=[common_pb2.TokenLogprob(token_id=t, logprob=lp) for t, lp in s.top_logprobs],
            )
            for s in out.sampled
        ],
        prompt_logprobs=[
            worker_pb2.PromptLogprobs(
                seq_id=p.seq_id, start=p.start,
                positions=[
                    common_pb2.TokenLogprobs(
                        logprob=lp, top=[common_pb2.TokenLogprob(token_id=t, logprob=tlp) for t, tlp in top],
                        rank=p.ranks[i] if p.ranks else 0)
                    for i, (lp, top) in enumerate(zip(p.logprobs, p.top))
                ],
            )
            for p in out.prompt_logprobs
        ],
    )


def _top(rng: random.Random) -> list[tuple[int, float]]:
    # Some positions without alternatives, some logprobs exactly 0.0 (a default value on the wire).
    return [(rng.randrange(1000), rng.choice([0.0, -rng.random() * 5])) for _ in range(rng.choice([0, 0, 1, 5]))]


@pytest.mark.parametrize("seed", range(20))
def test_step_result_matches_the_reference_construction(seed: int) -> None:
    rng = random.Random(seed)
    sampled = [SampledTokenData(rng.randrange(1 << 40), rng.randrange(50000), rng.choice([0.0, -rng.random()]),
                                _top(rng))
               for _ in range(rng.choice([0, 1, 3, 64]))]
    prompts = []
    for _ in range(rng.choice([0, 0, 1, 2])):
        n = rng.choice([0, 1, 7])
        # Ranks from the model, or none (0 on the wire) as a runner that does not rank leaves them.
        ranks = rng.choice([[], [rng.randrange(1, 50000) for _ in range(n)]])
        prompts.append(PromptLogprobsData(rng.randrange(100), rng.randrange(1, 30),
                                          [-rng.random() for _ in range(n)], [_top(rng) for _ in range(n)], ranks))
    out = StepOutput(rng.randrange(1 << 20), sampled, rng.random(), prompts)

    built, expected = step_result(out), _reference(out)

    assert built == expected
    assert built.SerializeToString(deterministic=True) == expected.SerializeToString(deterministic=True)


def test_an_empty_step_has_only_its_id_and_time() -> None:
    assert step_result(StepOutput(7, [], 0.25)) == worker_pb2.StepResult(step_id=7, execute_seconds=0.25)

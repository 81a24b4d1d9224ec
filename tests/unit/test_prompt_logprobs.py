"""The worker's prompt logprobs on hand-made logits: values, top tokens and vLLM's ranks."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from worker_service.input_builder import PromptLogprobRows, PromptLogprobSpan
from worker_service.prompt_logprobs import compute_prompt_logprobs


def test_ranks_count_every_token_at_least_as_likely() -> None:
    # Rows of logits over a 5-token vocabulary; the hidden states are the logits themselves.
    logits = torch.tensor([
        [4.0, 3.0, 2.0, 1.0, 0.0],  # target 2: two tokens ahead
        [1.0, 1.0, 1.0, 1.0, 5.0],  # target 1: behind one, tied with three others counted ahead (vLLM's >=)
        [0.0, 0.0, 0.0, 0.0, 9.0],  # target 4: the most likely
    ])
    seq = SimpleNamespace(seq_id=7, sampling=SimpleNamespace(prompt_logprobs=1))
    wanted = PromptLogprobRows(rows=torch.tensor([0, 1, 2]), targets=torch.tensor([2, 1, 4]),
                               spans=[PromptLogprobSpan(seq, start=1, count=3)])  # type: ignore[arg-type]
    (out,) = compute_prompt_logprobs(logits, lambda h: h, wanted)
    expected = torch.log_softmax(logits, dim=-1)
    assert (out.seq_id, out.start, out.ranks) == (7, 1, [3, 5, 1])
    assert out.logprobs == [expected[0, 2].item(), expected[1, 1].item(), expected[2, 4].item()]
    assert [[t for t, _ in top] for top in out.top] == [[0], [4], [4]]

"""End to end on the default model (SmolLM2-135M-Instruct), against transformers.

16 prompts of mixed lengths (5 to ~300 tokens), sent concurrently with
temperature 0, must produce exactly the tokens of `generate(do_sample=False)`
(EOS included when the model stops by itself).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from llmserve.client import GenerationClient, make_request
from llmserve.local_cluster import ClusterSpec, LocalCluster
from tests.e2e.cluster_checks import assert_all_blocks_free
from tests.e2e.concurrency import generate_all
from tests.hf_reference import HFReference, compare_greedy

MAX_NEW = 32

_TOPICS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis to a child.",
    "List three prime numbers.",
    "Why is the sky blue?",
    "Translate 'good morning' into Spanish.",
    "What does a compiler do?",
    "Give me a tip for learning to cook.",
]


def _prompts(tokenizer: object) -> list[list[int]]:
    """Chat prompts and long plain-text prompts, 5 to 300 tokens."""
    prompts: list[list[int]] = [tokenizer("Hello, my name is").input_ids]  # type: ignore[operator]
    for topic in _TOPICS:
        text = tokenizer.apply_chat_template(  # type: ignore[attr-defined]
            [{"role": "user", "content": topic}], tokenize=False, add_generation_prompt=True
        )
        prompts.append(tokenizer(text, add_special_tokens=False).input_ids)  # type: ignore[operator]
    paragraph = (
        "The history of computing is a story of abstraction. Early machines were programmed by wiring "
        "panels; later, stored programs let the same hardware run many tasks. "
    )
    for repeats in (1, 2, 3, 4, 6, 8, 9):
        prompts.append(tokenizer(paragraph * repeats + "In summary,").input_ids)  # type: ignore[operator]
    return prompts


@pytest.fixture(scope="module")
def cluster(default_model_dir: Path) -> Iterator[LocalCluster]:
    spec = ClusterSpec(model=str(default_model_dir), worker_args=["--max-model-len", "2048"])
    with LocalCluster(spec) as c:
        yield c


def test_concurrent_greedy_matches_transformers(cluster: LocalCluster, default_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    prompts = _prompts(tokenizer)
    lengths = sorted(len(p) for p in prompts)
    assert len(prompts) == 16 and lengths[0] == 5 and 250 <= lengths[-1] <= 300, lengths
    requests = [make_request(prompt_token_ids=p, max_tokens=MAX_NEW, temperature=0.0) for p in prompts]
    results = generate_all(cluster.address, requests)
    reference = HFReference(str(default_model_dir))
    near_ties = []
    for prompt, result, ref in zip(prompts, results, reference.greedy_many(prompts, MAX_NEW)):
        assert result.error == ""
        cmp = compare_greedy(result.token_ids, ref)
        assert cmp.matched, f"prompt of {len(prompt)} tokens: {cmp.detail}"
        if cmp.near_tie_at is not None:
            near_ties.append(cmp.detail)
        elif result.token_ids[-1] == tokenizer.eos_token_id:
            assert result.finish_reason == "FINISH_REASON_STOP"
        else:
            assert result.finish_reason == "FINISH_REASON_LENGTH"
    print(f"near-ties accepted: {near_ties or 'none'}")
    assert_all_blocks_free(cluster)


def test_chat_answer_is_sensible(cluster: LocalCluster) -> None:
    with GenerationClient(cluster.address) as client:
        out = client.generate(make_request(messages=[("user", "What is the capital of France?")],
                                           max_tokens=32, temperature=0.0))
    assert "Paris" in out.text
    assert out.finish_reason in ("FINISH_REASON_STOP", "FINISH_REASON_LENGTH")

"""Chunked prefill and prefix caching end to end, against transformers.

One cluster runs both features with a small step budget (64 tokens, so long
prompts are prefilled in chunks next to running decodes) and a small KV cache
(preemption under load). Prompts share long prefixes, so later requests reuse
the cached blocks of earlier ones. Greedy outputs must still equal
transformers' token for token, and the Redis stats must show the hits.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmserve.client import make_request
from llmserve.local_cluster import ClusterSpec, LocalCluster
from tests.e2e.cluster_checks import assert_all_blocks_free, redis_state
from tests.e2e.concurrency import generate_all
from tests.hf_reference import HFReference, compare_greedy

MAX_NEW = 16


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir: Path) -> Iterator[LocalCluster]:
    spec = ClusterSpec(
        model=str(tiny_llama_dir),
        worker_args=["--num-gpu-blocks-override", "80", "--max-model-len", "512", "--num-threads", "1"],
        scheduler_args=["--enable-chunked-prefill", "--enable-prefix-caching", "--max-num-batched-tokens", "64"],
    )
    with LocalCluster(spec) as c:
        yield c


def _check(prompts: list[list[int]], results: list, reference: HFReference) -> None:
    for prompt, result, expected in zip(prompts, results, reference.greedy_many(prompts, MAX_NEW, stop_at_eos=False)):
        assert result.error == "" and len(result.token_ids) == MAX_NEW
        cmp = compare_greedy(result.token_ids, expected)
        assert cmp.matched, f"prompt of {len(prompt)} tokens: {cmp.detail}"


def test_shared_prefixes_and_long_prompts_match_transformers(cluster: LocalCluster, tiny_llama_dir: Path) -> None:
    rng = random.Random(11)
    prefixes = [[rng.randrange(3, 40000) for _ in range(n)] for n in (120, 200)]
    prompts = [prefixes[i % 2] + [rng.randrange(3, 40000) for _ in range(rng.randint(1, 40))] for i in range(12)]
    reference = HFReference(str(tiny_llama_dir))

    # Warm the cache with one request per prefix, then send the rest at once.
    warm = [make_request(prompt_token_ids=p, max_tokens=MAX_NEW, ignore_eos=True, temperature=0.0) for p in prompts[:2]]
    _check(prompts[:2], generate_all(cluster.address, warm), reference)
    rest = [make_request(prompt_token_ids=p, max_tokens=MAX_NEW, ignore_eos=True, temperature=0.0) for p in prompts[2:]]
    _check(prompts[2:], generate_all(cluster.address, rest), reference)

    state = redis_state(cluster)
    hit_rate = state["prefix_cache_hits"] / max(1, state["prefix_cache_queries"])
    print(f"prefix cache: {state['prefix_cache_hits']} / {state['prefix_cache_queries']} blocks hit ({hit_rate:.0%})")
    # Each of the 10 later prompts shares 7 or 12 full blocks with a warm one.
    assert state["prefix_cache_hits"] >= 50, state
    assert_all_blocks_free(cluster)


def test_long_prompts_are_chunked_and_match(cluster: LocalCluster, tiny_llama_dir: Path) -> None:
    rng = random.Random(12)
    prompts = [[rng.randrange(3, 40000) for _ in range(n)] for n in (300, 5, 150, 260, 64, 65)]
    reqs = [make_request(prompt_token_ids=p, max_tokens=MAX_NEW, ignore_eos=True, temperature=0.0) for p in prompts]
    _check(prompts, generate_all(cluster.address, reqs), HFReference(str(tiny_llama_dir)))
    assert_all_blocks_free(cluster)

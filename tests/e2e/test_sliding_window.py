"""Sliding-window block reuse end to end: a tiny Mistral whose layers look back 24 tokens.

With chunked prefill and a 32-token step budget each sequence cycles through
a ring of ceil((24 + 32 - 1) / 16) = 4 blocks however long it grows, so eight
sequences of up to 250 tokens (16 blocks each without reuse, 128 in all) run
side by side in a 40-block cache without preemption, and a prompt longer than
the whole cache (700 tokens) is served at all. Greedy outputs must equal
transformers' (whose Mistral applies the same window).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmserve.client import make_request
from llmserve.local_cluster import ClusterSpec, LocalCluster
from tests.e2e.cluster_checks import assert_all_blocks_free, describe_worker, redis_state
from tests.e2e.concurrency import generate_all
from tests.hf_reference import HFReference, compare_greedy
from tests.tiny_models import build_tiny_model

WINDOW = 24
MAX_NEW = 48
NUM_BLOCKS = 40


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-mistral"), default_model_dir, "mistral",
                            sliding_window=WINDOW)


@pytest.fixture(scope="module")
def cluster(mistral_dir: Path) -> Iterator[LocalCluster]:
    spec = ClusterSpec(
        model=str(mistral_dir),
        worker_args=["--num-gpu-blocks-override", str(NUM_BLOCKS), "--max-model-len", "1024", "--num-threads", "1"],
        scheduler_args=["--enable-chunked-prefill", "--max-num-batched-tokens", "32"],
    )
    with LocalCluster(spec) as c:
        yield c


def test_sequences_longer_than_the_window_reuse_their_blocks(cluster: LocalCluster, mistral_dir: Path) -> None:
    assert describe_worker(cluster).sliding_window == WINDOW
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 40000) for _ in range(rng.randint(80, 200))] for _ in range(8)]
    prompts.append([rng.randrange(3, 40000) for _ in range(700)])  # more tokens than the cache has slots
    requests = [make_request(prompt_token_ids=p, max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True) for p in prompts]
    results = generate_all(cluster.address, requests)
    reference = HFReference(str(mistral_dir))
    for prompt, result in zip(prompts, results):
        assert result.error == "" and len(result.token_ids) == MAX_NEW, (len(prompt), result.error)
        cmp = compare_greedy(result.token_ids, reference.greedy(prompt, MAX_NEW, stop_at_eos=False))
        assert cmp.matched, f"prompt of {len(prompt)} tokens: {cmp.detail}"
    # 4 blocks per sequence: everything fit at once, nothing had to be preempted.
    assert redis_state(cluster)["preemptions"] == 0
    assert_all_blocks_free(cluster)

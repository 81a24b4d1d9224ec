"""`llmserve worker --simulate PROFILE`: the real services around a worker without a model.

The scheduler, Redis and the worker's gRPC API, plan validation and sequence bookkeeping are the real
ones; only the forward pass is modelled (worker_service/simulation.py). Every request's tokens are the
continuation the profile's token rule predicts, also for requests that were preempted and recomputed.
"""

from __future__ import annotations

from pathlib import Path

from llmserve.client import make_request
from llmserve.local_cluster import ClusterSpec, LocalCluster
from tests.e2e.cluster_checks import assert_all_blocks_free, describe_worker, redis_state
from tests.e2e.concurrency import generate_all
from worker_service.model_loader import load_config, model_shape
from worker_service.model_runner import eos_token_ids
from worker_service.simulation import simulated_continuation

SEED = 7


def test_simulated_worker_serves_the_predicted_tokens_through_preemption(tiny_llama_dir: Path) -> None:
    config = load_config(str(tiny_llama_dir))
    vocab, eos = model_shape(config).vocab_size, frozenset(eos_token_ids(config, str(tiny_llama_dir)))
    # 8 blocks of 16 tokens; each request needs 20 + 100 = 120 tokens, all 8 blocks by its end: any two that
    # run at once overflow the cache, so the scheduler preempts and recomputes (12 requests sent together,
    # each at least 100 steps long).
    spec = ClusterSpec(
        model=str(tiny_llama_dir),
        worker_args=["--simulate", "llama-3-8b-h100", "--seed", str(SEED), "--num-gpu-blocks-override", "8",
                     "--max-model-len", "256"],
        scheduler_args=["--max-num-seqs", "8"],
    )
    prompts = [[(7 * i + j) % 500 + 10 for j in range(20)] for i in range(12)]
    max_tokens = [100] * 12
    with LocalCluster(spec) as cluster:
        described = describe_worker(cluster)
        assert described.device == "simulated llama-3-8b-h100" and described.num_gpu_blocks == 8
        requests = [make_request(prompt_token_ids=p, max_tokens=m, temperature=0.0) for p, m in zip(prompts, max_tokens)]
        results = generate_all(cluster.address, requests, timeout=300)
        for prompt, limit, result in zip(prompts, max_tokens, results):
            assert result.token_ids == simulated_continuation(prompt, limit, SEED, vocab, eos)
            assert result.finish_reason == "FINISH_REASON_LENGTH"
        assert_all_blocks_free(cluster)
        assert redis_state(cluster)["preemptions"] > 0, "no preemption: the case does not recompute"

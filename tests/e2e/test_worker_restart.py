"""A worker killed mid-generation: its requests are recomputed when it comes back.

The scheduler sees the step fail, requeues every running request with the
outputs already committed, and resets the restarted worker under a new epoch.
Clients stay connected to the scheduler and receive exactly the fault-free
greedy tokens: none lost, none repeated.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import redis

from llmserve.client import GenerationClient, make_request
from llmserve.local_cluster import ClusterSpec, LocalCluster
from scheduler_service import keys
from tests.e2e.cluster_checks import assert_all_blocks_free, redis_state
from tests.e2e.engine_modes import SCHEDULING
from tests.hf_reference import HFReference, compare_greedy

MAX_NEW = 48


@pytest.fixture(scope="module", params=list(SCHEDULING))
def cluster(tiny_llama_dir: Path, request: pytest.FixtureRequest) -> Iterator[LocalCluster]:
    # With async scheduling the step behind the failed one is in flight too: it is cancelled, not landed.
    spec = ClusterSpec(
        model=str(tiny_llama_dir),
        worker_args=["--num-gpu-blocks-override", "128", "--max-model-len", "512", "--num-threads", "1"],
        scheduler_args=["--max-num-seqs", "2", *SCHEDULING[request.param]],
    )
    with LocalCluster(spec) as c:
        yield c


def test_requests_survive_a_worker_sigkill(cluster: LocalCluster, tiny_llama_dir: Path) -> None:
    rng = random.Random(21)
    prompts = [[rng.randrange(3, 40000) for _ in range(rng.randint(5, 80))] for _ in range(6)]
    rds = redis.Redis.from_url(cluster.redis_url)
    reqs = [make_request(request_id=f"wk-{i}", prompt_token_ids=p, max_tokens=MAX_NEW, ignore_eos=True,
                         temperature=0.0) for i, p in enumerate(prompts)]
    with GenerationClient(cluster.address) as client, ThreadPoolExecutor(max_workers=len(reqs)) as pool:
        futures = [pool.submit(client.generate, r, 180) for r in reqs]
        deadline = time.monotonic() + 60
        while rds.llen(keys.seq_tokens(1)) < 5 and not any(f.done() for f in futures):
            assert time.monotonic() < deadline, "generation did not start"
            time.sleep(0.02)
        cluster.kill("worker")
        time.sleep(1.0)  # the scheduler notices and keeps retrying the worker
        cluster.restart("worker")
        results = [f.result() for f in futures]
    rds.close()
    reference = HFReference(str(tiny_llama_dir))
    for result, expected in zip(results, reference.greedy_many(prompts, MAX_NEW, stop_at_eos=False)):
        assert result.error == "" and result.finish_reason == "FINISH_REASON_LENGTH"
        cmp = compare_greedy(result.token_ids, expected)
        assert cmp.matched, cmp.detail
    assert_all_blocks_free(cluster)
    # The steps in flight at the kill failed: counted where an operator looks (the worker's stats hash).
    assert redis_state(cluster)["worker_failures"] >= 1

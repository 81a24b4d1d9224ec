"""A worker whose step hangs (SIGSTOP) past --step-timeout is handled as a failed worker.

The step's deadline expires (DEADLINE_EXCEEDED), the engine loop requeues the running requests
with their committed outputs and resets the worker under a new epoch once it answers again
(SIGCONT). The client's stream just continues: greedy tokens match transformers, none lost or
repeated, and every block is free afterwards. No test hook is needed in the worker.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import redis

from llmserve.client import GenerationClient, make_request
from llmserve.local_cluster import ClusterSpec, LocalCluster
from scheduler_service import keys
from tests.e2e.cluster_checks import assert_all_blocks_free
from tests.hf_reference import HFReference, compare_greedy

MAX_NEW = 40
STEP_TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir: Path) -> Iterator[LocalCluster]:
    spec = ClusterSpec(
        model=str(tiny_llama_dir),
        worker_args=["--num-gpu-blocks-override", "128", "--max-model-len", "512", "--num-threads", "1"],
        scheduler_args=["--max-num-seqs", "2", "--step-timeout", str(STEP_TIMEOUT_S)],
    )
    with LocalCluster(spec) as c:
        yield c


def test_a_hung_step_times_out_and_is_recomputed(cluster: LocalCluster, tiny_llama_dir: Path) -> None:
    prompts = [list(range(200 + 7 * i, 230 + 7 * i)) for i in range(3)]
    rds = redis.Redis.from_url(cluster.redis_url)
    epoch_key = keys.epoch(cluster.worker_address)
    worker_pid = cluster.pid("worker")  # the test freezes the worker process
    reqs = [make_request(prompt_token_ids=p, max_tokens=MAX_NEW, ignore_eos=True, temperature=0.0) for p in prompts]
    try:
        with GenerationClient(cluster.address) as client, ThreadPoolExecutor(max_workers=len(reqs)) as pool:
            futures = [pool.submit(client.generate, r, 180) for r in reqs]
            deadline = time.monotonic() + 60
            while rds.llen(keys.seq_tokens(1)) < 5:
                assert time.monotonic() < deadline and not any(f.done() for f in futures), "generation did not start"
                time.sleep(0.01)
            epoch = int(rds.get(epoch_key) or 0)
            os.kill(worker_pid, signal.SIGSTOP)
            stopped = time.monotonic()
            # The step deadline passes; the engine loop takes a new epoch before it resets the worker.
            while int(rds.get(epoch_key) or 0) == epoch:
                assert time.monotonic() - stopped < STEP_TIMEOUT_S + 20, "the hung step was never timed out"
                time.sleep(0.05)
            assert time.monotonic() - stopped >= STEP_TIMEOUT_S * 0.9
            os.kill(worker_pid, signal.SIGCONT)
            results = [f.result() for f in futures]
    finally:
        os.kill(worker_pid, signal.SIGCONT)
        rds.close()
    assert "DEADLINE_EXCEEDED" in cluster.tail("scheduler", 200)
    reference = HFReference(str(tiny_llama_dir))
    for result, expected in zip(results, reference.greedy_many(prompts, MAX_NEW, stop_at_eos=False)):
        assert result.error == "" and result.finish_reason == "FINISH_REASON_LENGTH", result
        cmp = compare_greedy(result.token_ids, expected)
        assert cmp.matched, cmp.detail
    assert_all_blocks_free(cluster)

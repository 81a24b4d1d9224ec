"""Backpressure: a bounded queue per worker; the excess gets RESOURCE_EXHAUSTED at once, nothing leaks.

The queue holds requests admitted but not yet scheduled (inbox + waiting), counted in Redis at
admission and when the engine loop first schedules (or finishes) a request. A stopped worker
(SIGSTOP) freezes scheduling, which makes the queue's content exact for the test.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import redis

from llmserve.client import Completion, GenerationClient, make_request
from llmserve.local_cluster import ClusterSpec, LocalCluster
from scheduler_service import keys
from tests.e2e.cluster_checks import assert_all_blocks_free

MAX_QUEUED = 3
MAX_QUEUED_TOKENS = 100
MAX_NEW = 24


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir: Path) -> Iterator[LocalCluster]:
    spec = ClusterSpec(
        model=str(tiny_llama_dir),
        # A long heartbeat TTL: the frozen worker must stay registered (else requests meet UNAVAILABLE,
        # no routable worker, instead of the full queue) however long a loaded machine takes.
        worker_args=["--num-gpu-blocks-override", "128", "--max-model-len", "512", "--num-threads", "1",
                     "--heartbeat-ttl", "60"],
        scheduler_args=["--max-num-seqs", "1", "--max-num-queued-requests", str(MAX_QUEUED),
                        "--max-queued-tokens", str(MAX_QUEUED_TOKENS), "--step-timeout", "60"],
    )
    with LocalCluster(spec) as c:
        yield c


def _queue(cluster: LocalCluster) -> tuple[int, int]:
    client = redis.Redis.from_url(cluster.redis_url)
    raw = client.hgetall(keys.queue(cluster.worker_address))
    client.close()
    return int(raw.get(b"requests", 0)), int(raw.get(b"tokens", 0))


def _running(cluster: LocalCluster) -> int:
    client = redis.Redis.from_url(cluster.redis_url)
    n = client.llen(keys.running(cluster.worker_address))
    client.close()
    return int(n)


def _wait(predicate: object, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _rejected(client: GenerationClient, prompt_len: int) -> grpc.RpcError:
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        client.generate(make_request(prompt_token_ids=[11] * prompt_len, max_tokens=4), timeout=10)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value
    assert time.monotonic() - started < 2.0, "the refusal must come at once, not after queueing"
    return info.value


def test_full_queue_refuses_at_once_by_count_and_by_tokens(cluster: LocalCluster) -> None:
    worker_pid = cluster.pid("worker")  # the test freezes the worker process
    assert _queue(cluster) == (0, 0)
    os.kill(worker_pid, signal.SIGSTOP)
    try:
        with GenerationClient(cluster.address) as client, ThreadPoolExecutor(max_workers=4) as pool:
            def submit(prompt_len: int) -> object:
                return pool.submit(client.generate, make_request(
                    prompt_token_ids=list(range(100, 100 + prompt_len)), max_tokens=MAX_NEW, ignore_eos=True,
                    temperature=0.0), 120)

            # A is scheduled (its step hangs on the stopped worker): it no longer counts as queued.
            futures = [submit(40)]
            _wait(lambda: _queue(cluster) == (0, 0) and _running(cluster) == 1, "the first request to be scheduled")
            futures.append(submit(30))
            futures.append(submit(60))
            _wait(lambda: _queue(cluster) == (2, 90), "two queued requests")
            # 90 + 20 tokens > 100: refused by the token bound while only 2 of 3 slots are used.
            err = _rejected(client, 20)
            assert "--max-queued-tokens" in err.details() and "retry" in err.details(), err.details()
            futures.append(submit(10))
            _wait(lambda: _queue(cluster) == (3, 100), "three queued requests")
            err = _rejected(client, 1)
            assert "3 requests are already queued" in err.details(), err.details()
            assert "--max-num-queued-requests" in err.details() and "retry" in err.details(), err.details()
            os.kill(worker_pid, signal.SIGCONT)
            results: list[Completion] = [f.result() for f in futures]  # type: ignore[attr-defined]
    finally:
        os.kill(worker_pid, signal.SIGCONT)
    assert all(r.error == "" and len(r.token_ids) == MAX_NEW for r in results), results
    assert _queue(cluster) == (0, 0)
    assert_all_blocks_free(cluster)


def test_a_flood_of_ten_times_the_bound(cluster: LocalCluster) -> None:
    """30 concurrent requests against a bound of 3: the excess is refused, the rest complete, the server stays up."""
    def run(i: int) -> str:
        try:
            r = client.generate(make_request(prompt_token_ids=[20 + i] * 8, max_tokens=MAX_NEW, ignore_eos=True,
                                             temperature=0.0), timeout=120)
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and exc.details(), exc
            return "refused"
        assert r.error == "" and len(r.token_ids) == MAX_NEW, r
        return "completed"

    with GenerationClient(cluster.address) as client, ThreadPoolExecutor(max_workers=30) as pool:
        outcomes = list(pool.map(run, range(10 * MAX_QUEUED)))
        assert outcomes.count("refused") > 0 and outcomes.count("completed") >= MAX_QUEUED, outcomes
        # Still healthy: a request after the flood is served.
        again = client.generate(make_request(prompt="after the flood", max_tokens=4, ignore_eos=True), timeout=60)
        assert len(again.token_ids) == 4
    assert _queue(cluster) == (0, 0)
    assert_all_blocks_free(cluster)

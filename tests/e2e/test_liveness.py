"""Liveness measures forward progress, readiness whether a replica can admit (grpc.health.v1 names).

A frozen worker (SIGSTOP) under load stalls the scheduler's engine loop: with a liveness timeout
shorter than the step timeout, the scheduler's "liveness" turns NOT_SERVING while its "readiness"
stays SERVING (Redis answers, the worker is still registered), and both are SERVING again once the
worker resumes (SIGCONT) and the requests complete. An idle cluster stays live however long it
idles. A draining worker is live but not ready, and so is a scheduler whose only worker drains.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmserve.client import GenerationClient, make_request
from llmserve.local_cluster import ClusterSpec, LocalCluster
from protos import generation_pb2
from shared.health_probes import LIVENESS, READINESS
from tests.e2e.concurrency import Streams

LIVENESS_TIMEOUT_S = 3.0
# Far longer than the freeze: the loop must be flagged by liveness, not rescued by the step timeout.
STEP_TIMEOUT_S = 60.0
MAX_NEW = 40
# Prompt (30 tokens) + output fill the worker's --max-model-len of 1024.
DRAIN_TOKENS = 990
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir: Path) -> Iterator[LocalCluster]:
    spec = ClusterSpec(
        model=str(tiny_llama_dir),
        # A long heartbeat TTL: the frozen worker stays registered, so the scheduler stays ready. A drain
        # as long as the requests need: the default 30 s ran out on a loaded machine, and an only worker that
        # stops before its requests end leaves them nowhere to go.
        worker_args=["--num-gpu-blocks-override", "160", "--max-model-len", "1024", "--num-threads", "1",
                     "--heartbeat-ttl", "60", "--drain-timeout", "600"],
        scheduler_args=["--max-num-seqs", "2", "--step-timeout", str(STEP_TIMEOUT_S),
                        "--liveness-timeout", str(LIVENESS_TIMEOUT_S)],
    )
    with LocalCluster(spec) as c:
        yield c


def statuses(address: str, names: tuple[str, ...] = (LIVENESS, READINESS, "")) -> dict[str, int]:
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return {n: stub.Check(health_pb2.HealthCheckRequest(service=n), timeout=5).status for n in names}


def wait_for(address: str, name: str, status: int, within_s: float) -> float:
    """Seconds until `name` reports `status` at `address`; fails after `within_s`."""
    start = time.monotonic()
    while statuses(address, (name,))[name] != status:
        assert time.monotonic() - start < within_s, f"{address} {name!r} never became {status}"
        time.sleep(0.1)
    return time.monotonic() - start


def greedy(prompts: list[list[int]], max_tokens: int) -> list[generation_pb2.GenerateRequest]:
    return [make_request(prompt_token_ids=p, max_tokens=max_tokens, ignore_eos=True, temperature=0.0) for p in prompts]


def test_an_idle_cluster_stays_live(cluster: LocalCluster) -> None:
    deadline = time.monotonic() + LIVENESS_TIMEOUT_S + 1.5
    while time.monotonic() < deadline:
        for address in (cluster.address, cluster.worker_address):
            assert statuses(address) == {LIVENESS: SERVING, READINESS: SERVING, "": SERVING}, address
        time.sleep(0.5)


def test_a_frozen_worker_makes_the_scheduler_unlive_but_still_ready(cluster: LocalCluster) -> None:
    worker_pid = cluster.pid("worker")  # the test freezes the worker process
    prompts = [list(range(300 + 7 * i, 330 + 7 * i)) for i in range(3)]
    try:
        with GenerationClient(cluster.address) as client:
            streams = Streams(client, greedy(prompts, MAX_NEW))
            streams.wait_started(60)
            os.kill(worker_pid, signal.SIGSTOP)
            stopped = time.monotonic()
            wait_for(cluster.address, LIVENESS, NOT_SERVING, LIVENESS_TIMEOUT_S + 10)
            assert time.monotonic() - stopped >= LIVENESS_TIMEOUT_S * 0.9, "flagged before the liveness timeout"
            # Not live, yet ready: Redis answers and the worker is still registered.
            assert statuses(cluster.address) == {LIVENESS: NOT_SERVING, READINESS: SERVING, "": SERVING}
            os.kill(worker_pid, signal.SIGCONT)
            wait_for(cluster.address, LIVENESS, SERVING, 10)
            streams.join(60)
    finally:
        os.kill(worker_pid, signal.SIGCONT)
    assert streams.finish == ["FINISH_REASON_LENGTH"] * 3 and all(len(t) == MAX_NEW for t in streams.tokens)
    log = cluster.tail("scheduler", 400)
    assert "no longer live" in log and "completed no step" in log
    assert "DEADLINE_EXCEEDED" not in log, "the step timeout, not liveness, ended the freeze"
    assert statuses(cluster.address) == {LIVENESS: SERVING, READINESS: SERVING, "": SERVING}


def test_a_draining_worker_is_live_but_not_ready(cluster: LocalCluster) -> None:
    """Last in the module: the worker drains and exits (the fixture's stop copes with that)."""
    worker = cluster._procs["worker"]  # noqa: SLF001
    # Two requests as long as the model allows: the drain must outlast the checks below (about a
    # second of health polling) however fast the worker decodes.
    with GenerationClient(cluster.address) as client:
        streams = Streams(client, greedy([list(range(100, 130)), list(range(200, 230))], DRAIN_TOKENS))
        streams.wait_started(60)
        worker.send_signal(signal.SIGTERM)
        # The running request keeps the drain going: the worker is live but takes no new work...
        wait_for(cluster.worker_address, READINESS, NOT_SERVING, 5)
        assert statuses(cluster.worker_address, (LIVENESS, "")) == {LIVENESS: SERVING, "": NOT_SERVING}
        # ...and the scheduler, whose only worker drains, cannot admit: live but not ready.
        wait_for(cluster.address, READINESS, NOT_SERVING, 5)
        assert statuses(cluster.address, (LIVENESS,)) == {LIVENESS: SERVING}
        assert all(streams.tokens) and not any(streams.finish), "the requests ended before the checks: nothing observed"
        streams.join(120)
    assert streams.finish == ["FINISH_REASON_LENGTH"] * 2 and all(len(t) == DRAIN_TOKENS for t in streams.tokens)
    worker.wait(30)

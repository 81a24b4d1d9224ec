"""Faults under load on the manifests' processes: a worker, a scheduler replica, Redis.

Each test runs 2 scheduler replicas, 2 workers and Redis from the rendered cpu overlay (see
manifest_cluster.py), streams greedy requests through both replicas (each client may fall back to
the other replica), injects one fault while tokens flow, and checks that every request completes
with exactly transformers' greedy tokens: nothing lost, nothing repeated. Each run adds a row to
the fault table (LLMSERVE_FAULT_TABLE, written by `make faults` to docs/faults.md):

    fault | requests | completed | tokens lost | time to recover

"time to recover" is the longest pause any client saw between two tokens from the fault on (the gap
that spans the fault included): how long the fault held generation up.
"""

from __future__ import annotations

import os
import random
import re
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis

from llmserve.client import GenerationClient, make_request
from protos import common_pb2
from scheduler_service import keys
from scheduler_service.router import RouteCandidate, choose
from tests.e2e.manifest_cluster import ManifestCluster
from tests.e2e.test_manifests_local import OVERRIDES, lease_owners, start, wait_for
from tests.hf_reference import HFReference, compare_greedy

MAX_NEW = 40
# The drain test's requests: long enough that those waiting on the draining worker are still waiting
# when the scheduler learns of the drain (at its next tick, up to a second later).
DRAIN_NEW = 300
# Long enough that streams on a stopped replica can outlive its 2 s grace (half the time on a 2-core machine).
STOP_NEW = 300
NUM_REQUESTS = 8
# Test knobs on top of the manifests: faster fault detection than production's defaults.
FAULT_OVERRIDES = {
    "worker": {**OVERRIDES["worker"], "LLMSERVE_HEARTBEAT_TTL": "3"},
    "scheduler": {**OVERRIDES["scheduler"], "LLMSERVE_LEASE_TTL": "4"},
}


@dataclass
class Tracked:
    """One streamed request: when each token arrived, what arrived, how it ended."""

    prompt: list[int]
    arrivals: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    finish_reason: str = ""
    error: str = ""

    def longest_pause_from(self, t: float) -> float:
        """The longest gap between consecutive token arrivals that ends after t."""
        gaps = [b - a for a, b in zip(self.arrivals, self.arrivals[1:]) if b > t]
        return max(gaps, default=0.0)


def consume(client: GenerationClient, request_id: str, tracked: Tracked, max_new: int) -> None:
    request = make_request(request_id=request_id, prompt_token_ids=tracked.prompt, max_tokens=max_new,
                           ignore_eos=True, temperature=0.0)
    for msg in client.stream(request, timeout=240):
        now = time.monotonic()
        for delta in msg.outputs:
            tracked.arrivals.extend([now] * len(delta.token_ids))
            tracked.tokens.extend(delta.token_ids)
            if delta.finish_reason:
                tracked.finish_reason = common_pb2.FinishReason.Name(delta.finish_reason)
        tracked.error = msg.error or tracked.error


@dataclass(frozen=True)
class FaultRow:
    fault: str
    requests: int
    completed: int
    tokens_lost: int
    recover_s: float

    def markdown(self) -> str:
        return (f"| {self.fault} | {self.requests} | {self.completed} | {self.tokens_lost} | "
                f"{self.recover_s:.1f} s |")


def record(row: FaultRow) -> None:
    """Prints the row and appends it to the fault table when LLMSERVE_FAULT_TABLE names one."""
    print(f"\n{row.markdown()}")
    path = os.environ.get("LLMSERVE_FAULT_TABLE")
    if path:
        table = Path(path)
        if not table.exists():
            table.write_text("| fault | requests | completed | tokens lost | time to recover |\n"
                             "|---|---|---|---|---|\n")
        with table.open("a") as f:
            f.write(row.markdown() + "\n")


@pytest.fixture()
def cluster(tiny_llama_dir: Path, tmp_path: Path) -> Iterator[ManifestCluster]:
    c = start(tiny_llama_dir, tmp_path, FAULT_OVERRIDES)
    yield c
    c.stop()


def run_with_fault(cluster: ManifestCluster, tiny_llama_dir: Path, fault: str, inject: Callable[[], None],
                   seed: int, num_requests: int = NUM_REQUESTS, max_new: int = MAX_NEW) -> FaultRow:
    """Streams num_requests greedy requests, injects the fault once tokens flow, checks and records the outcome."""
    rng = random.Random(seed)
    tracked = [Tracked([rng.randrange(3, 40000) for _ in range(rng.randint(4, 60))]) for _ in range(num_requests)]
    replicas = [cluster.pods[f"scheduler-{i}"].address for i in range(2)]
    clients = [GenerationClient(replicas[i], fallback_addresses=[replicas[1 - i]]) for i in range(2)]
    try:
        with ThreadPoolExecutor(max_workers=num_requests) as pool:
            futures = [pool.submit(consume, clients[i % 2], f"{fault.split()[0]}-{i}", t, max_new)
                       for i, t in enumerate(tracked)]
            wait_for(lambda: sum(len(t.tokens) >= 3 for t in tracked) >= NUM_REQUESTS // 2, 120, "tokens flow")
            t0 = time.monotonic()
            running = [t for t in tracked if len(t.tokens) < max_new]
            assert running, "every request finished before the fault: it would test nothing"
            inject()
            for f in futures:
                f.result()
    finally:
        for c in clients:
            c.close()
    reference = HFReference(str(tiny_llama_dir))
    lost = 0
    for t, expected in zip(tracked, reference.greedy_many([t.prompt for t in tracked], max_new, stop_at_eos=False)):
        cmp = compare_greedy(t.tokens, expected)
        assert t.error == "" and t.finish_reason == "FINISH_REASON_LENGTH", (fault, t.error, t.finish_reason)
        assert cmp.matched, (fault, cmp.detail)
        lost += max(0, len(expected.token_ids) - len(t.tokens))
    row = FaultRow(fault, len(tracked), sum(t.finish_reason == "FINISH_REASON_LENGTH" for t in tracked), lost,
                   max((t.longest_pause_from(t0) for t in running), default=0.0))
    record(row)
    return row


def test_a_worker_sigkilled_under_load_hands_its_requests_to_the_other_worker(
        cluster: ManifestCluster, tiny_llama_dir: Path) -> None:
    ttl = float(FAULT_OVERRIDES["worker"]["LLMSERVE_HEARTBEAT_TTL"])
    row = run_with_fault(cluster, tiny_llama_dir, "worker SIGKILL (not restarted)",
                         lambda: cluster.kill("worker-0"), seed=31)
    assert row.completed == row.requests and row.tokens_lost == 0
    # Detected by the expired heartbeat, then recomputed on worker-1.
    assert row.recover_s < ttl + 15, row
    client = redis.Redis.from_url(cluster.redis_url)
    try:
        dead = cluster.pods["worker-0"].address
        assert client.hget("llmserve:workers", dead) is None, "the dead worker is forgotten"
        # With its engine state and queues (in the same step as its registration).
        assert client.exists(*keys.worker_state(dead)) == 0, [k for k in keys.worker_state(dead) if client.exists(k)]
    finally:
        client.close()


def request_id_routed_to(worker: str, workers: list[str], prefix: str) -> str:
    """A request id that the router's tie-break sends to `worker` when every worker has the same load."""
    candidates = [RouteCandidate(w, 0) for w in workers]
    return next(f"{prefix}-{i}" for i in range(1000) if choose(candidates, f"{prefix}-{i}") == worker)


@pytest.fixture()
def slow_heartbeat_cluster(tiny_llama_dir: Path, tmp_path: Path) -> Iterator[ManifestCluster]:
    """The fault cluster with a 6 s heartbeat TTL: seconds in which a dead worker still counts as alive."""
    c = start(tiny_llama_dir, tmp_path,
              {**FAULT_OVERRIDES, "worker": {**FAULT_OVERRIDES["worker"], "LLMSERVE_HEARTBEAT_TTL": "6"}})
    yield c
    c.stop()


def test_a_request_queued_for_a_worker_that_just_died_is_handed_over_too(
        slow_heartbeat_cluster: ManifestCluster, tiny_llama_dir: Path) -> None:
    """The routers learn of a dead worker only when its heartbeat expires: until then admission still
    queues requests for it. Its engine loop, retrying the worker meanwhile, must hand those over as well
    as the ones it was running, not only drop them from the queue on its last commit."""
    cluster = slow_heartbeat_cluster
    dead, other = (cluster.pods[f"worker-{i}"].address for i in range(2))
    replicas = [cluster.pods[f"scheduler-{i}"].address for i in range(2)]
    state = redis.Redis.from_url(cluster.redis_url)
    clients = [GenerationClient(replicas[i], fallback_addresses=[replicas[1 - i]]) for i in range(2)]
    rng = random.Random(35)
    tracked: dict[str, Tracked] = {}
    lengths: dict[str, int] = {}

    def send(pool: ThreadPoolExecutor, request_id: str, max_new: int) -> Future[None]:
        tracked[request_id] = Tracked([rng.randrange(3, 40000) for _ in range(rng.randint(4, 40))])
        lengths[request_id] = max_new
        future = pool.submit(consume, clients[len(tracked) % 2], request_id, tracked[request_id], max_new)
        wait_for(lambda: state.exists(keys.request(request_id)), 30, f"{request_id} admitted")
        return future

    def scheduler_logs() -> str:
        return "".join(cluster.pods[f"scheduler-{i}"].log.read_text(errors="replace") for i in range(2))

    try:
        with ThreadPoolExecutor(max_workers=3) as pool:
            # One long request on each worker (the second goes to the idle one), so both carry the same load.
            futures = [send(pool, request_id_routed_to(dead, [dead, other], "long-a"), 400),
                       send(pool, "long-b", 400)]
            assert [state.hget(keys.request(r), "worker").decode() for r in tracked] == [dead, other]
            wait_for(lambda: all(len(t.tokens) >= 3 for t in tracked.values()), 60, "both long requests stream")
            cluster.kill("worker-0")
            wait_for(lambda: f"worker {dead} failed a step" in scheduler_logs(), 30, "its loop saw the failure")
            # Equal loads: the tie-break sends this one to the dead worker, whose heartbeat has not expired yet.
            late = request_id_routed_to(dead, [dead, other], "late")
            futures.append(send(pool, late, MAX_NEW))
            assert state.hget(keys.request(late), "worker").decode() == dead, "queued for the dead worker"
            for f in futures:
                f.result()
        reference = HFReference(str(tiny_llama_dir))
        for request_id, t in tracked.items():
            assert t.error == "" and t.finish_reason == "FINISH_REASON_LENGTH", (request_id, t.error, t.finish_reason)
            cmp = compare_greedy(t.tokens, reference.greedy(t.prompt, lengths[request_id], stop_at_eos=False))
            assert cmp.matched, (request_id, cmp.detail)
        assert state.llen(keys.inbox(dead)) == 0 and state.scard(keys.live(dead)) == 0, "nothing is left on it"
    finally:
        state.close()
        for c in clients:
            c.close()


def test_a_worker_drained_under_load_finishes_its_running_requests_and_hands_over_the_waiting(
        cluster: ManifestCluster, tiny_llama_dir: Path) -> None:
    """SIGTERM (what Kubernetes sends on scale-in or a rolling update) to a worker with a queue.

    Three times the requests the two engine loops run at once, so that the worker has requests
    running and requests waiting when the drain starts. The running ones finish where their KV
    cache is, the waiting ones move to the other worker, then the owner marks the worker drained
    and it leaves the registry and exits cleanly, well before its drain timeout.
    """
    per_loop = int(FAULT_OVERRIDES["scheduler"]["LLMSERVE_MAX_NUM_SEQS"])
    worker = cluster.pods["worker-0"]

    def drain() -> None:
        client = redis.Redis.from_url(cluster.redis_url)
        try:
            wait_for(lambda: client.llen(keys.waiting(worker.address)) > 0, 30, "worker-0 has a queue")
        finally:
            client.close()
        worker.proc.terminate()

    row = run_with_fault(cluster, tiny_llama_dir, "worker drain (SIGTERM) with a queue",
                         drain, seed=34, num_requests=6 * per_loop, max_new=DRAIN_NEW)
    assert row.completed == row.requests and row.tokens_lost == 0
    assert worker.proc.wait(timeout=30) == 0, worker.tail()
    log = worker.log.read_text(errors="replace")
    assert "drained" in log and "drain timed out" not in log, worker.tail()
    handed = [int(n) for i in range(2) for n in re.findall(
        rf"worker {re.escape(worker.address)} drains: handed (\d+) request",
        cluster.pods[f"scheduler-{i}"].log.read_text(errors="replace"))]
    assert sum(handed) > 0, "the draining worker's waiting requests moved to the other worker"
    client = redis.Redis.from_url(cluster.redis_url)
    try:
        assert client.hget("llmserve:workers", worker.address) is None, "the drained worker deregistered"
    finally:
        client.close()


def test_a_scheduler_replica_sigkilled_under_load_loses_nothing(cluster: ManifestCluster, tiny_llama_dir: Path) -> None:
    owners = {cluster.replica_id(f"scheduler-{i}"): f"scheduler-{i}" for i in range(2)}
    wait_for(lambda: set(lease_owners(cluster, ["worker-0", "worker-1"]).values()) == set(owners), 30,
             "each replica owns one worker's loop")
    victim = owners[lease_owners(cluster, ["worker-0"])["worker-0"]]
    ttl = float(FAULT_OVERRIDES["scheduler"]["LLMSERVE_LEASE_TTL"])
    row = run_with_fault(cluster, tiny_llama_dir, "scheduler replica SIGKILL (lease owner)",
                         lambda: cluster.kill(victim), seed=32)
    assert row.completed == row.requests and row.tokens_lost == 0
    assert row.recover_s < ttl + 10, row


def test_a_scheduler_replica_stopped_under_load_loses_nothing(cluster: ManifestCluster, tiny_llama_dir: Path) -> None:
    # A rolling update: the lease owner gets SIGTERM. Its loop stops and gives its lease back, which the other
    # replica takes, while it serves its streams for a 2 s grace; streams outliving it end with UNAVAILABLE,
    # their requests kept (not aborted) and resumed by their clients on the other replica. Whether any does
    # depends on this machine's speed: tests/e2e/test_stream_resume.py makes that case certain.
    owners = {cluster.replica_id(f"scheduler-{i}"): f"scheduler-{i}" for i in range(2)}
    wait_for(lambda: set(lease_owners(cluster, ["worker-0", "worker-1"]).values()) == set(owners), 30,
             "each replica owns one worker's loop")
    victim = owners[lease_owners(cluster, ["worker-0"])["worker-0"]]
    row = run_with_fault(cluster, tiny_llama_dir, "scheduler replica SIGTERM (lease owner, rolling update)",
                         lambda: cluster.terminate(victim), seed=35, max_new=STOP_NEW)
    assert row.completed == row.requests and row.tokens_lost == 0


def test_a_redis_restart_under_load_loses_nothing(cluster: ManifestCluster, tiny_llama_dir: Path) -> None:
    downtime: list[float] = []
    row = run_with_fault(cluster, tiny_llama_dir, "Redis restart (SIGTERM, AOF kept)",
                         lambda: downtime.append(cluster.restart_redis()), seed=33)
    print(f"Redis was down {downtime[0]:.2f}s")
    assert row.completed == row.requests and row.tokens_lost == 0
    assert row.recover_s < 30, row


def test_admission_fails_fast_while_redis_is_down(cluster: ManifestCluster) -> None:
    import grpc

    cluster.stop_redis()
    try:
        with GenerationClient(cluster.pods["scheduler-0"].address, resume=None) as client:
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as refused:
                client.generate(make_request(prompt_token_ids=[5, 6, 7], max_tokens=4), timeout=30)
            took = time.monotonic() - started
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value
        assert "state store is unavailable" in refused.value.details()
        assert took < 6, f"refused after {took:.1f}s"
    finally:
        cluster.start_redis_again()

"""The cpu overlay's manifests, run on localhost: 2 scheduler replicas, 2 (then 3) workers, Redis.

Every process is started with its container's command, arguments and environment from the rendered
manifests (see tests/e2e/manifest_cluster.py for the only mappings: cluster DNS and ports to local
ones, the models volume to a tiny test model). The replicas find the workers in Redis, split their
engine loops through leases, and route requests over both workers.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from shared.omp import usable_cpus
from llmserve.client import GenerationClient, make_request
from scheduler_service import keys
from scheduler_service.leases import lease_key
from tests.e2e.manifest_cluster import ManifestCluster
from tests.hf_reference import HFReference, compare_greedy

MAX_NEW = 24
# Three one-thread workers, two replicas, Redis and the test's clients: a core for each worker and
# room for the rest, so that the third worker's throughput is not taken from the other two.
MIN_CPUS_FOR_GAIN = 6
# The least part of an even share of the sampled tokens a worker that joined under load must take (routing is
# least loaded: 49-50 % of two workers' tokens, 31-32 % of three workers', idle or beside other test runs).
MIN_PART_OF_EVEN_SHARE = 0.5
# Test knobs on top of the manifests: a tiny model's limits, a small KV cache, one thread per worker
# (two cores run all five processes), and small batches so that one worker's capacity is reached.
OVERRIDES = {
    "worker": {"LLMSERVE_MAX_MODEL_LEN": "512", "LLMSERVE_NUM_GPU_BLOCKS_OVERRIDE": "256",
               "LLMSERVE_NUM_THREADS": "1"},
    "scheduler": {"LLMSERVE_MAX_MODEL_LEN": "512", "LLMSERVE_MAX_NUM_SEQS": "4"},
}


def start(tiny_llama_dir: Path, workdir: Path, overrides: dict[str, dict[str, str]] = OVERRIDES,
          num_workers: int = 2) -> ManifestCluster:
    cluster = ManifestCluster("cpu", tiny_llama_dir, workdir, overrides)
    try:
        cluster.start_redis()
        for i in range(num_workers):
            cluster.start_worker(i)
        for i in range(2):
            cluster.start_scheduler(i)
        for name in [*(f"worker-{i}" for i in range(num_workers)), "scheduler-0", "scheduler-1"]:
            cluster.wait_serving(name)
        # A replica is ready with one routable worker; tests that route on equal loads need every worker
        # registered and driven (a lease is taken in the supervisor tick that registration wakes on every
        # replica, so the routers have seen it too).
        workers = [f"worker-{i}" for i in range(num_workers)]
        wait_for(lambda: all(lease_owners(cluster, workers).values()), 120, "every worker leased")
    except BaseException:
        cluster.stop()
        raise
    return cluster


@pytest.fixture()
def cluster(tiny_llama_dir: Path, tmp_path: Path) -> Iterator[ManifestCluster]:
    c = start(tiny_llama_dir, tmp_path)
    yield c
    c.stop()


def lease_owners(cluster: ManifestCluster, worker_pods: list[str]) -> dict[str, str]:
    client = redis.Redis.from_url(cluster.redis_url)
    try:
        owners = {}
        for pod in worker_pods:
            value = client.get(lease_key(cluster.pods[pod].address))
            owners[pod] = value.decode() if value else ""
        return owners
    finally:
        client.close()


def wait_for(condition, timeout_s: float, what: str, interval_s: float = 0.05) -> float:  # noqa: ANN001
    """Polls until condition() is truthy; returns the seconds it took."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout_s:
            raise AssertionError(f"{what}: not within {timeout_s}s")
        time.sleep(interval_s)
    return time.monotonic() - started


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 40000) for _ in range(rng.randint(4, 60))] for _ in range(n)]


def test_two_replicas_share_two_workers_and_answer_correctly(cluster: ManifestCluster, tiny_llama_dir: Path) -> None:
    schedulers = [cluster.replica_id(f"scheduler-{i}") for i in range(2)]
    # Fair share: each replica holds the lease of one worker.
    wait_for(lambda: sorted(lease_owners(cluster, ["worker-0", "worker-1"]).values()) == sorted(schedulers), 30,
             "each replica owns one worker's loop")
    batch = prompts(16, seed=8)
    reqs = [make_request(request_id=f"mf-{i}", prompt_token_ids=p, max_tokens=MAX_NEW, ignore_eos=True,
                         temperature=0.0)
            for i, p in enumerate(batch)]
    clients = [GenerationClient(cluster.pods[f"scheduler-{i}"].address) for i in range(2)]
    try:
        with ThreadPoolExecutor(max_workers=len(reqs)) as pool:
            # Alternate the replicas, as the Service's load balancing would.
            results = list(pool.map(lambda ir: clients[ir[0] % 2].generate(ir[1], 120), enumerate(reqs)))
    finally:
        for c in clients:
            c.close()
    reference = HFReference(str(tiny_llama_dir))
    for result, expected in zip(results, reference.greedy_many(batch, MAX_NEW, stop_at_eos=False)):
        assert result.error == "" and result.finish_reason == "FINISH_REASON_LENGTH", result
        cmp = compare_greedy(result.token_ids, expected)
        assert cmp.matched, cmp.detail
    # Least-loaded routing used both workers.
    sampled = {w: cluster.pods[w].metric("llmserve:worker_sampled_tokens_total") for w in ("worker-0", "worker-1")}
    assert all(n > 0 for n in sampled.values()), sampled
    assert sum(sampled.values()) >= len(reqs) * MAX_NEW


@dataclass(frozen=True)
class ScaleOut:
    """Output tokens/s and the most sequences running at once, before and after a worker joined."""

    rate_before: float
    peak_before: int
    rate_after: float
    peak_after: int
    failures: list[str]
    idle_cores_before: float  # cores the machine left idle (/proc/stat) before the worker joined
    new_worker_share: float  # the added worker's part of the tokens all workers sampled after it joined

    def report(self, before: str, after: str) -> str:
        return (f"under load: {before} {self.rate_before:.1f} output tokens/s, at most {self.peak_before} "
                f"sequences running; {after} {self.rate_after:.1f} tokens/s "
                f"({self.rate_after / self.rate_before:.2f}x), at most {self.peak_after} running, "
                f"{self.new_worker_share:.0%} of the tokens sampled by the new worker; "
                f"{self.idle_cores_before:.2f} cores idle before")


def _cpu_times() -> tuple[int, int]:
    """(idle, total) jiffies of all the machine's cores, from /proc/stat (idle counts iowait)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return fields[3] + fields[4], sum(fields)


def _cores() -> int:
    return sum(1 for line in Path("/proc/stat").read_text().splitlines() if line[:3] == "cpu" and line[3:4].isdigit())


def add_worker_under_load(cluster: ManifestCluster, ordinal: int, num_clients: int = 16,
                          length_s: float = 10.0) -> ScaleOut:
    """Clients loop on both replicas; measures a window, starts worker-<ordinal>, measures again.

    The second window starts once a replica holds the new worker's lease and the worker has
    sampled a token, so it measures the cluster after the scale-out, not during it.
    """
    stop = threading.Event()
    done: list[tuple[float, int]] = []  # (finish time, output tokens)
    failures: list[str] = []
    running: list[tuple[float, int]] = []  # (time, sequences running on all workers)
    lock = threading.Lock()

    def client_loop(index: int) -> None:
        with GenerationClient(cluster.pods[f"scheduler-{index % 2}"].address) as client:
            n = 0
            while not stop.is_set():
                prompt = prompts(1, seed=1000 * index + n)[0]
                n += 1
                result = client.generate(make_request(prompt_token_ids=prompt, max_tokens=16, ignore_eos=True), 120)
                with lock:
                    if result.error or len(result.token_ids) != 16:
                        failures.append(result.error or f"{len(result.token_ids)} tokens")
                    done.append((time.monotonic(), len(result.token_ids)))

    def sample_running() -> None:
        client = redis.Redis.from_url(cluster.redis_url)
        while not stop.is_set():
            workers = [p.address for name, p in list(cluster.pods.items()) if name.startswith("worker")]
            total = sum(client.llen(keys.running(w)) for w in workers)
            with lock:
                running.append((time.monotonic(), total))
            time.sleep(0.1)
        client.close()

    def window(since: float, until: float) -> tuple[float, int]:
        with lock:
            return (sum(n for t, n in done if since <= t < until) / (until - since),
                    max((r for t, r in running if since <= t < until), default=0))

    with ThreadPoolExecutor(max_workers=num_clients + 1) as pool:
        loops = [pool.submit(client_loop, i) for i in range(num_clients)]
        sampler = pool.submit(sample_running)
        try:
            time.sleep(3.0)  # warm-up: every worker busy
            a0, (idle0, total0) = time.monotonic(), _cpu_times()
            time.sleep(length_s)
            rate_before, peak_before = window(a0, a0 + length_s)
            idle1, total1 = _cpu_times()
            idle_cores = (idle1 - idle0) / max(1, total1 - total0) * _cores()
            name = f"worker-{ordinal}"
            cluster.start_worker(ordinal)
            added = cluster.pods[name]
            wait_for(lambda: lease_owners(cluster, [name])[name] != "", 120,
                     "a replica took the new worker's lease", interval_s=0.2)
            wait_for(lambda: added.metric("llmserve:worker_sampled_tokens_total") > 0, 60,
                     "the new worker gets requests", interval_s=0.2)
            workers = sorted(n for n in cluster.pods if n.startswith("worker"))
            sampled0 = [cluster.pods[w].metric("llmserve:worker_sampled_tokens_total") for w in workers]
            b0 = time.monotonic()
            time.sleep(length_s)
            rate_after, peak_after = window(b0, b0 + length_s)
            sampled = [cluster.pods[w].metric("llmserve:worker_sampled_tokens_total") - s0
                       for w, s0 in zip(workers, sampled0)]
            share = sampled[workers.index(name)] / max(1.0, sum(sampled))
        finally:
            stop.set()
            for f in [*loops, sampler]:
                f.result()
    return ScaleOut(rate_before, peak_before, rate_after, peak_after, failures, idle_cores, share)


def test_a_second_worker_added_under_load_takes_its_share(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """Scale-out from one worker: 2 replicas on one worker, then a second joins under load.

    Capacity is what a worker adds: the sequences running at once go past one engine loop's limit, and
    least-loaded routing gives the new worker its part of the work (at least half of an even share of
    the tokens sampled after it joined), with no failed request.

    Whether output tokens/s rises is a property of the machine, not of the code: where the new worker
    has a core of its own it did (1.57-1.59x on an idle 2-core machine, 1.14-1.41x on a 2-core Zen 5
    whose speed drifts between minutes), but a CI machine whose two cores showed 0.43 idle measured
    0.98x, and beside a second test suite none is idle (1.00x). The test prints the ratio; a throughput
    bound here would be a timed assertion on a shared machine.
    """
    per_loop = int(OVERRIDES["scheduler"]["LLMSERVE_MAX_NUM_SEQS"])
    cluster = start(tiny_llama_dir, tmp_path, num_workers=1)
    try:
        result = add_worker_under_load(cluster, ordinal=1)
    finally:
        cluster.stop()
    print("\n" + result.report("1 worker", "2 workers"))
    assert not result.failures, result.failures[:5]
    assert result.peak_before <= per_loop < result.peak_after, (result.peak_before, result.peak_after)
    assert result.new_worker_share >= MIN_PART_OF_EVEN_SHARE / 2, result


def test_a_third_worker_added_under_load_takes_work_without_a_failed_request(cluster: ManifestCluster) -> None:
    """Scale-out under load: the new worker registers, a replica takes its lease, routing sends it work.

    Capacity is what a worker adds: each engine loop runs at most LLMSERVE_MAX_NUM_SEQS sequences, so
    the sequences running at once must go past two workers' worth. Throughput (output tokens/s) can
    only rise where the third worker has a core of its own: each worker runs one thread, and two
    workers, two replicas, Redis and the clients already fill two cores (measured here: 0.97-1.07x).
    With at least MIN_CPUS_FOR_GAIN cores the test asserts a gain (the scale-out this test is for);
    with fewer it prints the ratio only.
    """
    per_loop = int(OVERRIDES["scheduler"]["LLMSERVE_MAX_NUM_SEQS"])
    result = add_worker_under_load(cluster, ordinal=2)
    print("\n" + result.report("2 workers", "3 workers"))
    assert not result.failures, result.failures[:5]
    assert result.peak_before <= 2 * per_loop < result.peak_after, (result.peak_before, result.peak_after)
    assert result.new_worker_share >= MIN_PART_OF_EVEN_SHARE / 3, result
    if usable_cpus() >= MIN_CPUS_FOR_GAIN:
        assert result.rate_after > 1.2 * result.rate_before, result


def test_killing_the_lease_owner_moves_the_loop_within_the_ttl_and_loses_nothing(cluster: ManifestCluster, tiny_llama_dir: Path) -> None:
    ttl = float(cluster.pods["scheduler-0"].env["LLMSERVE_LEASE_TTL"])
    schedulers = {f"scheduler-{i}": cluster.replica_id(f"scheduler-{i}") for i in range(2)}
    wait_for(lambda: sorted(lease_owners(cluster, ["worker-0", "worker-1"]).values()) == sorted(schedulers.values()),
             30, "each replica owns one worker's loop")
    victim = next(pod for pod, rid in schedulers.items() if lease_owners(cluster, ["worker-0"])["worker-0"] == rid)
    survivor = next(pod for pod in schedulers if pod != victim)
    batch = prompts(8, seed=9)
    max_new = 40
    reqs = [make_request(request_id=f"kill-{i}", prompt_token_ids=p, max_tokens=max_new, ignore_eos=True,
                         temperature=0.0)
            for i, p in enumerate(batch)]
    rds = redis.Redis.from_url(cluster.redis_url)
    # Half the clients stream from the replica about to die: their streams re-attach to the survivor.
    on_victim = GenerationClient(cluster.pods[victim].address, fallback_addresses=[cluster.pods[survivor].address])
    on_survivor = GenerationClient(cluster.pods[survivor].address)
    with on_victim, on_survivor, ThreadPoolExecutor(max_workers=len(reqs)) as pool:
        futures = [pool.submit((on_victim if i % 2 else on_survivor).generate, r, 180) for i, r in enumerate(reqs)]
        wait_for(lambda: rds.exists("llmserve:seq:1:tokens") and rds.llen("llmserve:seq:1:tokens") >= 3, 60,
                 "generation started")
        killed_at = time.monotonic()
        cluster.kill(victim)
        # What is left of the lease, read once its owner is dead and can no longer renew it.
        lease_left_s = rds.pttl(lease_key(cluster.pods["worker-0"].address)) / 1000
        took = wait_for(lambda: lease_owners(cluster, ["worker-0"])["worker-0"] == schedulers[survivor], ttl + 5,
                        "the surviving replica took worker-0's lease")
        results = [f.result() for f in futures]
    rds.close()
    print(f"\nlease of worker-0 moved {took:.2f}s after the SIGKILL of its owner (TTL {ttl:.0f}s); "
          f"all requests done {time.monotonic() - killed_at:.1f}s after it")
    # The lease expires within the TTL; the survivor takes it at its next tick (every second).
    assert 0 < lease_left_s <= ttl
    assert took <= lease_left_s + 1.5, f"takeover took {took:.2f}s, the lease had {lease_left_s:.2f}s left"
    reference = HFReference(str(tiny_llama_dir))
    for result, expected in zip(results, reference.greedy_many(batch, max_new, stop_at_eos=False)):
        assert result.error == "" and result.finish_reason == "FINISH_REASON_LENGTH", result
        cmp = compare_greedy(result.token_ids, expected)
        assert cmp.matched, cmp.detail


def test_a_replica_added_under_load_gets_a_worker(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """Scale-out of schedulers under steady load: no loop falls idle, so the busy replica gives one back.

    The new owner recomputes that worker's running requests from Redis; every request still completes
    with transformers' greedy tokens.
    """
    overrides = {"worker": OVERRIDES["worker"], "scheduler": {**OVERRIDES["scheduler"], "LLMSERVE_LEASE_TTL": "2"}}
    cluster = ManifestCluster("cpu", tiny_llama_dir, tmp_path, overrides)
    stop = threading.Event()
    results: list[tuple[list[int], object]] = []
    try:
        cluster.start_redis()
        for i in range(2):
            cluster.start_worker(i)
        cluster.start_scheduler(0)
        cluster.wait_serving("scheduler-0")
        first = cluster.replica_id("scheduler-0")
        wait_for(lambda: set(lease_owners(cluster, ["worker-0", "worker-1"]).values()) == {first}, 30,
                 "the only replica owns both workers")

        def client_loop(index: int) -> None:
            with GenerationClient(cluster.pods["scheduler-0"].address) as client:
                n = 0
                while not stop.is_set():
                    prompt = prompts(1, seed=5000 + 100 * index + n)[0]
                    n += 1
                    result = client.generate(make_request(prompt_token_ids=prompt, max_tokens=16, ignore_eos=True,
                                                          temperature=0.0), 120)
                    results.append((prompt, result))

        with ThreadPoolExecutor(max_workers=8) as pool:
            loops = [pool.submit(client_loop, i) for i in range(8)]
            time.sleep(2.0)
            cluster.start_scheduler(1)
            cluster.wait_serving("scheduler-1")
            second = cluster.replica_id("scheduler-1")
            took = wait_for(lambda: sorted(lease_owners(cluster, ["worker-0", "worker-1"]).values())
                            == sorted([first, second]), 60, "the new replica took one worker", interval_s=0.2)
            time.sleep(2.0)
            stop.set()
            for f in loops:
                f.result()
        print(f"\nthe added replica owned a worker {took:.1f}s after it was serving, under load")
    finally:
        stop.set()
        cluster.stop()
    reference = HFReference(str(tiny_llama_dir))
    assert len(results) > 16
    expected = reference.greedy_many([prompt for prompt, _ in results], 16, stop_at_eos=False)
    for (_, result), ref in zip(results, expected):
        assert result.error == "" and result.finish_reason == "FINISH_REASON_LENGTH", result
        cmp = compare_greedy(result.token_ids, ref)
        assert cmp.matched, cmp.detail

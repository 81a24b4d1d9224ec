"""A replica that owns a busy worker is SIGKILLed: the standby replica continues on the worker's KV cache.

The worker's lease moves to the standby once it expires; the standby rebuilds the scheduler from Redis
(queues, block tables with their prefix-cache hashes, computed counts, swapped tables), fences the worker
without dropping its cache, lands the step the dead replica did not, and goes on. The worker counts every
token computed again for a sequence whose KV it still held: there must be none. Every stream must end
with transformers' greedy tokens, and generation must pause for about the lease TTL only. Every engine
loop (tests/e2e/engine_modes.py): the async one's commits also hold a step counted as run and not landed.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import redis

from llmserve.client import GenerationClient, make_request
from llmserve.local_cluster import ClusterSpec, LocalCluster
from protos import generation_pb2
from scheduler_service import keys
from tests.e2e.cluster_checks import (
    assert_all_blocks_free,
    committed_stream,
    describe_worker,
    start_standby_scheduler,
    wait_for,
)
from tests.e2e.engine_modes import SCHEDULING
from tests.hf_reference import HFReference, compare_greedy

LEASE_TTL_S = 2
MAX_NEW = 160
NUM_GROUPS = 7
SCHEDULER_ARGS = ["--enable-prefix-caching", "--max-num-seqs", "16", "--max-num-batched-tokens", "1024",
                  "--lease-ttl", str(LEASE_TTL_S)]


@pytest.fixture(scope="module", params=list(SCHEDULING))
def cluster(request: pytest.FixtureRequest, tiny_llama_dir: Path) -> Iterator[LocalCluster]:
    spec = ClusterSpec(
        model=str(tiny_llama_dir),
        # 120 blocks of 16 tokens hold four of the seven groups to the end: the others are swapped out
        # (2 MB of swap space is ~130 blocks of the tiny model).
        worker_args=["--num-gpu-blocks-override", "120", "--swap-space", "0.002", "--max-model-len", "1024",
                     "--num-threads", "1"],
        scheduler_args=[*SCHEDULER_ARGS, *SCHEDULING[request.param]],
    )
    with LocalCluster(spec) as c:
        yield c


def _send(address: str, req: generation_pb2.GenerateRequest) -> None:
    """A client whose stream dies with its replica; its request lives on in Redis."""

    def send() -> None:
        with GenerationClient(address, resume=None) as client:
            try:
                for _ in client.stream(req, timeout=300):
                    pass
            except grpc.RpcError:
                pass

    threading.Thread(target=send, daemon=True).start()


def test_the_standby_replica_continues_on_the_workers_cache(cluster: LocalCluster, tiny_llama_dir: Path,
                                                             tmp_path: Path) -> None:
    rng = random.Random(16)
    prefix = [rng.randrange(3, 40000) for _ in range(160)]
    prompts = [prefix + [rng.randrange(3, 40000) for _ in range(rng.randint(40, 80))] for _ in range(NUM_GROUPS)]
    ids = [f"takeover-{i}" for i in range(NUM_GROUPS)]
    # Two sequences per request (parallel sampling: they fork from one prefill and are swapped out together);
    # top_k=1 makes both greedy (temperature 0 refuses n > 1).
    requests = [make_request(request_id=rid, prompt_token_ids=p, max_tokens=MAX_NEW, ignore_eos=True,
                             temperature=1.0, top_k=1, n=2) for rid, p in zip(ids, prompts)]
    rds = redis.Redis.from_url(cluster.redis_url)
    w = cluster.worker_address
    standby_log = tmp_path / "standby.log"
    standby, _ = start_standby_scheduler(cluster, standby_log)
    try:
        # The first request computes the shared prefix; the others then hit its blocks.
        _send(cluster.address, requests[0])
        wait_for(lambda: committed_stream(rds, ids[0])[0], 60, "the first request produced no token")
        for req in requests[1:]:
            _send(cluster.address, req)

        def busy() -> bool:
            # Eight sequences running with hundreds of tokens each, some swapped out.
            running = rds.lrange(keys.running(w), 0, -1)
            outputs = [len(t) for r in running for t in committed_stream(rds, r.decode())[0].values()]
            return len(running) >= 4 and rds.llen(keys.swapped(w)) > 0 and min(outputs, default=0) >= 20

        wait_for(busy, 120, "the worker never ran four groups with others swapped out")
        cluster.kill("scheduler")
        killed = time.monotonic()
        # A busy async loop commits with a step in flight, which the standby lands first; a multi-step loop
        # does when its call holds several steps (not while groups are swapped out: tests/integration/
        # test_resume_paths.py takes both of its stop points for certain); the sync loop never does.
        inflight = rds.hexists(keys.engine(w), keys.ENGINE_INFLIGHT)
        if "--async-scheduling" in cluster.spec.scheduler_args:
            assert inflight
        elif "--num-scheduler-steps" not in cluster.spec.scheduler_args:
            assert not inflight
        at_kill = {rid: sum(len(t) for t in committed_stream(rds, rid)[0].values()) for rid in ids}
        stats = {k.decode(): int(v) for k, v in rds.hgetall(keys.stats(w)).items()}
        running, swapped = rds.llen(keys.running(w)), rds.llen(keys.swapped(w))
        assert running >= 4 and swapped >= 1, (running, swapped)
        assert stats.get("prefix_cache_hits", 0) > 0, stats
        assert any(n < 2 * MAX_NEW for n in at_kill.values()), at_kill

        # Generation resumes when the lease moves: the first new token of any request.
        wait_for(lambda: sum(sum(len(t) for t in committed_stream(rds, r)[0].values()) for r in ids) > sum(at_kill.values()),
              LEASE_TTL_S + 60, "no token after the kill")
        pause = time.monotonic() - killed
        wait_for(lambda: all(committed_stream(rds, rid)[1] for rid in ids), 240, "the requests did not finish")

        reference = HFReference(str(tiny_llama_dir))
        for rid, expected in zip(ids, reference.greedy_many(prompts, MAX_NEW, stop_at_eos=False)):
            outputs, _ = committed_stream(rds, rid)
            for index in (0, 1):
                cmp = compare_greedy(outputs[index], expected)
                assert cmp.matched, f"{rid}[{index}] ({at_kill[rid]} tokens at the kill): {cmp.detail}"
        log = standby_log.read_text(errors="replace")
        owned = [line for line in log.splitlines() if "on its KV cache" in line]
        assert owned and "on its KV cache, 0 recomputed" in owned[0], log[-3000:]
        print(owned[0])
        assert describe_worker(cluster).num_recomputed_tokens == 0
        print(f"paused {pause:.2f}s (lease TTL {LEASE_TTL_S}s); at the kill: {running} running, {swapped} swapped, "
              f"{stats.get('prefix_cache_hits')} prefix-cache hits")
        assert pause < LEASE_TTL_S + 10, pause
        rds.close()
    finally:
        standby.kill()
        standby.wait()
    cluster.restart("scheduler")
    assert_all_blocks_free(cluster)

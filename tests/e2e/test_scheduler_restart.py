"""The scheduler is stateless: a new scheduler process continues from the state in Redis.

Requests are admitted, the scheduler is SIGKILLed mid-generation, a new one is
started with the same command line. It rebuilds the queues from Redis, resets
the worker (new fencing epoch) and recomputes the running sequences from their
prompts and committed outputs. Each request's output stream in Redis must end
up holding exactly the fault-free greedy tokens: none lost, none repeated.
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
from tests.e2e.cluster_checks import assert_all_blocks_free
from tests.hf_reference import HFReference, compare_greedy

MAX_NEW = 40


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir: Path) -> Iterator[LocalCluster]:
    spec = ClusterSpec(
        model=str(tiny_llama_dir),
        worker_args=["--num-gpu-blocks-override", "128", "--max-model-len", "512", "--num-threads", "1"],
        # One sequence at a time makes the generation slow enough to kill the scheduler mid-way.
        scheduler_args=["--max-num-seqs", "2"],
    )
    with LocalCluster(spec) as c:
        yield c


def _stream_tokens(client: redis.Redis, request_id: str) -> tuple[list[int], bool]:
    tokens: list[int] = []
    finished = False
    for _entry_id, fields in client.xrange(keys.output_stream(request_id)):
        msg = generation_pb2.GenerateResponse.FromString(fields[b"m"])
        for delta in msg.outputs:
            tokens.extend(delta.token_ids)
        finished |= msg.HasField("usage")
    return tokens, finished


def test_a_new_scheduler_continues_from_redis(cluster: LocalCluster, tiny_llama_dir: Path) -> None:
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 40000) for _ in range(rng.randint(5, 80))] for _ in range(6)]
    ids = [f"restart-{i}" for i in range(len(prompts))]
    rds = redis.Redis.from_url(cluster.redis_url)

    # Clients whose streams die with the scheduler; their requests live on in Redis.
    def send(i: int) -> None:
        req = make_request(request_id=ids[i], prompt_token_ids=prompts[i], max_tokens=MAX_NEW,
                           ignore_eos=True, temperature=0.0)
        with GenerationClient(cluster.address) as client:
            try:
                for _ in client.stream(req, timeout=120):
                    pass
            except grpc.RpcError:
                pass

    threads = [threading.Thread(target=send, args=(i,), daemon=True) for i in range(len(prompts))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    # Kill once every request is admitted (recorded in Redis) and the first has a few tokens.
    while not (all(rds.exists(keys.request(r)) or rds.exists(keys.output_stream(r)) for r in ids)
               and len(_stream_tokens(rds, ids[0])[0]) >= 5):
        assert time.monotonic() < deadline, "generation did not start"
        time.sleep(0.02)
    cluster.kill("scheduler")
    partial = {rid: len(_stream_tokens(rds, rid)[0]) for rid in ids}
    assert any(0 < n < MAX_NEW for n in partial.values()), partial  # killed mid-generation

    cluster.restart("scheduler")
    deadline = time.monotonic() + 120
    while not all(_stream_tokens(rds, rid)[1] for rid in ids):
        assert time.monotonic() < deadline, {rid: (len(t), f) for rid, (t, f) in ((r, _stream_tokens(rds, r)) for r in ids)}
        time.sleep(0.2)

    reference = HFReference(str(tiny_llama_dir))
    for rid, prompt in zip(ids, prompts):
        tokens, _ = _stream_tokens(rds, rid)
        assert len(tokens) == MAX_NEW, (rid, partial[rid], len(tokens))
        cmp = compare_greedy(tokens, reference.greedy(prompt, MAX_NEW, stop_at_eos=False))
        assert cmp.matched, f"{rid} (had {partial[rid]} tokens at the kill): {cmp.detail}"
    rds.close()
    assert_all_blocks_free(cluster)

"""Redis losing its data (restarted without persistence, or a failover to a replica that missed writes).

Everything in Redis is gone, the fencing epoch counter included, while the worker remembers the newest
epoch it has accepted and refuses anything older. The engine loop must take an epoch above the worker's
at once, not count up from 0 one refused Reset a second at a time (a worker that has had many owners
would be refused for as many seconds), and serving goes on with the same greedy tokens.
"""

from __future__ import annotations

import re
from pathlib import Path

import grpc
import redis

from llmserve.client import GenerationClient, make_request
from llmserve.local_cluster import ClusterSpec, LocalCluster
from protos import worker_pb2, worker_pb2_grpc

# The epochs a long-lived worker has seen: one per takeover, reset and rolling update of the schedulers.
PAST_OWNERS = 1000


def _greedy(client: GenerationClient) -> list[int]:
    tokens: list[int] = []
    # Deadline: seconds on an idle machine (lease TTL + a heartbeat); counting up to the worker's epoch one
    # refused Reset a second would take PAST_OWNERS seconds.
    for msg in client.stream(make_request(prompt="The history of the city", max_tokens=12, ignore_eos=True,
                                          temperature=0), timeout=180):
        for delta in msg.outputs:
            tokens.extend(delta.token_ids)
    return tokens


def test_serving_goes_on_after_redis_loses_its_data(tiny_llama_dir: Path) -> None:
    spec = ClusterSpec(model=str(tiny_llama_dir),
                       worker_args=["--num-gpu-blocks-override", "64", "--max-model-len", "256", "--num-threads", "1"],
                       scheduler_args=["--lease-ttl", "3"])
    with LocalCluster(spec) as cluster, GenerationClient(cluster.address) as client:
        before = _greedy(client)
        with grpc.insecure_channel(cluster.worker_address) as channel:
            worker = worker_pb2_grpc.WorkerStub(channel)
            seen = worker.Describe(worker_pb2.DescribeRequest()).epoch
            # The worker's history of owners, in one fence-only Reset (what each takeover sends).
            worker.Reset(worker_pb2.ResetRequest(epoch=seen + PAST_OWNERS, keep_cache=True))
            redis.Redis.from_url(cluster.redis_url).flushall()

            assert _greedy(client) == before
            assert worker.Describe(worker_pb2.DescribeRequest()).epoch > seen + PAST_OWNERS
        owned = [int(e) for e in re.findall(r"engine loop for worker \S+ owns epoch (\d+)",
                                           cluster.log_path("scheduler").read_text())]
        assert owned[-1] > seen + PAST_OWNERS

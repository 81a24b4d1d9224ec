"""Assertions about a running cluster's state (every KV block free, nothing left behind), and a standby replica."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import redis

from llmserve.local_cluster import LocalCluster
from protos import generation_pb2, worker_pb2, worker_pb2_grpc
from scheduler_service import keys
from shared.redis_server import free_port


def wait_for(condition: Callable[[], object], timeout_s: float, what: str) -> None:
    """Polls `condition` until it is true; fails with `what` after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def start_standby_scheduler(cluster: LocalCluster, log: Path) -> tuple[subprocess.Popen, str]:
    """A second scheduler replica on the cluster's Redis, with its scheduler flags: (process, address), listening."""
    port = free_port()
    cmd = [sys.executable, "-m", "llmserve", "scheduler", "--model", cluster.spec.model, "--host", "127.0.0.1",
           "--port", str(port), "--redis-url", cluster.redis_url, *cluster.spec.scheduler_args]
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))

    def listening() -> bool:
        assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0

    wait_for(listening, 120, "the standby replica did not start")
    return proc, f"127.0.0.1:{port}"


def describe_worker(cluster: LocalCluster) -> worker_pb2.WorkerDescription:
    with grpc.insecure_channel(cluster.worker_address) as channel:
        return worker_pb2_grpc.WorkerStub(channel).Describe(worker_pb2.DescribeRequest(), timeout=10)


def committed_stream(client: redis.Redis, request_id: str) -> tuple[dict[int, list[int]], bool]:
    """The tokens of each sequence (by index) in the request's output stream in Redis, and whether its final
    message is there: what any client reading the stream gets."""
    tokens: dict[int, list[int]] = {}
    finished = False
    for _entry_id, fields in client.xrange(keys.output_stream(request_id)):
        msg = generation_pb2.GenerateResponse.FromString(fields[b"m"])
        for delta in msg.outputs:
            tokens.setdefault(delta.index, []).extend(delta.token_ids)
        finished |= msg.HasField("usage")
    return tokens, finished


def redis_state(cluster: LocalCluster) -> dict[str, object]:
    """The parts of the Redis state that must be empty when no request is live."""
    client = redis.Redis.from_url(cluster.redis_url)
    w = cluster.worker_address
    stats = {k.decode(): int(v) for k, v in client.hgetall(keys.stats(w)).items()}
    blocks = {k: v for k, v in stats.items() if k in ("free", "total")}
    state = {
        "seq_keys": sorted(k.decode() for k in client.scan_iter(f"{keys.PREFIX}:seq:*")),
        "request_keys": sorted(k.decode() for k in client.scan_iter(f"{keys.PREFIX}:req:*")),
        "waiting": client.llen(keys.waiting(w)),
        "running": client.llen(keys.running(w)),
        "swapped": client.llen(keys.swapped(w)),
        "inbox": client.llen(keys.inbox(w)),
        # Sequence states and token counts the engine loop stored for a new owner (state_journal.py): none once idle.
        "seq_states": client.hlen(keys.seq_states(w)),
        "seq_progress": client.hlen(keys.seq_progress(w)),
        "blocks": blocks,
        "preemptions": stats.get("preemptions", 0),
        "swaps": stats.get("swaps", 0),
        "worker_failures": stats.get("worker_failures", 0),
        "prefix_cache_queries": stats.get("prefix_cache_queries", 0),
        "prefix_cache_hits": stats.get("prefix_cache_hits", 0),
    }
    client.close()
    return state


def wait_until_idle(cluster: LocalCluster, timeout_s: float = 20.0) -> tuple[dict[str, object], worker_pb2.WorkerDescription]:
    """Waits for the engine loop's cleanup commit and plan, then returns both views of the state."""
    deadline = time.monotonic() + timeout_s
    while True:
        state = redis_state(cluster)
        desc = describe_worker(cluster)
        blocks = state["blocks"]
        idle = (
            not state["seq_keys"] and not state["request_keys"] and not state["waiting"] and not state["running"] and not state["swapped"]
            and not state["seq_states"] and not state["seq_progress"]
            and isinstance(blocks, dict) and blocks.get("free") == blocks.get("total")
            and desc.num_cached_sequences == 0 and desc.num_used_blocks == 0
        )
        if idle or time.monotonic() > deadline:
            return state, desc
        time.sleep(0.2)


def assert_all_blocks_free(cluster: LocalCluster) -> None:
    state, desc = wait_until_idle(cluster)
    assert state["seq_keys"] == [], state
    assert state["request_keys"] == [], state
    assert state["waiting"] == 0 and state["running"] == 0 and state["swapped"] == 0 and state["inbox"] == 0, state
    assert state["seq_states"] == 0 and state["seq_progress"] == 0, state
    assert state["blocks"] == {"free": desc.num_gpu_blocks, "total": desc.num_gpu_blocks}, state
    assert desc.num_cached_sequences == 0, desc
    assert desc.num_used_blocks == 0, desc

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


def _send_in_background(cluster: LocalCluster, req: generation_pb2.GenerateRequest) -> None:
    """A client whose stream dies with the scheduler; its request lives on in Redis."""

    def send() -> None:
        with GenerationClient(cluster.address) as client:
            try:
                for _ in client.stream(req, timeout=120):
                    pass
            except grpc.RpcError:
                pass

    threading.Thread(target=send, daemon=True).start()


def test_a_running_service_is_not_started_twice(cluster: LocalCluster) -> None:
    # A second scheduler process would be untracked: it would outlive the cluster's stop().
    with pytest.raises(RuntimeError, match="the scheduler is still running: kill or terminate it"):
        cluster.restart("scheduler")


def test_a_new_scheduler_continues_from_redis(cluster: LocalCluster, tiny_llama_dir: Path) -> None:
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 40000) for _ in range(rng.randint(5, 80))] for _ in range(6)]
    ids = [f"restart-{i}" for i in range(len(prompts))]
    rds = redis.Redis.from_url(cluster.redis_url)

    for rid, prompt in zip(ids, prompts):
        _send_in_background(cluster, make_request(request_id=rid, prompt_token_ids=prompt, max_tokens=MAX_NEW,
                                                  ignore_eos=True, temperature=0.0))
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
    for rid, expected in zip(ids, reference.greedy_many(prompts, MAX_NEW, stop_at_eos=False)):
        tokens, _ = _stream_tokens(rds, rid)
        assert len(tokens) == MAX_NEW, (rid, partial[rid], len(tokens))
        cmp = compare_greedy(tokens, expected)
        assert cmp.matched, f"{rid} (had {partial[rid]} tokens at the kill): {cmp.detail}"
    rds.close()
    assert_all_blocks_free(cluster)


def test_a_beam_search_continues_after_a_scheduler_restart(cluster: LocalCluster, tiny_llama_dir: Path) -> None:
    """Beams, hypotheses and their cumulative logprobs live in Redis: the search ends as transformers' does."""
    prompt = list(range(2000, 2033))
    rid = "restart-beams"
    rds = redis.Redis.from_url(cluster.redis_url)
    req = make_request(request_id=rid, prompt_token_ids=prompt, max_tokens=MAX_NEW, temperature=0.0,
                       ignore_eos=True, stop_token_ids=[0], use_beam_search=True, best_of=2, n=2)
    _send_in_background(cluster, req)
    deadline = time.monotonic() + 60

    def beam_lengths() -> list[int]:
        fields = rds.hkeys(keys.request(rid))
        seq_ids = [int(f[len(b"cum:"):]) for f in fields if f.startswith(b"cum:")]
        return [rds.llen(keys.seq_tokens(s)) for s in seq_ids]

    # Kill once two beams have a few tokens each.
    while not (len(lengths := beam_lengths()) >= 2 and min(lengths) >= 4):
        assert time.monotonic() < deadline, "beam search did not start"
        time.sleep(0.01)
    cluster.kill("scheduler")
    at_kill = beam_lengths()
    assert at_kill and max(at_kill) < MAX_NEW, at_kill
    cluster.restart("scheduler")
    deadline = time.monotonic() + 120
    while not _stream_tokens(rds, rid)[1]:
        assert time.monotonic() < deadline, "the beam search did not finish after the restart"
        time.sleep(0.2)
    outputs: dict[int, list[int]] = {}
    for _entry_id, fields in rds.xrange(keys.output_stream(rid)):
        for delta in generation_pb2.GenerateResponse.FromString(fields[b"m"]).outputs:
            outputs.setdefault(delta.index, []).extend(delta.token_ids)
    reference = HFReference(str(tiny_llama_dir))
    expected = reference.beam_search(prompt, MAX_NEW, 2, 2, eos_token_ids=[0])
    assert [outputs[i] for i in sorted(outputs)] == expected, f"beam lengths at the kill: {at_kill}"
    rds.close()
    assert_all_blocks_free(cluster)

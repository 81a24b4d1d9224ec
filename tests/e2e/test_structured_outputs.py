"""50 generations constrained by JSON schemas, on the default model, through the services: every one parses
and validates, while the KV cache is too small for them all (preemption by swap and recompute) and the
scheduler replica that owns the worker is SIGKILLed mid-generation (a standby replica takes the worker over
on its cache and the clients re-attach to it).

The worker's grammar matchers are rebuilt from each sequence's tokens whenever the worker learns a sequence
again (recompute, takeover): a matcher that started over would expect a new document and break the JSON.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest
import redis

from llmserve.client import GenerationClient, make_request
from llmserve.local_cluster import ClusterSpec, LocalCluster
from protos import common_pb2, generation_pb2
from scheduler_service import keys
from tests.e2e.cluster_checks import assert_all_blocks_free, start_standby_scheduler, wait_for

LEASE_TTL_S = 2
# Bounded strings, enums, integer ranges, arrays, nested objects, patterns: each finishes well within
# MAX_TOKENS (the longest seen is ~120 tokens), so a generation that does not parse is the grammar's fault.
SCHEMAS = [
    ("Describe a person.", {
        "type": "object", "additionalProperties": False, "required": ["name", "age"],
        "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0,
                                                                           "maximum": 120}}}),
    ("Describe a city.", {
        "type": "object", "additionalProperties": False, "required": ["city", "country", "population"],
        "properties": {"city": {"type": "string", "maxLength": 24}, "country": {"type": "string", "maxLength": 24},
                       "population": {"type": "integer", "minimum": 0, "maximum": 100000000}}}),
    ("Describe a book.", {
        "type": "object", "additionalProperties": False, "required": ["title", "tags", "in_print"],
        "properties": {"title": {"type": "string", "maxLength": 32}, "in_print": {"type": "boolean"},
                       "tags": {"type": "array", "minItems": 1, "maxItems": 3,
                                "items": {"enum": ["fiction", "science", "history", "poetry"]}}}}),
    ("Rate this review: 'I loved it'.", {
        "type": "object", "additionalProperties": False, "required": ["sentiment", "confidence"],
        "properties": {"sentiment": {"enum": ["positive", "negative", "neutral"]},
                       "confidence": {"type": "integer", "minimum": 0, "maximum": 100}}}),
    ("Write an order for two items.", {
        "type": "object", "additionalProperties": False, "required": ["order_id", "items", "address"],
        "properties": {
            "order_id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
            "items": {"type": "array", "maxItems": 3, "items": {
                "type": "object", "additionalProperties": False, "required": ["sku", "qty"],
                "properties": {"sku": {"type": "string", "maxLength": 12},
                               "qty": {"type": "integer", "minimum": 1, "maximum": 9}}}},
            "address": {"type": "object", "additionalProperties": False, "required": ["street", "zip"],
                        "properties": {"street": {"type": "string", "maxLength": 30},
                                       "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}}),
]
MAX_TOKENS = 256


@pytest.fixture(scope="module")
def cluster(default_model_dir: Path) -> Iterator[LocalCluster]:
    spec = ClusterSpec(
        model=str(default_model_dir),
        # 120 blocks of 16 tokens hold about a third of the 50 sequences at their full length: the others are
        # preempted (swapped out while there is swap space, ~70 blocks, recomputed otherwise).
        worker_args=["--num-gpu-blocks-override", "120", "--swap-space", "0.05", "--max-model-len", "1024"],
        scheduler_args=["--lease-ttl", str(LEASE_TTL_S)],
    )
    with LocalCluster(spec) as c:
        yield c


def _requests() -> list[tuple[generation_pb2.GenerateRequest, dict]]:
    """50 generations: 15 greedy and 15 sampled single ones, 10 sampled pairs (n=2, which swap as a group)."""
    out = []
    for i in range(40):
        prompt, schema = SCHEMAS[i % len(SCHEMAS)]
        sampling: dict = {"temperature": 0.0} if i < 15 else {"temperature": 0.8, "seed": i, "n": 1 if i < 30 else 2}
        req = make_request(messages=[("user", f"{prompt} Answer in JSON.")], request_id=f"json-{i}",
                           max_tokens=MAX_TOKENS,
                           structured_outputs=common_pb2.StructuredOutputs(json=json.dumps(schema)), **sampling)
        out.append((req, schema))
    return out


def _worker_stats(rds: redis.Redis, worker: str) -> dict[str, int]:
    return {k.decode(): int(v) for k, v in rds.hgetall(keys.stats(worker)).items()}


def test_json_schema_generations_validate_through_preemption_and_a_replica_kill(
        cluster: LocalCluster, tmp_path: Path) -> None:
    requests = _requests()
    standby, standby_address = start_standby_scheduler(cluster, tmp_path / "standby.log")
    texts: dict[str, dict[int, str]] = {req.request_id: {} for req, _ in requests}
    reasons: dict[str, dict[int, int]] = {req.request_id: {} for req, _ in requests}
    tokens = [0]
    errors: list[BaseException] = []

    def generate(req: generation_pb2.GenerateRequest) -> None:
        # A default client re-attaches after UNAVAILABLE, here to the standby once the first replica is gone.
        with GenerationClient(cluster.address, fallback_addresses=[standby_address]) as client:
            try:
                for msg in client.stream(req, timeout=600):
                    for delta in msg.outputs:
                        texts[req.request_id][delta.index] = texts[req.request_id].get(delta.index, "") + delta.text
                        tokens[0] += len(delta.token_ids)
                        if delta.finish_reason:
                            reasons[req.request_id][delta.index] = delta.finish_reason
            except BaseException as exc:  # noqa: BLE001 - reported by the test thread
                errors.append(exc)

    rds = redis.Redis.from_url(cluster.redis_url)
    worker = cluster.worker_address
    try:
        threads = [threading.Thread(target=generate, args=(req,), daemon=True) for req, _ in requests]
        for t in threads:
            t.start()
        # Kill the owner mid-generation, once the cache has overflowed.
        wait_for(lambda: _worker_stats(rds, worker).get("preemptions", 0) > 0 and tokens[0] > 400, 600,
                 "no preemption while the 50 generations ran")
        cluster.kill("scheduler")
        at_kill = tokens[0]
        for t in threads:
            t.join(600)
        assert not any(t.is_alive() for t in threads), "a generation did not end"
        assert not errors, errors[:3]
        stats = _worker_stats(rds, worker)
        outputs = [(rid, index, text) for rid, by_index in texts.items() for index, text in by_index.items()]
        assert len(outputs) == 50 and at_kill < tokens[0], (len(outputs), at_kill, tokens[0])
        for (req, schema) in requests:
            for index, text in texts[req.request_id].items():
                assert reasons[req.request_id][index] == common_pb2.FINISH_REASON_STOP, (req.request_id, text)
                jsonschema.validate(json.loads(text), schema)
        print(f"50 valid JSON documents; {stats.get('preemptions')} preemptions, {stats.get('swaps', 0)} swaps; "
              f"{at_kill} of {tokens[0]} tokens before the kill")
        assert stats.get("swaps", 0) > 0, stats
    finally:
        rds.close()
        standby.kill()
        standby.wait()
    cluster.restart("scheduler")
    assert_all_blocks_free(cluster)

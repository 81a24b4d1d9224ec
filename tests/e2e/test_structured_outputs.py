"""50 generations constrained by JSON schemas, on the default model, through the services: every one parses
and validates, while the KV cache is too small for them all (preemption: recompute, and swap when a pair is
the victim) and the scheduler replica that owns the worker is SIGKILLed mid-generation (a standby replica
takes the worker over on its cache and the clients re-attach to it). First, every spelling of a constraint
through the HTTP front with the official openai client.

The worker's grammar matchers are rebuilt from each sequence's tokens whenever the worker learns a sequence
again (recompute, takeover): a matcher that started over would expect a new document and break the JSON.
"""

from __future__ import annotations

import json
import re
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
from benchmarks.json_schemas import SCHEMAS
from tests.e2e.cluster_checks import assert_all_blocks_free, start_standby_scheduler, wait_for

LEASE_TTL_S = 2
MAX_TOKENS = 256
# What the HTTP front serves the model as: the checkpoint directory's name.
MODEL_NAME = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def cluster(default_model_dir: Path) -> Iterator[LocalCluster]:
    spec = ClusterSpec(
        model=str(default_model_dir),
        # 120 blocks of 16 tokens hold about a third of the 50 sequences at their full length: the others are
        # preempted, recomputed (a single sequence) or swapped out (a pair, while the ~70 blocks of swap space
        # last; whether a pair is ever the victim depends on the arrival order).
        worker_args=["--num-gpu-blocks-override", "120", "--swap-space", "0.05", "--max-model-len", "1024"],
        scheduler_args=["--lease-ttl", str(LEASE_TTL_S)],
        http_port=0,
    )
    with LocalCluster(spec) as c:
        yield c


def test_every_spelling_through_the_openai_client(cluster: LocalCluster) -> None:
    """OpenAI's response_format, vLLM's structured_outputs and guided_* fields, streamed and whole."""
    openai = pytest.importorskip("openai")
    prompt, schema = SCHEMAS[0]
    messages = [{"role": "user", "content": f"{prompt} Answer in JSON."}]
    with openai.OpenAI(base_url=f"{cluster.http_url}/v1", api_key="unused", max_retries=0, timeout=300) as client:
        chat = client.chat.completions.create(
            model=MODEL_NAME, messages=messages, max_tokens=MAX_TOKENS, temperature=0.0,
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}})
        jsonschema.validate(json.loads(chat.choices[0].message.content), schema)
        assert chat.choices[0].finish_reason == "stop"
        stream = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=MAX_TOKENS,
                                                temperature=0.7, seed=1, stream=True,
                                                response_format={"type": "json_object"})
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert isinstance(json.loads(text), dict)
        choice = client.completions.create(model=MODEL_NAME, prompt="The weather today is", max_tokens=20,
                                           temperature=0.9, seed=2, n=3,
                                           extra_body={"structured_outputs": {"choice": ["sunny", "rainy"]}})
        assert {c.text for c in choice.choices} <= {"sunny", "rainy"} and len(choice.choices) == 3
        regex = client.completions.create(model=MODEL_NAME, prompt="My phone number is", max_tokens=20,
                                          temperature=0.0, extra_body={"guided_regex": "[0-9]{3}-[0-9]{4}"})
        assert re.fullmatch("[0-9]{3}-[0-9]{4}", regex.choices[0].text), regex.choices[0].text
        grammar = client.completions.create(model=MODEL_NAME, prompt="Is the sky blue?", max_tokens=20,
                                            temperature=0.0, extra_body={"guided_grammar": 'root ::= "yes" | "no"'})
        assert grammar.choices[0].text in ("yes", "no")
        # min_tokens beyond where the grammar ends: the grammar allows only EOS, which ends the output there.
        short = client.completions.create(model=MODEL_NAME, prompt="Is the sky blue?", max_tokens=20,
                                          temperature=0.0, extra_body={"guided_choice": ["yes"], "min_tokens": 10})
        assert short.choices[0].text == "yes" and short.choices[0].finish_reason == "stop"
        assert short.usage.completion_tokens < 10  # "yes" and the EOS, not EOS again until min_tokens
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=MODEL_NAME, prompt="x", extra_body={"guided_regex": "[0-9"})
        assert "structured_outputs.regex is not valid" in str(info.value)


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
    finally:
        rds.close()
        standby.kill()
        standby.wait()
    cluster.restart("scheduler")
    assert_all_blocks_free(cluster)

"""Traces and metrics end to end: scheduler and worker as separate processes, spans in JSON-lines files.

One request sent with a W3C traceparent must come back as one trace per engine step in which the
worker's span is a child of the scheduler's step span, and every such step links to the request's
SERVER span (itself a child of the caller's span). Metrics scraped around a known workload must
move by exactly the workload's counts.
"""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from llmserve.client import GenerationClient, make_request
from llmserve.local_cluster import ClusterSpec, LocalCluster
from protos import generation_pb2_grpc
from shared.redis_server import free_port
from shared.tracing_view import SpanRecord, load_spans

CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"


class Observed:
    def __init__(self, cluster: LocalCluster, trace_files: list[Path], scheduler_metrics: str, worker_metrics: str) -> None:
        self.cluster, self.trace_files = cluster, trace_files
        self.scheduler_metrics, self.worker_metrics = scheduler_metrics, worker_metrics


@pytest.fixture(scope="module")
def observed(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Observed]:
    tmp = tmp_path_factory.mktemp("observability")
    scheduler_trace, worker_trace = tmp / "scheduler.jsonl", tmp / "worker.jsonl"
    scheduler_port, worker_port = free_port(), free_port()
    spec = ClusterSpec(
        model=str(tiny_llama_dir),
        worker_args=["--num-gpu-blocks-override", "64", "--max-model-len", "512", "--num-threads", "1",
                     "--trace-file", str(worker_trace), "--metrics-port", str(worker_port)],
        scheduler_args=["--trace-file", str(scheduler_trace), "--metrics-port", str(scheduler_port)],
        # The HTTP front relays both services' series on its own /metrics, as vLLM's API server serves them.
        http_port=0,
        http_args=["--engine-metrics", f"http://127.0.0.1:{scheduler_port}/metrics",
                   "--engine-metrics", f"http://127.0.0.1:{worker_port}/metrics"],
    )
    with LocalCluster(spec) as cluster:
        yield Observed(cluster, [scheduler_trace, worker_trace], f"http://127.0.0.1:{scheduler_port}/metrics",
                       f"http://127.0.0.1:{worker_port}/metrics")


def _wait_for(check, what: str, timeout_s: float = 20.0):  # noqa: ANN001, ANN202 - test helper
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def _spans(files: list[Path]) -> list[SpanRecord]:
    return load_spans([f for f in files if f.exists()])


def test_one_request_traced_across_scheduler_and_worker(observed: Observed) -> None:
    request_id = "traced-request-1"
    prompt = list(range(20, 28))
    request = make_request(prompt_token_ids=prompt, request_id=request_id, max_tokens=5, temperature=0.7, top_p=0.9,
                           seed=3, ignore_eos=True)
    with grpc.insecure_channel(observed.cluster.address) as channel:
        stream = generation_pb2_grpc.GenerationStub(channel).Generate(
            request, timeout=120, metadata=[("traceparent", f"00-{CALLER_TRACE}-{CALLER_SPAN}-01")])
        responses = list(stream)
    assert responses[-1].usage.completion_tokens == 5

    def complete() -> list[SpanRecord] | None:
        spans = _spans(observed.trace_files)
        generate = [s for s in spans if s.name == "llmserve.generate" and s.attributes.get("gen_ai.request.id") == request_id]
        if not generate:
            return None
        key = (generate[0].trace_id, generate[0].span_id)
        steps = {s.span_id for s in spans if s.name == "llmserve.step" and key in s.links}
        workers = [s for s in spans if s.name == "llmserve.worker.execute_step" and s.parent_span_id in steps]
        engine = [s for s in spans if s.name == "llmserve.request" and s.parent_span_id == generate[0].span_id]
        return spans if steps and len(workers) == len(steps) and engine else None

    spans = _wait_for(complete, "the request's spans in the trace files")

    # The request's SERVER span continues the caller's trace and carries the gen_ai.* attributes.
    (generate,) = [s for s in spans if s.name == "llmserve.generate" and s.attributes.get("gen_ai.request.id") == request_id]
    assert (generate.trace_id, generate.parent_span_id, generate.kind) == (CALLER_TRACE, CALLER_SPAN, "SERVER")
    assert generate.service == "llmserve-scheduler"
    a = generate.attributes
    assert a["gen_ai.request.max_tokens"] == 5 and a["gen_ai.request.n"] == 1
    assert a["gen_ai.request.temperature"] == pytest.approx(0.7) and a["gen_ai.request.top_p"] == pytest.approx(0.9)
    assert a["gen_ai.request.model"]
    assert (a["gen_ai.usage.prompt_tokens"], a["gen_ai.usage.completion_tokens"]) == (8, 5)
    assert 0 < a["gen_ai.latency.time_to_first_token"] <= a["gen_ai.latency.e2e"] <= generate.duration_ms / 1e3 + 1e-3

    # The engine's view of the request: a child in the same trace, with the time in queue.
    (engine,) = [s for s in spans if s.name == "llmserve.request" and s.parent_span_id == generate.span_id]
    e = engine.attributes
    assert engine.trace_id == CALLER_TRACE and e["gen_ai.request.id"] == request_id
    assert 0 <= e["gen_ai.latency.time_in_queue"] < e["gen_ai.latency.time_to_first_token"] < e["gen_ai.latency.e2e"]
    assert e["llmserve.time_per_output_token"] > 0
    assert (e["gen_ai.usage.prompt_tokens"], e["gen_ai.usage.completion_tokens"]) == (8, 5)
    assert e["llmserve.finished_reason"] == "length"

    # One step per sampled token (a prefill, then four decodes), each linked to the request span...
    steps = sorted((s for s in spans if s.name == "llmserve.step" and (generate.trace_id, generate.span_id) in s.links),
                   key=lambda s: s.start)
    assert len(steps) == 5
    assert [s.attributes["llmserve.step.prefill_tokens"] for s in steps] == [8, 0, 0, 0, 0]
    assert [s.attributes["llmserve.step.decode_tokens"] for s in steps] == [0, 1, 1, 1, 1]
    for step in steps:
        assert step.service == "llmserve-scheduler" and step.parent_span_id is None
        assert request_id in step.attributes["llmserve.request_ids"]
        assert step.attributes["llmserve.step.blocks_in_use"] >= 1 and step.attributes["llmserve.step.preemptions"] == 0
        # ...and in its trace, the worker's execution is a child of the step span.
        children = [s for s in spans if s.parent_span_id == step.span_id]
        assert all(c.trace_id == step.trace_id for c in children)
        (worker,) = [c for c in children if c.name == "llmserve.worker.execute_step"]
        assert worker.service == "llmserve-worker" and worker.kind == "SERVER"
        assert worker.attributes["llmserve.worker.sampled"] == 1
        assert step.start <= worker.start and worker.end <= step.end + 1_000_000  # clocks of two processes, same host
        assert {c.name for c in children} >= {"llmserve.schedule", "llmserve.postprocess", "llmserve.redis_commit"}
    assert [s.attributes["llmserve.worker.tokens"] for s in spans
            if s.name == "llmserve.worker.execute_step" and s.parent_span_id in {t.span_id for t in steps}] == [8, 1, 1, 1, 1]

    # `llmserve trace show` draws it, in the terminal and as HTML.
    html_path = observed.trace_files[0].parent / "trace.html"
    shown = subprocess.run(
        [sys.executable, "-m", "llmserve", "trace", "show", request_id, "--html", str(html_path),
         *[arg for f in observed.trace_files for arg in ("--trace-file", str(f))]],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout
    print(shown)
    assert f"request {request_id}" in shown and "5 steps" in shown
    assert shown.count("worker execute_step") == 5 and "llmserve.request" in shown
    # The commit that published the last token is shown too, though it ran beside a later step.
    assert f"results of step {steps[-1].attributes['llmserve.step']}" in shown
    assert request_id in html_path.read_text()


def _scrape(url: str) -> dict[str, float]:
    """name{label=value,...} -> value, for every sample (label sets without model_name/worker)."""
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k not in ("model_name", "worker"))
            key = f"{s.name}{{{labels}}}" if labels else s.name
            samples[key] = samples.get(key, 0.0) + s.value
    return samples


def test_metrics_count_a_known_workload(observed: Observed) -> None:
    before_s, before_w = _scrape(observed.scheduler_metrics), _scrape(observed.worker_metrics)
    prompts = [list(range(30, 30 + n)) for n in (5, 7, 9)]
    max_tokens = [4, 6, 8]
    requests = [make_request(prompt_token_ids=p, max_tokens=m, temperature=0.0, ignore_eos=True)
                for p, m in zip(prompts, max_tokens)]

    def run(req):  # noqa: ANN001, ANN202
        with GenerationClient(observed.cluster.address) as client:
            return client.generate(req, timeout=120)

    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(run, requests))
    assert [r.completion_tokens for r in results] == max_tokens

    def settled() -> dict[str, float] | None:
        s = _scrape(observed.scheduler_metrics)
        idle = s.get("vllm:num_requests_running", 1) == 0 and s.get("vllm:num_requests_waiting", 1) == 0
        return s if idle and s.get("vllm:gpu_cache_usage_perc", 1) == 0 else None

    after_s = _wait_for(settled, "the scheduler's gauges to show an idle engine")
    # The worker drops finished sequences with the next plan, then reports its blocks.
    after_w = _wait_for(lambda: (w := _scrape(observed.worker_metrics))["llmserve:worker_kv_blocks_used"] == 0 and w,
                        "the worker to free every block")

    def delta(after: dict[str, float], before: dict[str, float], key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    d = {k: delta(after_s, before_s, k) for k in after_s}
    assert d["vllm:prompt_tokens_total"] == 5 + 7 + 9
    assert d["vllm:generation_tokens_total"] == 4 + 6 + 8
    assert d["vllm:request_success_total{finished_reason=length}"] == 3
    for name in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
                 "vllm:time_per_output_token_seconds", "vllm:request_queue_time_seconds"):
        assert d[f"{name}_count"] == 3, name
        assert d[f"{name}_sum"] > 0 or name == "vllm:request_queue_time_seconds", name
    assert d["vllm:num_preemptions_total"] == 0
    assert after_s["vllm:num_requests_swapped"] == 0
    # vLLM's current names: per-request token counts and phases, the time between a request's tokens (one per
    # step after its first), tokens per step.
    assert (d["vllm:request_prompt_tokens_sum"], d["vllm:request_generation_tokens_sum"]) == (21, 18)
    for name in ("vllm:request_prompt_tokens", "vllm:request_generation_tokens", "vllm:request_prefill_time_seconds",
                 "vllm:request_decode_time_seconds"):
        assert d[f"{name}_count"] == 3, name
    assert d["vllm:inter_token_latency_seconds_count"] == (4 - 1) + (6 - 1) + (8 - 1)
    assert after_s["vllm:kv_cache_usage_perc"] == 0
    assert d["vllm:prefix_cache_queries_total"] == d["vllm:prefix_cache_hits_total"] == 0  # no prefix caching here
    # Every engine step is one call on the worker. The plan that lets the worker drop the
    # finished sequences comes after the engine went idle, and the engine records a step only once
    # its answer is back: compare once both sides have counted it.
    worker_steps = delta(after_w, before_w, "llmserve:worker_step_seconds_count")
    steps = _wait_for(
        lambda: (n := delta(_scrape(observed.scheduler_metrics), before_s, "llmserve:engine_step_seconds_count"))
        == worker_steps and n,
        "the engine to count the worker's steps",
    )
    assert steps >= 8
    # Tokens per step: the steps' tokens are the prefill's 21 and one per later decode.
    assert delta(_scrape(observed.scheduler_metrics), before_s, "vllm:iteration_tokens_total_count") == steps
    assert delta(_scrape(observed.scheduler_metrics), before_s, "vllm:iteration_tokens_total_sum") == 21 + (18 - 3)
    assert delta(after_w, before_w, "llmserve:worker_sampled_tokens_total") == 18
    # Prefill computes every prompt token, each later decode one token.
    assert delta(after_w, before_w, "llmserve:worker_tokens_total") == 21 + (18 - 3)


def test_the_http_port_serves_the_engine_series(observed: Observed) -> None:
    """GET /metrics on the HTTP front: its own series, and the scheduler's and worker's with their values."""
    front = f"{observed.cluster.http_url}/metrics"
    with urllib.request.urlopen(f"{observed.cluster.http_url}/v1/models", timeout=10) as reply:
        assert reply.status == 200

    def same_values() -> dict[str, float] | None:
        direct = {**_scrape(observed.scheduler_metrics), **_scrape(observed.worker_metrics)}
        relayed = _scrape(front)
        return relayed if all(relayed.get(k) == v for k, v in direct.items()) else None

    relayed = _wait_for(same_values, "the front's /metrics to carry the engine's values")
    assert "vllm:kv_cache_usage_perc" in relayed and "llmserve:worker_kv_blocks_used" in relayed
    assert relayed["http_requests_total{handler=/v1/models,method=GET,status=2xx}"] >= 1
    assert relayed["llmserve:metrics_relay_up{source=" + observed.scheduler_metrics + "}"] == 1
    assert relayed["llmserve:metrics_relay_up{source=" + observed.worker_metrics + "}"] == 1

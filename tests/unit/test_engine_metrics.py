"""An engine loop's metrics: vLLM's per-request series, and its gauges leaving the registry when it ends."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from shared.metrics import RequestTimings, SchedulerMetrics


def _value(registry: CollectorRegistry, name: str, worker: str) -> float | None:
    return registry.get_sample_value(name, {"model_name": "m", "worker": worker})


def test_a_finished_request_fills_the_per_request_histograms() -> None:
    metrics = SchedulerMetrics("m")
    engine = metrics.engine("w0")
    engine.finished(RequestTimings(arrival_time=10.0, first_scheduled_time=10.5, first_token_time=11.0,
                                   finished_time=13.0, prompt_tokens=7, generation_tokens=5, finished_reason="length"))
    r = metrics.registry
    assert _value(r, "vllm:request_prefill_time_seconds_sum", "w0") == 0.5
    assert _value(r, "vllm:request_decode_time_seconds_sum", "w0") == 2.0
    assert _value(r, "vllm:request_prompt_tokens_sum", "w0") == 7
    assert _value(r, "vllm:request_generation_tokens_sum", "w0") == 5


def test_a_stopped_loop_takes_its_gauges_and_keeps_its_totals() -> None:
    metrics = SchedulerMetrics("m")
    stopped, running = metrics.engine("w0"), metrics.engine("w1")
    for engine in (stopped, running):
        engine.running.set(3)
        engine.kv_cache_usage.set(0.5)
        engine.generation_tokens.inc(9)
    stopped.close()
    r = metrics.registry
    assert _value(r, "vllm:num_requests_running", "w0") is None
    assert _value(r, "vllm:kv_cache_usage_perc", "w0") is None
    assert _value(r, "vllm:generation_tokens_total", "w0") == 9
    assert _value(r, "vllm:num_requests_running", "w1") == 3 and _value(r, "vllm:kv_cache_usage_perc", "w1") == 0.5
    stopped.close()  # twice, or never set: nothing to remove

"""The HTTP front's /metrics relays the engine's series (openai_api/metrics_relay.py), over real HTTP servers."""

from __future__ import annotations

import asyncio
import http.server
import threading
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.parser import text_string_to_metric_families

from llmserve.cli import _engine_metrics_flags
from openai_api.metrics_relay import relayed_exposition
from shared.metrics import FrontMetrics, MetricsServer
from shared.redis_server import free_port


def _engine(worker: str, running: float, tokens: float) -> MetricsServer:
    registry = CollectorRegistry()
    Gauge("vllm:num_requests_running", "Requests running.", ["worker"], registry=registry).labels(worker).set(running)
    Counter("vllm:generation_tokens", "Tokens generated.", ["worker"], registry=registry).labels(worker).inc(tokens)
    return MetricsServer(registry, 0, "127.0.0.1")


@pytest.fixture
def not_prometheus() -> Iterator[str]:
    """An HTTP server that answers 200 with something that is not a text exposition."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            body = b"{not: a metric exposition"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}/metrics"
    server.shutdown()
    server.server_close()


def _samples(text: bytes) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text.decode()) for s in family.samples}


def test_front_series_then_every_engine_family_declared_once(not_prometheus: str) -> None:
    front = FrontMetrics()
    front.requests.labels("/v1/completions", "POST", "2xx").inc(3)
    engines = [_engine("w1", 2, 10), _engine("w2", 5, 7)]
    dead = f"http://127.0.0.1:{free_port()}/metrics"
    try:
        sources = [f"http://127.0.0.1:{e.port}/metrics" for e in engines] + [dead, not_prometheus]
        text = asyncio.run(relayed_exposition(front.registry, sources, timeout_s=5))
    finally:
        for e in engines:
            e.stop()
    # Two replicas' families merged: one TYPE line each (Prometheus refuses a family declared twice).
    assert text.count(b"# TYPE vllm:num_requests_running gauge") == 1
    assert text.count(b"# TYPE vllm:generation_tokens_total counter") == 1
    samples = _samples(text)
    assert samples[("http_requests_total", (("handler", "/v1/completions"), ("method", "POST"), ("status", "2xx")))] == 3
    assert samples[("vllm:num_requests_running", (("worker", "w1"),))] == 2
    assert samples[("vllm:num_requests_running", (("worker", "w2"),))] == 5
    assert samples[("vllm:generation_tokens_total", (("worker", "w1"),))] == 10
    assert samples[("vllm:generation_tokens_total", (("worker", "w2"),))] == 7
    # A source that is down or answers something else is left out and said so, as Prometheus' `up`.
    up = {dict(labels)["source"]: v for (name, labels), v in samples.items() if name == "llmserve:metrics_relay_up"}
    assert up == {sources[0]: 1, sources[1]: 1, dead: 0, not_prometheus: 0}


def test_up_relays_the_scheduler_and_worker_ports_only_when_metrics_are_on() -> None:
    assert _engine_metrics_flags("127.0.0.1", 0) == []
    assert _engine_metrics_flags("127.0.0.1", 9090) == [
        "--engine-metrics", "http://127.0.0.1:9090/metrics", "--engine-metrics", "http://127.0.0.1:9091/metrics"]

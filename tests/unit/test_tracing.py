"""Tracing set-up and `llmserve trace show`: exporters, trace context, the waterfall from JSON lines."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from llmserve.cli import main
from shared.tracing import (
    TracingConfig,
    child_span,
    context_from_metadata,
    from_traceparent,
    make_tracer,
    to_traceparent,
    trace_carrier,
)
from shared.tracing_view import load_spans, render_html, render_text, request_waterfall

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
MS = 1_000_000


def test_no_exporter_means_a_noop_tracer() -> None:
    tracer, provider = make_tracer(TracingConfig("svc"))
    assert provider is None and isinstance(tracer, trace.NoOpTracer)
    span = tracer.start_span("x")
    assert to_traceparent(span) == "" and trace_carrier(span) == {}


def test_otel_environment_variable_turns_on_otlp() -> None:
    config = TracingConfig.from_env("svc", environ={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"})
    assert config.enabled and config.otlp_endpoint == "http://collector:4317"
    assert TracingConfig.from_env("svc", "flag:4317", environ={"OTEL_EXPORTER_OTLP_ENDPOINT": "x"}).otlp_endpoint == "flag:4317"
    with pytest.raises(ValueError, match="service_name"):
        TracingConfig("")


def test_context_travels_in_metadata_and_records(tmp_path: Path) -> None:
    memory = InMemorySpanExporter()
    path = tmp_path / "spans.jsonl"
    tracer, provider = make_tracer(TracingConfig("svc", trace_file=str(path)), [memory])
    incoming = context_from_metadata([("traceparent", f"00-{TRACE}-00f067aa0ba902b7-01"), ("other", "x")])
    assert context_from_metadata([("traceparent", "garbage")]) is None and context_from_metadata(None) is None
    request = tracer.start_span("llmserve.generate", context=incoming, kind=trace.SpanKind.SERVER)
    parent = from_traceparent(to_traceparent(request))
    assert parent is not None and parent.span_id == request.get_span_context().span_id
    step = tracer.start_span("llmserve.step", links=[trace.Link(parent)], start_time=10 * MS)
    remote = tracer.start_span("worker", context=context_from_metadata(trace_carrier(step).items()))
    remote.end()
    child_span(tracer, "llmserve.schedule", step, 11 * MS, 12 * MS, {"a": 1})
    step.end(end_time=20 * MS)
    request.end()
    assert provider is not None
    provider.shutdown()
    by_name = {s.name: s for s in memory.get_finished_spans()}
    assert by_name["worker"].parent.span_id == step.get_span_context().span_id
    assert by_name["llmserve.generate"].context.trace_id == int(TRACE, 16)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert {d["name"] for d in lines} == set(by_name)
    (step_line,) = [d for d in lines if d["name"] == "llmserve.step"]
    assert step_line["links"][0]["span_id"] == format(parent.span_id, "016x") and step_line["service"] == "svc"
    assert (step_line["start_time"], step_line["end_time"], step_line["parent_span_id"]) == (10 * MS, 20 * MS, None)


def _span(name: str, span_id: str, start_ms: float, end_ms: float, trace_id: str = TRACE, parent: str | None = None,
          links: list[tuple[str, str]] = (), service: str = "llmserve-scheduler", **attributes: object) -> dict:
    return {"trace_id": trace_id, "span_id": span_id, "parent_span_id": parent, "name": name, "kind": "INTERNAL",
            "start_time": int(start_ms * MS), "end_time": int(end_ms * MS), "service": service,
            "attributes": attributes, "links": [{"trace_id": t, "span_id": s, "attributes": {}} for t, s in links],
            "status": "UNSET"}


@pytest.fixture()
def trace_files(tmp_path: Path) -> list[Path]:
    req = (TRACE, "a" * 16)
    step_trace = "b" * 32
    scheduler = [
        _span("llmserve.generate", "a" * 16, 0, 100, **{"gen_ai.request.id": "r1", "gen_ai.request.model": "m",
              "gen_ai.request.temperature": 0.699999988079071, "gen_ai.usage.prompt_tokens": 8,
              "gen_ai.usage.completion_tokens": 2, "gen_ai.latency.e2e": 0.1, "gen_ai.latency.time_to_first_token": 0.05}),
        _span("llmserve.request", "c" * 16, 1, 90, parent="a" * 16, **{"gen_ai.latency.time_in_queue": 0.002,
              "gen_ai.latency.e2e": 0.089}),
        _span("llmserve.step", "1" * 16, 10, 50, trace_id=step_trace, links=[req], **{"llmserve.step": 1,
              "llmserve.step.num_seqs": 1, "llmserve.step.prefill_tokens": 8, "llmserve.step.blocks_in_use": 1,
              "llmserve.step.blocks_total": 64, "llmserve.step.preemptions": 1}),
        _span("llmserve.schedule", "2" * 16, 10, 11, trace_id=step_trace, parent="1" * 16),
        _span("llmserve.step", "3" * 16, 50, 80, trace_id="d" * 32, links=[req], **{"llmserve.step": 2}),
        _span("llmserve.redis_commit", "4" * 16, 51, 53, trace_id="d" * 32, parent="3" * 16,
              links=[(step_trace, "1" * 16)], **{"llmserve.committed_step": 1}),
        # The last step's results, committed when the loop went idle; and an unrelated step.
        _span("llmserve.redis_commit", "5" * 16, 81, 84, trace_id="e" * 32, links=[("d" * 32, "3" * 16)],
              **{"llmserve.committed_step": 2}),
        _span("llmserve.step", "6" * 16, 85, 95, trace_id="f" * 32, **{"llmserve.step": 3}),
    ]
    worker = [_span("llmserve.worker.execute_step", "7" * 16, 12, 48, trace_id=step_trace, parent="1" * 16,
                    service="llmserve-worker", **{"llmserve.worker.tokens": 8, "llmserve.worker.sampled": 1})]
    paths = [tmp_path / "scheduler.jsonl", tmp_path / "worker.jsonl"]
    paths[0].write_text("\n".join(json.dumps(s) for s in scheduler) + "\n")
    # A writer caught mid-line leaves a partial last line: it is skipped.
    paths[1].write_text("\n".join(json.dumps(s) for s in worker) + '\n{"trace_id": "ab')
    return paths


def test_waterfall_orders_steps_and_their_children(trace_files: list[Path]) -> None:
    w = request_waterfall(load_spans(trace_files), "r1")
    assert [(r.depth, r.label) for r in w.rows] == [
        (0, "llmserve.generate"), (1, "llmserve.request"),
        (1, "step 1"), (2, "schedule"), (2, "worker execute_step"),
        (1, "step 2"), (2, "redis commit"),
        (1, "redis commit"),
    ]
    assert w.summary["gen_ai.latency.e2e"] == 0.1 and w.summary["gen_ai.latency.time_in_queue"] == 0.002
    assert len(w.steps) == 2 and w.start == 0 and w.end == 100 * MS


def test_text_rendering(trace_files: list[Path]) -> None:
    text = render_text(request_waterfall(load_spans(trace_files), "r1"), width=20)
    lines = text.splitlines()
    assert lines[0] == f"request r1  trace {TRACE}"
    assert "temperature 0.7," in lines[1]
    assert "8 prompt, 2 completion" in lines[2] and "queue 2.0 ms" in lines[2] and "first token 50.0 ms" in lines[2]
    assert "end to end 100.0 ms; 2 steps" in lines[2]
    bars = {line.split()[0] + (" " + line.split()[1] if line.split()[0] in ("step", "worker", "redis") else ""): line
            for line in lines[4:]}
    assert bars["llmserve.generate"].split()[1] == "█" * 20
    # step 1 runs 10..50 ms of 0..100: cells 2..9 of 20.
    assert "··████████··········    40.00 ms  1 seqs, 8 prefill + 0 decode tok, 1/64 blocks, 1 preempted" in bars["step 1"]
    assert "8 tok, 1 sampled [llmserve-worker]" in bars["worker execute_step"]
    assert text.rstrip().endswith("results of step 2")


def test_html_rendering(trace_files: list[Path]) -> None:
    page = render_html(request_waterfall(load_spans(trace_files), "r1"))
    assert page.startswith("<!doctype html>") and page.count('class="bar"') == 8
    assert "left:10.000%;width:40.000%" in page and "worker execute_step" in page


def test_cli_trace_show(trace_files: list[Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "w.html"
    args = ["trace", "show", "r1", "--trace-file", str(trace_files[0]), "--trace-file", str(trace_files[1])]
    assert main([*args, "--html", str(out)]) == 0
    assert "step 2" in capsys.readouterr().out and out.exists()
    assert main(["trace", "show", "nope", "--trace-file", str(trace_files[0])]) == 2
    assert "no llmserve.generate span" in capsys.readouterr().err

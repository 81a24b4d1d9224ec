"""OpenTelemetry set-up shared by both services: exporters, W3C trace context on gRPC metadata.

    client ──traceparent──▶ scheduler: llmserve.generate (SERVER, one per request)
                                 ▲ links (span context kept in the Redis request record)
                            engine loop: llmserve.step (one per step, its own trace)
                              ├── llmserve.schedule / llmserve.redis_commit / llmserve.postprocess
                              └──traceparent──▶ worker: llmserve.worker.execute_step (SERVER)

A service without any exporter gets a no-op tracer: spans then cost a method call.
The tracer is passed to whoever needs it; nothing here sets OpenTelemetry's global provider.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace import NonRecordingSpan, Span, SpanContext
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

TRACEPARENT = "traceparent"
_PROPAGATOR = TraceContextTextMapPropagator()
# The JSON-lines file is written in small batches: a reader (tests, `trace show`) sees spans quickly.
_FILE_EXPORT_DELAY_MS = 200


@dataclass
class TracingConfig:
    """Where a service sends its spans; nothing set = tracing off.

    otlp_endpoint: OTLP/gRPC collector (host:port or http://host:port). The standard
      OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT variables also turn it on (read by `from_env`).
    trace_file: append every span as one JSON object per line to this file.
    """

    service_name: str
    otlp_endpoint: str = ""
    trace_file: str = ""

    def __post_init__(self) -> None:
        if not self.service_name:
            raise ValueError("service_name must be non-empty")

    @property
    def enabled(self) -> bool:
        return bool(self.otlp_endpoint or self.trace_file)

    @classmethod
    def from_env(cls, service_name: str, otlp_endpoint: str = "", trace_file: str = "",
                 environ: Mapping[str, str] | None = None) -> "TracingConfig":
        """Flags first, then OpenTelemetry's standard variables for the OTLP endpoint."""
        env = os.environ if environ is None else environ
        endpoint = otlp_endpoint or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "") or env.get(
            "OTEL_EXPORTER_OTLP_ENDPOINT", "")
        return cls(service_name, endpoint, trace_file)


class JsonLinesSpanExporter(SpanExporter):
    """One span per line: ids, name, kind, start/end (unix ns), attributes, links, status, service.

    Each batch is one write() on an O_APPEND descriptor, so the scheduler and the worker may share a file.
    """

    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        data = "".join(json.dumps(span_to_dict(s), separators=(",", ":")) + "\n" for s in spans).encode()
        with self._lock:
            if self._fd < 0:
                return SpanExportResult.FAILURE
            os.write(self._fd, data)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def _hex_trace(trace_id: int) -> str:
    return format(trace_id, "032x")


def _hex_span(span_id: int) -> str:
    return format(span_id, "016x")


def span_to_dict(span: ReadableSpan) -> dict[str, object]:
    """The JSON-lines form of a finished span (what `llmserve trace show` reads)."""
    ctx = span.get_span_context()
    assert ctx is not None  # an SDK span always has one
    return {
        "trace_id": _hex_trace(ctx.trace_id),
        "span_id": _hex_span(ctx.span_id),
        "parent_span_id": _hex_span(span.parent.span_id) if span.parent is not None else None,
        "name": span.name,
        "kind": span.kind.name,
        "start_time": span.start_time,
        "end_time": span.end_time,
        "service": span.resource.attributes.get("service.name", ""),
        "attributes": dict(span.attributes or {}),
        "links": [
            {"trace_id": _hex_trace(link.context.trace_id), "span_id": _hex_span(link.context.span_id),
             "attributes": dict(link.attributes or {})}
            for link in span.links
        ],
        "status": span.status.status_code.name,
    }


def make_tracer(config: TracingConfig, extra_exporters: Iterable[SpanExporter] = ()) -> tuple[trace.Tracer, TracerProvider | None]:
    """A tracer for the configured exporters (plus `extra_exporters`, e.g. in-memory in tests).

    Returns a no-op tracer and no provider when nothing exports. Shut the provider down on exit:
    that flushes the spans still queued.
    """
    extra = list(extra_exporters)
    if not config.enabled and not extra:
        return trace.NoOpTracer(), None
    provider = TracerProvider(resource=Resource.create({"service.name": config.service_name}))
    if config.otlp_endpoint:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter  # noqa: PLC0415

        endpoint = config.otlp_endpoint
        insecure = not endpoint.startswith("https://")
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint, insecure=insecure)))
    if config.trace_file:
        provider.add_span_processor(
            BatchSpanProcessor(JsonLinesSpanExporter(config.trace_file), schedule_delay_millis=_FILE_EXPORT_DELAY_MS)
        )
    for exporter in extra:
        provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=_FILE_EXPORT_DELAY_MS))
    return provider.get_tracer("llmserve"), provider


# -- trace context: gRPC metadata and the Redis request record ------------------------------------


def context_from_metadata(metadata: Iterable[tuple[str, str | bytes]] | None) -> Context | None:
    """The W3C trace context a gRPC caller sent (None when it sent none or a malformed one)."""
    carrier = {k.lower(): v for k, v in metadata or () if isinstance(v, str)}
    if TRACEPARENT not in carrier:
        return None
    ctx = _PROPAGATOR.extract(carrier)
    return ctx if trace.get_current_span(ctx).get_span_context().is_valid else None


def trace_carrier(span: Span) -> dict[str, str]:
    """The W3C trace context (traceparent, tracestate) that makes the callee's spans children of `span`, as
    gRPC metadata pairs or a message's map carry it (empty when not recording)."""
    carrier: dict[str, str] = {}
    if span.get_span_context().is_valid:
        _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
    return carrier


def to_traceparent(span: Span) -> str:
    """The span's context as a W3C traceparent string ("" for a no-op span)."""
    ctx = span.get_span_context()
    if not ctx.is_valid:
        return ""
    return f"00-{_hex_trace(ctx.trace_id)}-{_hex_span(ctx.span_id)}-{int(ctx.trace_flags):02x}"


def from_traceparent(value: str) -> SpanContext | None:
    """Parses a traceparent string kept in a record (None when empty or malformed)."""
    if not value:
        return None
    ctx = trace.get_current_span(_PROPAGATOR.extract({TRACEPARENT: value})).get_span_context()
    return ctx if ctx.is_valid else None


class PerfClock:
    """Turns time.perf_counter() readings into the unix nanoseconds spans carry.

    Phases are measured once with perf_counter (for --profile-steps, metrics and spans alike);
    one wall-clock reading taken next to a perf_counter reading anchors them.
    """

    def __init__(self, perf_now: float) -> None:
        self._wall_ns = time.time_ns()
        self._perf = perf_now

    def ns(self, perf: float) -> int:
        return self._wall_ns + int((perf - self._perf) * 1e9)


def child_span(tracer: trace.Tracer, name: str, parent: Span, start_ns: int, end_ns: int,
               attributes: Mapping[str, object] | None = None, links: Sequence[trace.Link] | None = None) -> None:
    """Records an already-measured phase as a finished child of `parent`."""
    span = tracer.start_span(name, context=trace.set_span_in_context(parent), links=links,
                             attributes=attributes, start_time=start_ns)  # type: ignore[arg-type]
    span.end(end_time=end_ns)


def remote_parent(span_context: SpanContext) -> Context:
    """A context whose parent is a span of another process."""
    return trace.set_span_in_context(NonRecordingSpan(span_context))


__all__ = [
    "TRACEPARENT", "JsonLinesSpanExporter", "PerfClock", "TracingConfig", "child_span", "context_from_metadata",
    "from_traceparent", "make_tracer", "remote_parent", "span_to_dict", "to_traceparent", "trace_carrier",
]

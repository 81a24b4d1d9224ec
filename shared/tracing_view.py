"""`llmserve trace show`: one request's waterfall from the JSON-lines spans of --trace-file.

A request's spans are found through its `llmserve.generate` span (attribute gen_ai.request.id):

    llmserve.generate                 the request, as its client saw it (scheduler servicer)
      llmserve.request                the request in the engine loop: time in queue, TTFT, end to end
    llmserve.step                     every step that linked to the request span, each in its own trace:
      llmserve.schedule                 scheduling + building the plan
      llmserve.worker.execute_step      the worker's execution (another process: a child through gRPC metadata)
      llmserve.redis_commit             the previous step's commit, overlapped with this step's RPC
      llmserve.postprocess              detokenize, stop checks, outputs of this step
    llmserve.redis_commit             a commit with no step beside it (the loop's last before going idle)
"""

from __future__ import annotations

import html
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class SpanRecord:
    """One line of a --trace-file."""

    trace_id: str
    span_id: str
    parent_span_id: str | None
    name: str
    start: int  # unix ns
    end: int
    service: str = ""
    kind: str = "INTERNAL"
    attributes: dict[str, object] = field(default_factory=dict)
    links: list[tuple[str, str]] = field(default_factory=list)
    status: str = "UNSET"

    @property
    def duration_ms(self) -> float:
        return (self.end - self.start) / 1e6


def _record(obj: dict) -> SpanRecord:
    return SpanRecord(
        trace_id=obj["trace_id"], span_id=obj["span_id"], parent_span_id=obj.get("parent_span_id"),
        name=obj["name"], start=int(obj["start_time"]), end=int(obj["end_time"]), service=obj.get("service", ""),
        kind=obj.get("kind", "INTERNAL"), attributes=obj.get("attributes") or {},
        links=[(link["trace_id"], link["span_id"]) for link in obj.get("links") or []],
        status=obj.get("status", "UNSET"),
    )


def load_spans(paths: Iterable[str | Path]) -> list[SpanRecord]:
    """Every span in the files; a line cut short (a writer still at work) is skipped."""
    spans: list[SpanRecord] = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for line in f:
                line = line.strip()
                if not line:
                    continue
                try:
                    spans.append(_record(json.loads(line)))
                except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                    continue
    return spans


@dataclass
class Row:
    """One bar of the waterfall."""

    depth: int
    label: str
    span: SpanRecord
    detail: str = ""


@dataclass
class Waterfall:
    request_id: str
    request: SpanRecord
    rows: list[Row]
    # gen_ai.* and llmserve.* attributes of the request, from the servicer's and the engine's spans.
    summary: dict[str, object]
    steps: list[SpanRecord]

    @property
    def start(self) -> int:
        return min(r.span.start for r in self.rows)

    @property
    def end(self) -> int:
        return max(r.span.end for r in self.rows)


_CHILD_LABELS = {
    "llmserve.schedule": "schedule",
    "llmserve.worker.execute_step": "worker execute_step",
    "llmserve.redis_commit": "redis commit",
    "llmserve.postprocess": "postprocess",
}


def _ms(attrs: dict[str, object], key: str) -> str:
    value = attrs.get(key)
    return f"{float(value) * 1e3:.1f} ms" if isinstance(value, (int, float)) else "-"


def _step_detail(step: SpanRecord) -> str:
    a = step.attributes
    parts = [f"{a.get('llmserve.step.num_seqs', '?')} seqs",
             f"{a.get('llmserve.step.prefill_tokens', 0)} prefill + {a.get('llmserve.step.decode_tokens', 0)} decode tok",
             f"{a.get('llmserve.step.blocks_in_use', '?')}/{a.get('llmserve.step.blocks_total', '?')} blocks"]
    if a.get("llmserve.step.preemptions"):
        parts.append(f"{a['llmserve.step.preemptions']} preempted")
    swaps = int(a.get("llmserve.step.swap_in_blocks", 0) or 0) + int(a.get("llmserve.step.swap_out_blocks", 0) or 0)
    if swaps:
        parts.append(f"{swaps} blocks swapped")
    return ", ".join(parts)


def _child_detail(span: SpanRecord) -> str:
    a = span.attributes
    if span.name == "llmserve.worker.execute_step":
        return (f"{a.get('llmserve.worker.tokens', '?')} tok, {a.get('llmserve.worker.sampled', '?')} sampled "
                f"[{span.service}]")
    if span.name == "llmserve.redis_commit" and "llmserve.committed_step" in a:
        return f"results of step {a['llmserve.committed_step']}"
    return ""


def request_waterfall(spans: list[SpanRecord], request_id: str) -> Waterfall:
    """The request's spans and the steps that served it, in time order; ValueError when it is not there."""
    requests = [s for s in spans if s.name == "llmserve.generate" and s.attributes.get("gen_ai.request.id") == request_id]
    if not requests:
        raise ValueError(f"no llmserve.generate span with gen_ai.request.id {request_id!r} in the trace files "
                         "(were the services started with --trace-file, and has the request finished?)")
    request = max(requests, key=lambda s: s.start)  # a reused id: its latest request
    key = (request.trace_id, request.span_id)
    children: dict[str, list[SpanRecord]] = {}
    for s in spans:
        if s.parent_span_id is not None:
            children.setdefault(s.parent_span_id, []).append(s)
    rows = [Row(0, "llmserve.generate", request, f"[{request.service}]")]
    summary = dict(request.attributes)
    for child in sorted(children.get(request.span_id, []), key=lambda s: s.start):
        if child.trace_id == request.trace_id:
            rows.append(Row(1, child.name, child, f"[{child.service}]"))
            # The servicer's values (what the client saw) win; the engine adds time in queue.
            summary.update({k: v for k, v in child.attributes.items() if k not in summary})
    steps = sorted((s for s in spans if s.name == "llmserve.step" and key in s.links), key=lambda s: s.start)
    step_keys = {(s.trace_id, s.span_id) for s in steps}
    # The commit of a step's results runs beside the next step, or alone when the loop goes idle; after the
    # request's last step, that next step is not the request's: show its commit on its own row.
    step_ids = {s.span_id for s in steps}
    lone_commits = [s for s in spans if s.name == "llmserve.redis_commit" and s.parent_span_id not in step_ids
                    and any(link in step_keys for link in s.links)]
    for item in sorted([*steps, *lone_commits], key=lambda s: s.start):
        if item.name == "llmserve.step":
            rows.append(Row(1, f"step {item.attributes.get('llmserve.step', '?')}", item, _step_detail(item)))
            for child in sorted(children.get(item.span_id, []), key=lambda s: s.start):
                if child.trace_id == item.trace_id:
                    rows.append(Row(2, _CHILD_LABELS.get(child.name, child.name), child, _child_detail(child)))
        else:
            rows.append(Row(1, "redis commit", item, f"results of step {item.attributes.get('llmserve.committed_step', '?')}"))
    return Waterfall(request_id, request, rows, summary, steps)


def _num(value: object) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value if value is not None else "?")


def _summary_line(w: Waterfall) -> str:
    s = w.summary
    return (f"request {w.request_id}  trace {w.request.trace_id}\n"
            f"  model {s.get('gen_ai.request.model', '?')}, max_tokens {s.get('gen_ai.request.max_tokens', '?')}, "
            f"temperature {_num(s.get('gen_ai.request.temperature'))}, top_p {_num(s.get('gen_ai.request.top_p'))}, "
            f"n {s.get('gen_ai.request.n', '?')}\n"
            f"  tokens: {s.get('gen_ai.usage.prompt_tokens', '?')} prompt, {s.get('gen_ai.usage.completion_tokens', '?')} "
            f"completion;  queue {_ms(s, 'gen_ai.latency.time_in_queue')}, first token "
            f"{_ms(s, 'gen_ai.latency.time_to_first_token')}, end to end {_ms(s, 'gen_ai.latency.e2e')}; "
            f"{len(w.steps)} steps")


def render_text(w: Waterfall, width: int = 60) -> str:
    """The waterfall for a terminal: one row per span, bars on a shared time axis."""
    t0, t1 = w.start, w.end
    scale = width / max(1, t1 - t0)
    labels = ["  " * r.depth + r.label for r in w.rows]
    label_width = min(44, max(len(label) for label in labels))
    axis = f"0 ms{' ' * max(1, width - 4 - len(f'{(t1 - t0) / 1e6:.1f} ms'))}{(t1 - t0) / 1e6:.1f} ms"
    lines = [_summary_line(w), "", f"{'':{label_width}}  {axis}"]
    for row, label in zip(w.rows, labels):
        a = int((row.span.start - t0) * scale)
        b = max(a + 1, int(round((row.span.end - t0) * scale)))
        a, b = min(a, width - 1), min(b, width)
        bar = "·" * a + "█" * (b - a) + "·" * (width - b)
        flag = " !" if row.span.status == "ERROR" else ""
        lines.append(f"{label[:label_width]:{label_width}}  {bar} {row.span.duration_ms:8.2f} ms  {row.detail}{flag}".rstrip())
    return "\n".join(lines)


_COLORS = {
    "llmserve.generate": "#4e79a7", "llmserve.request": "#76b7b2", "llmserve.step": "#f28e2b",
    "llmserve.schedule": "#edc948", "llmserve.worker.execute_step": "#e15759", "llmserve.redis_commit": "#59a14f",
    "llmserve.postprocess": "#b07aa1",
}


def render_html(w: Waterfall) -> str:
    """A self-contained HTML page of the waterfall (hover a bar for its attributes)."""
    t0, total = w.start, max(1, w.end - w.start)
    rows = []
    for row in w.rows:
        left = 100 * (row.span.start - t0) / total
        span_width = max(0.15, 100 * (row.span.end - row.span.start) / total)
        tip = html.escape(json.dumps({"name": row.span.name, "service": row.span.service,
                                      "duration_ms": round(row.span.duration_ms, 3), **row.span.attributes}, indent=1))
        rows.append(
            f'<div class="row"><div class="label" style="padding-left:{row.depth * 16}px">{html.escape(row.label)}</div>'
            f'<div class="lane"><div class="bar" title="{tip}" style="left:{left:.3f}%;width:{span_width:.3f}%;'
            f'background:{_COLORS.get(row.span.name, "#999")}"></div></div>'
            f'<div class="ms">{row.span.duration_ms:.2f} ms</div><div class="detail">{html.escape(row.detail)}</div></div>'
        )
    summary = html.escape(_summary_line(w))
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>llmserve trace {html.escape(w.request_id)}</title>
<style>
body {{ font: 13px system-ui, sans-serif; margin: 20px; }}
pre {{ background: #f6f6f6; padding: 8px; }}
.row {{ display: flex; align-items: center; height: 20px; border-bottom: 1px solid #f0f0f0; }}
.label {{ width: 260px; flex: none; white-space: nowrap; overflow: hidden; }}
.lane {{ position: relative; flex: 1; height: 14px; background: #fafafa; }}
.bar {{ position: absolute; top: 0; height: 14px; border-radius: 2px; }}
.ms {{ width: 90px; flex: none; text-align: right; padding-right: 8px; font-variant-numeric: tabular-nums; }}
.detail {{ width: 420px; flex: none; color: #555; white-space: nowrap; overflow: hidden; }}
</style></head><body>
<h2>llmserve request {html.escape(w.request_id)}</h2>
<pre>{summary}</pre>
<p>Time axis: 0 to {total / 1e6:.2f} ms. Hover a bar for its span attributes.</p>
{chr(10).join(rows)}
</body></html>
"""

"""Markdown cells and rows that every section of docs/benchmarks.md shares."""

from __future__ import annotations

from typing import Any


def fmt(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None or value != value else f"{value:.{digits}f}"


def dist(d: dict[str, float] | None, key: str) -> str:
    return "n/a" if not d else fmt(d[key], 0)


def throughput_row(s: dict[str, Any]) -> str:
    """One row of THROUGHPUT_HEADER from a Summary written as a dict."""
    duration = s["duration_s"]
    out_tps = s["output_tokens"] / duration
    total_tps = (s["input_tokens"] + s["output_tokens"]) / duration
    return (f"| {s['backend']} | {s['completed']} | {fmt(s['completed'] / duration, 2)} | {fmt(out_tps)} | "
            f"{fmt(total_tps)} | {dist(s.get('ttft_ms'), 'mean')} / {dist(s.get('ttft_ms'), 'median')} / "
            f"{dist(s.get('ttft_ms'), 'p99')} | {dist(s.get('tpot_ms'), 'mean')} / {dist(s.get('tpot_ms'), 'median')} / "
            f"{dist(s.get('tpot_ms'), 'p99')} | {dist(s.get('itl_ms'), 'median')} / {dist(s.get('itl_ms'), 'p99')} | "
            f"{dist(s.get('e2e_ms'), 'median')} / {dist(s.get('e2e_ms'), 'p99')} |")


THROUGHPUT_HEADER = (
    "| backend | requests | req/s | output tok/s | total tok/s | TTFT ms mean / median / p99 | "
    "TPOT ms mean / median / p99 | ITL ms median / p99 | E2E ms median / p99 |\n"
    "|---|---:|---:|---:|---:|---:|---:|---:|---:|"
)

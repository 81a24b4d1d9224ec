"""Writes the soak's results: a markdown page (docs/soak.md via `make soak`) or, for a .json path, JSON."""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

from tests.e2e.soak_monitor import Sample


def machine() -> dict[str, object]:
    """Where and when the soak ran; the load average says how much else shared the cores."""
    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as info:
            cpu = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), cpu)
    except OSError:
        pass
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                check=False).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                    text=True, check=False).stdout.strip())
    except OSError:
        commit, dirty = "", False
    return {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": cpu, "cpu_count": os.cpu_count(), "platform": platform.platform(),
        "python": sys.version.split()[0], "git_commit": commit + (" (with uncommitted changes)" if dirty else ""),
    }


def timeline(samples: list[Sample], rows: int = 12) -> list[Sample]:
    """About `rows` evenly spaced samples, the first and last included."""
    if len(samples) <= rows:
        return samples
    step = (len(samples) - 1) / (rows - 1)
    return [samples[round(i * step)] for i in range(rows)]


def _mib(kib: int) -> str:
    return f"{kib / 1024:.1f}"


def render_markdown(summary: dict[str, object], samples: list[Sample]) -> str:
    s = summary
    m, setup, req, kv, mem = s["machine"], s["setup"], s["requests"], s["kv_cache"], s["memory"]  # type: ignore[index]
    lines = [
        "# Bounded soak",
        "",
        "Written by `make soak` (tests/e2e/test_soak.py with `LLMSERVE_SOAK_SECONDS=600`): a local cluster (Redis, one",
        "worker, one scheduler as processes) serving the tiny random Llama with a KV cache far smaller than the",
        "load needs, driven by concurrent clients sending greedy, sampled, n > 1 and best_of requests back to back,",
        "a quarter of them ended at a random moment by a stream cancel or the Abort RPC. Pass criteria and their",
        "reasons are in the test's docstring. Throughput depends on what else ran on the machine (load average",
        "below); the pass criteria do not.",
        "",
        f"**Result: {'PASS' if s['passed'] else 'FAIL'}**",
        "",
        "## Machine",
        "",
        f"- date: {m['date_utc']}; commit {m['git_commit']}",
        f"- CPU: {m['cpu']} x {m['cpu_count']}; {m['platform']}; Python {m['python']}",
        f"- load average (1/5/15 min): at start {s['loadavg_start']}, at end {s['loadavg_end']}",
        "",
        "## Setup",
        "",
        f"- load: {setup['load_seconds']:.0f} s, {setup['clients']} client threads (then "
        f"{setup['last_requests_seconds']:.0f} s for their requests in flight), per-request deadline "
        f"{setup['deadline_s']:.0f} s",
        f"- worker: `{' '.join(setup['worker_args'])}` ({setup['gpu_blocks']} KV blocks of {setup['block_size']} "
        f"tokens, {setup['cpu_blocks']} swap blocks)",
        f"- scheduler: `{' '.join(setup['scheduler_args']) or '(defaults)'}`",
        "",
        "## Requests",
        "",
        "| outcome | requests |",
        "|---|---:|",
        *[f"| {k} | {v} |" for k, v in req["outcomes"].items()],
        f"| **started** | **{req['started']}** |",
        "",
        f"By kind: {', '.join(f'{k} {v}' for k, v in req['by_kind'].items())}. Completion tokens: "
        f"{req['completion_tokens']} ({req['tokens_per_s']:.1f}/s, aborted requests' partial outputs included). "
        f"Preemptions: {s['preemptions']} (of which swaps: {s['swaps']}).",
        "",
        "## KV cache (device blocks in use, one sample every 0.5 s while the load ran)",
        "",
        "| p10 | p50 | p90 | min | max | samples above 90 % |",
        "|---:|---:|---:|---:|---:|---:|",
        f"| {kv['p10']:.1%} | {kv['p50']:.1%} | {kv['p90']:.1%} | {kv['min']:.1%} | {kv['max']:.1%} | "
        f"{kv['fraction_above_90']:.1%} |",
        "",
        f"## Memory (RSS, MiB, from {s['memory_from_s']:.0f} s into the load on)",
        "",
        "| process | first sample | last sample | median, first third | median, last third | growth | trend |",
        "|---|---:|---:|---:|---:|---:|---:|",
        *[f"| {role} | {_mib(v['first'])} | {_mib(v['last'])} | {_mib(v['first_third'])} | {_mib(v['last_third'])} | "
          f"{v['growth_pct']:+.1f} % | {v['trend_mib_per_min']:+.2f} MiB/min |" for role, v in mem.items()],
        "",
        "Trend: least-squares slope over these samples (reported, not a pass criterion). The scheduler's RSS drops",
        "once by ~30 MiB in its first 10-20 s of load (presumably start-up memory returned to the OS); the window",
        "starts after. A slow scheduler trend is the allocator, not live objects: a tracemalloc run of 2,532",
        "requests held live Python memory flat (+12 bytes per request, all per-request containers empty at idle);",
        "the RSS growth was free space glibc keeps in the event loop's heap (`malloc_trim` gave back 3.4 MiB).",
        "",
        f"Redis `used_memory`: {s['redis_mib_start']:.1f} MiB at start, {s['redis_mib_end']:.1f} MiB at the end "
        "(finished requests' output streams are kept for an hour by design, for resumable clients; the test checks "
        "that each of them expires).",
        "",
        "## Checks",
        "",
        *[f"- {'ok' if ok else 'FAILED'}: {name}{f' ({detail})' if detail else ''}"
          for name, ok, detail in s["checks"]],  # type: ignore[attr-defined]
        "",
        "## Timeline",
        "",
        "| t (s) | KV used | running / waiting / swapped | requests ended | scheduler RSS | worker RSS |",
        "|---:|---:|---|---:|---:|---:|",
        *[f"| {p.t:.0f} | {p.kv_used:.0%} | {p.running} / {p.waiting} / {p.swapped} | "
          f"{sum(v for k, v in p.requests.items() if k != 'started')} | {_mib(p.rss_kib['scheduler'])} | "
          f"{_mib(p.rss_kib['worker'])} |" for p in timeline(samples)],
        "",
    ]
    return "\n".join(lines)


def write_report(path: Path, summary: dict[str, object], samples: list[Sample]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".json":
        path.write_text(json.dumps(summary, indent=2, default=str) + "\n")
    else:
        path.write_text(render_markdown(summary, samples))

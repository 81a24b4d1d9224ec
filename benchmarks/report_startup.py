"""The docs/benchmarks.md section of benchmarks/startup.py's results: how long `llmserve up` takes to serve."""

from __future__ import annotations

from typing import Any

from shared.startup_timer import StartupReport

# Issue 15's acceptance: ready in at most this many seconds on the second start (a machine that has served once).
SECOND_START_TARGET_S = 10.0


def startup_section(r: dict[str, Any]) -> str:
    starts = [StartupReport.from_dict(s) for s in r["starts"]]
    lines = [
        "## Start-up",
        "",
        f"Run of {r['date']} on {r['machine']} (`benchmarks/startup.py`). {r['description']} Redis, the worker "
        "and the scheduler start together; each service's log says where its own time went "
        "(see the README's Start-up section).",
        "",
        "| start | serving after | worker | scheduler |",
        "|---:|---:|---:|---:|",
    ]
    for n, report in enumerate(starts, 1):
        lines.append(f"| {n} | {report.total_s:.1f} s | {report.seconds('worker'):.1f} s | "
                     f"{report.seconds('scheduler'):.1f} s |")
    if len(starts) >= 2:
        later = max(s.total_s for s in starts[1:])
        verdict = "met" if later <= SECOND_START_TARGET_S else "not met"
        lines += ["", f"Issue 15 target, ready in at most {SECOND_START_TARGET_S:g} s from the second start on: "
                      f"{verdict} (slowest later start {later:.1f} s)."]
    return "\n".join(lines)

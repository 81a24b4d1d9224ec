"""docs/scaling.md's statements are computed from the results: the ceiling, full steps, Redis growth."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.report_fleet import ceiling, redis_section, render


def run(workers: int, *, commands_per_step: float, tokens_per_step: float = 32.0, streams_per_worker: int = 32,
        cpu_ms: float = 10.0, front: int = 0, engine_ms: float | None = None) -> dict[str, object]:
    steps = 50.0
    return {
        "replicas": 1, "workers": workers, "profile": "llama-3-8b-h100", "streams": streams_per_worker * workers,
        "steps_per_s_per_worker": steps / workers, "busy_fraction": 0.4, "added_ms_per_step": 10.0,
        "modelled_ms_per_step": 8.0, "scheduler_cpu_ms_per_step": cpu_ms,
        "engine_cpu_ms_per_step": cpu_ms if engine_ms is None else engine_ms,
        "worker_cpu_ms_per_step": 2.0, "client_cpu_ms_per_step": 3.0, "tokens_per_s": steps * tokens_per_step,
        "redis_commands_per_step": commands_per_step, "redis_commands_per_token": commands_per_step / tokens_per_step,
        "redis_bytes_per_step": 1000.0, "redis_bytes_per_token": 30.0, "machine_cpus": 2, "front_replicas": front,
    }


def test_the_ceiling_is_one_core_over_the_cpu_per_step() -> None:
    steps, workers = ceiling(run(1, commands_per_step=100, cpu_ms=10.0))
    assert steps == 100.0
    assert abs(workers - 100.0 / (0.9 * 125.0)) < 1e-9  # 8 ms steps: 125 steps/s per worker, 90 % of it


def test_redis_growth_is_judged_on_full_steps_only() -> None:
    flat = redis_section([("sync", run(1, commands_per_step=100)), ("sync", run(4, commands_per_step=110)),
                          # a replica that could not keep up: steps of 8 tokens, not judged
                          ("sync", run(16, commands_per_step=40, tokens_per_step=8))])
    assert "1/1, 4/1:" in flat and "flat (within 30 %)" in flat and "NOT flat" not in flat
    grown = redis_section([("sync", run(1, commands_per_step=100)), ("sync", run(4, commands_per_step=200))])
    assert "NOT flat" in grown


def test_the_page_reports_the_front_only_split_and_the_target(tmp_path: Path) -> None:
    results = tmp_path / "results"
    results.mkdir()
    meta = {"date": "today", "machine": "x86_64", "cpus": 2,
            "load": {"streams_per_worker": 32, "prompt_len": 64, "max_tokens": 128, "warmup_s": 8, "window_s": 15}}
    (results / "fleet.json").write_text(json.dumps({**meta, "results": [run(1, commands_per_step=100, cpu_ms=12.0)]}))
    (results / "fleet-front.json").write_text(json.dumps(
        {**meta, "results": [run(1, commands_per_step=100, cpu_ms=13.0, engine_ms=6.0, front=1)]}))
    page = render(results, tmp_path)
    assert "| sync | 1 + 1 front-only | 1 | 32 |" in page
    assert "spent 12.0 ms of CPU per step" in page and "spent 6.0 ms of CPU per step" in page
    # 16 workers at 90 % of 125 steps/s: 1800 steps/s from one core, 0.56 ms per step; 6.0 ms is 11x that.
    assert "needs 0.56 ms" in page and "11x less" in page and "NOT met" in page

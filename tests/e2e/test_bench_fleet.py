"""benchmarks/fleet.py end to end at its smallest: one replica, one simulated worker, a short window."""

from __future__ import annotations

import asyncio
from pathlib import Path

from benchmarks.fleet import Fleet, Load, _measure, _table


def test_fleet_benchmark_measures_steps_cpu_and_redis(default_model_dir: Path, tmp_path: Path) -> None:
    load = Load(streams_per_worker=4, prompt_len=16, max_tokens=16, warmup_s=2.0, window_s=3.0)
    with Fleet(str(default_model_dir), "llama-3-8b-h100", workers=1, replicas=1, workdir=tmp_path) as fleet:
        result = asyncio.run(_measure(fleet, load, "llama-3-8b-h100"))
    assert result.steps_per_s_per_worker > 0 and result.tokens_per_s > 0
    # The worker sleeps its modelled step time (~7 ms for a few tokens of Llama-3-8B on an H100) in each step.
    assert 6.0 < result.modelled_ms_per_step < 50.0
    assert 0 < result.busy_fraction <= 1.05
    assert result.scheduler_cpu_ms_per_step > 0 and result.redis_commands_per_step > 0
    assert result.redis_bytes_per_token > 0
    assert "| 1 | 1 | 4 |" in _table([result])

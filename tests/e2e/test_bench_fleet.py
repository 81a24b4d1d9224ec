"""benchmarks/fleet.py and benchmarks/fleet_failover.py end to end at their smallest, on one fleet: one replica
driving one simulated worker, its clients on a front-only replica, measured over a short window; then a standby
replica and a SIGKILL of the first."""

from __future__ import annotations

import asyncio
from pathlib import Path

import redis

from benchmarks.fleet import Fleet, Load, _measure, _table
from benchmarks.fleet_failover import SEED, run_failover, summary
from scheduler_service.leases import SCHEDULERS, lease_key
from shared.worker_registry import WORKERS

LEASE_TTL_S = 2.0


def test_fleet_benchmarks_measure_steps_cpu_redis_and_a_failover(default_model_dir: Path, tmp_path: Path) -> None:
    load = Load(streams_per_worker=4, prompt_len=16, max_tokens=16, warmup_s=2.0, window_s=3.0)
    with Fleet(str(default_model_dir), "llama-3-8b-h100", workers=1, replicas=1, workdir=tmp_path,
               scheduler_args=["--lease-ttl", str(LEASE_TTL_S)], worker_args=["--seed", str(SEED)],
               front_replicas=1) as fleet:
        result = asyncio.run(_measure(fleet, load, "llama-3-8b-h100"))
        state = redis.Redis.from_url(fleet.redis.url)
        # The front-only replica is not in the roster: the one member is the replica that holds the lease.
        roster = state.zrange(SCHEDULERS, 0, -1)
        leases = {state.get(lease_key(w.decode())) for w in state.hkeys(WORKERS)}
        failover = asyncio.run(run_failover(fleet, streams=4, prompt_len=16, max_tokens=16, warmup_s=2.0,
                                            lease_ttl_s=LEASE_TTL_S, after_s=1.0))
    assert result.steps_per_s_per_worker > 0 and result.tokens_per_s > 0
    # The worker sleeps its modelled step time (~7 ms for a few tokens of Llama-3-8B on an H100) in each step.
    assert 6.0 < result.modelled_ms_per_step < 50.0
    assert 0 < result.busy_fraction <= 1.05
    assert result.redis_commands_per_step > 0 and result.redis_bytes_per_token > 0
    # The clients' streams ran on the front-only replica, the engine loop on the other.
    assert len(roster) == 1 and leases == set(roster), (roster, leases)
    assert 0 < result.engine_cpu_ms_per_step < result.scheduler_cpu_ms_per_step
    assert "| 1 + 1 front | 1 | 4 |" in _table([result])

    report = summary(failover)
    assert failover.leases_held_at_kill == 1 and len(failover.lease_moved_s) == 1, report
    # The lease outlives the kill by at most its TTL; the standby then takes it on its next tick.
    assert 0 < failover.lease_moved_s[0] < 10 * LEASE_TTL_S, report
    assert failover.requests_finished > 0 and failover.requests_lost == 0, (report, failover.errors)
    assert failover.requests_matching == failover.requests_finished, report
    assert failover.recomputed_tokens == 0, report

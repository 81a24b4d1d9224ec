"""The benchmark metrics (vLLM's definitions) and the engine's step-profile file."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.dataset import WorkloadSpec, random_requests, shared_prefix_requests
from benchmarks.metrics import Distribution, RequestTiming, summarize
from scheduler_service.step_profile import StepProfile, StepProfileWriter, read_profiles


def test_request_timing_metrics() -> None:
    t = RequestTiming(prompt_len=10, sent=1.0, token_times=[1.5, 1.7, 2.0, 2.0], done=2.1)
    assert t.ttft == pytest.approx(0.5)
    assert t.tpot == pytest.approx(0.5 / 3)
    assert t.itls == pytest.approx([0.2, 0.3, 0.0])
    assert t.e2e == pytest.approx(1.1)
    assert RequestTiming(prompt_len=1, sent=0.0, token_times=[0.4], done=0.5).tpot is None


def test_summary_counts_only_completed_requests() -> None:
    ok = RequestTiming(prompt_len=10, sent=0.0, token_times=[0.1, 0.2], done=0.2)
    failed = RequestTiming(prompt_len=7, sent=0.0, done=0.3, error="UNAVAILABLE")
    s = summarize("x", [ok, failed], duration_s=2.0)
    assert (s.completed, s.failed, s.input_tokens, s.output_tokens) == (1, 1, 10, 2)
    assert s.output_throughput == 1.0 and s.total_throughput == 6.0 and s.request_throughput == 0.5
    assert s.ttft_ms is not None and s.ttft_ms.median == pytest.approx(100.0)


def test_distribution_percentiles() -> None:
    d = Distribution.of([float(i) for i in range(1, 101)])
    assert (d.mean, d.median, d.p99) == (50.5, 50.5, 99.0)
    assert Distribution.of([]).mean != Distribution.of([]).mean  # NaN when nothing completed


def test_workloads_are_reproducible_and_in_range() -> None:
    spec = WorkloadSpec(num_requests=20, input_len=(5, 9), output_len=(2, 3), seed=4)
    a, b = random_requests(spec, 1000), random_requests(spec, 1000)
    assert a == b and len(a) == 20
    assert all(5 <= len(r.prompt_token_ids) <= 9 and 2 <= r.output_len <= 3 for r in a)
    assert all(100 <= t < 1000 for r in a for t in r.prompt_token_ids)
    shared = shared_prefix_requests(8, prefix_len=6, suffix_len=2, output_len=3, vocab_size=1000, num_prefixes=2)
    assert shared[0].prompt_token_ids[:6] == shared[2].prompt_token_ids[:6] != shared[1].prompt_token_ids[:6]


def test_step_profiles_round_trip_through_the_json_lines_file(tmp_path: Path) -> None:
    path = tmp_path / "profiles" / "steps.jsonl"
    writer = StepProfileWriter(path, flush_every=2)
    profiles = [StepProfile(step=i, num_seqs=i, num_prefill_tokens=0, num_decode_tokens=i, worker_s=0.01 * i)
                for i in range(1, 4)]
    for p in profiles:
        writer.write(p)
    assert len(read_profiles(path)) == 2  # flushed every 2 steps
    writer.close()
    assert read_profiles(path) == profiles

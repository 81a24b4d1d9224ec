"""The report's Targets section: issue 15's throughput target judged against the floor, and the 64-sequence step."""

from __future__ import annotations

from benchmarks.report import DEFAULT_MODEL_PARAMS, targets_section


def _serving(duration_s: float, ratio: float) -> dict[str, object]:
    return {
        "llmserve": {"input_tokens": 9000, "output_tokens": 5000, "duration_s": duration_s},
        "hf_continuous_batching": {"output_tokens": 5000, "duration_s": 100.0},
        "ratio_vs_hf_continuous": ratio,
    }


def _overhead(step_ms: float) -> dict[str, object]:
    return {"rows": [{"batch": 64, "step_ms": step_ms, "phases_ms": {"worker": step_ms - 4.0},
                      "overhead_pct": 400.0 / step_ms}]}


# A GEMM rate that puts the floor at exactly 10 s for the workload above.
_RATE = 2 * DEFAULT_MODEL_PARAMS * 14000 / 10 / 1e9


def test_throughput_target_needs_both_the_floor_fraction_and_the_ratio() -> None:
    # Floor 10 s: a 16 s run is 62 % of it, a 20 s run 50 %.
    met = targets_section(_serving(16.0, 6.0), None, gemm_gflops=_RATE)
    assert "met, 62% of the floor (312.5 of 500.0 tok/s) and 6.00x" in met and "not met" not in met
    assert "not met, 50% of the floor" in targets_section(_serving(20.0, 6.0), None, gemm_gflops=_RATE)
    assert "not met, 62% of the floor" in targets_section(_serving(16.0, 4.9), None, gemm_gflops=_RATE)


def test_the_64_sequence_step_is_judged_against_100_ms() -> None:
    assert "at most 100 ms: met, 99.5 ms** through the services (95.5 ms" in targets_section(
        _serving(16.0, 6.0), _overhead(99.5), gemm_gflops=_RATE)
    text = targets_section(_serving(16.0, 6.0), _overhead(106.4), gemm_gflops=_RATE)
    assert "at most 100 ms: not met, 106.4 ms" in text
    assert "under 5 % of the step at 64 running sequences: met, 3.8 %" in text


def test_the_floor_uses_the_rate_the_serving_run_measured() -> None:
    # No rate passed: the one recorded with the serving results counts (nothing is timed now).
    serving = {**_serving(16.0, 6.0), "gemm_gflops": _RATE}
    assert f"runs at {_RATE:.0f} GFLOP/s" in targets_section(serving, None)
    assert "met, 62% of the floor" in targets_section(serving, None)


def test_the_step_is_put_against_the_machines_multiply_add_peak() -> None:
    # 64 tokens x 2 x 134.5M parameters = 17.2 GFLOP: 86.1 ms at 200 GFLOP/s.
    overhead = {**_overhead(130.0), "fma_peak_gflops": 200.0}
    text = targets_section(_serving(16.0, 6.0), overhead, gemm_gflops=_RATE)
    assert "(17.2 GFLOP for 64 tokens, the LM head included) take at least 86.1 ms" in text
    assert "(200 GFLOP/s on registers" in text
    # Results written before the peak was recorded: no bound is claimed.
    assert "multiply-add peak" not in targets_section(_serving(16.0, 6.0), _overhead(130.0), gemm_gflops=_RATE)


def test_the_floor_line_gives_the_memory_read_rate_measured_around_the_run() -> None:
    serving = {**_serving(16.0, 6.0), "memory_read_gbs": [47.4, 78.8]}
    text = targets_section(serving, None, gemm_gflops=_RATE)
    assert "read memory at 47 GB/s just before the run and 79 GB/s just after it" in text
    # Results written before the rate was recorded: nothing is said about it.
    assert "read memory" not in targets_section(_serving(16.0, 6.0), None, gemm_gflops=_RATE)

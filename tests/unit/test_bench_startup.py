"""The start-up benchmark's report: every start shown, the target judged on the starts after the first."""

from __future__ import annotations

from benchmarks.report_startup import startup_section


def _start(total: float) -> dict[str, object]:
    return {"total_s": total, "cpu_s": None, "phases": [
        {"name": "imports", "seconds": 0.0, "parallel": False},
        {"name": "redis", "seconds": 0.1, "parallel": True},
        {"name": "worker", "seconds": total - 0.2, "parallel": True},
        {"name": "scheduler", "seconds": 3.0, "parallel": True},
        {"name": "first lease", "seconds": 0.1, "parallel": False},
    ]}


def _run(*totals: float) -> dict[str, object]:
    return {"date": "d", "machine": "m", "description": "starts.", "starts": [_start(t) for t in totals]}


def test_a_slow_first_start_does_not_count_against_the_target() -> None:
    text = startup_section(_run(40.0, 6.1, 5.9))
    assert "| 1 | 40.0 s | 39.8 s | 3.0 s |" in text
    assert "met (slowest later start 6.1 s)" in text and "not met" not in text


def test_a_slow_later_start_misses_the_target() -> None:
    assert "not met (slowest later start 12.5 s)" in startup_section(_run(5.0, 12.5))


def test_one_start_gives_no_verdict() -> None:
    assert "target" not in startup_section(_run(5.0))

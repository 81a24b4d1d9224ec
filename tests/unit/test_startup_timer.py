"""The start-up timer: phases on a fake clock, the one-line summary, and reading it back."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from shared.startup_timer import Phase, StartupReport, StartupTimer, parse_summary


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_phases_are_timed_in_order_and_the_rest_is_other() -> None:
    clock = FakeClock()
    timer = StartupTimer(clock=clock, cpu_clock=None)
    clock.now += 0.5  # before the first phase: shows as other
    with timer.phase("imports"):
        clock.now += 2.9
    with timer.phase("model"):
        clock.now += 1.1
    timer.add("registration", 0.2)
    clock.now += 0.2
    report = timer.report()
    assert report.total_s == pytest.approx(4.7)
    assert [p.name for p in report.phases] == ["imports", "model", "registration"]
    assert report.seconds("model") == pytest.approx(1.1)
    assert report.summary() == "4.7 s (imports 2.9 s, model 1.1 s, registration 0.2 s, other 0.5 s)"


def test_a_phase_that_raises_is_still_recorded() -> None:
    clock = FakeClock()
    timer = StartupTimer(clock=clock, cpu_clock=None)
    with pytest.raises(RuntimeError), timer.phase("tokenizer"):
        clock.now += 0.3
        raise RuntimeError("no tokenizer")
    assert timer.report().seconds("tokenizer") == pytest.approx(0.3)


def test_parallel_phases_count_as_the_longest() -> None:
    report = StartupReport(8.4, (Phase("imports", 0.2), Phase("redis", 0.1, parallel=True),
                                 Phase("worker", 6.2, parallel=True), Phase("scheduler", 5.0, parallel=True),
                                 Phase("first lease", 0.3)))
    assert report.accounted_s == pytest.approx(0.2 + 6.2 + 0.3)
    assert report.summary() == ("8.4 s (imports 0.2 s, redis 0.1 s and worker 6.2 s and scheduler 5.0 s in parallel, "
                                "first lease 0.3 s, other 1.7 s)")


def test_the_summary_reads_back() -> None:
    report = StartupReport(8.43, (Phase("redis", 0.12, parallel=True), Phase("worker", 6.21, parallel=True),
                                  Phase("waiting for a worker", 1.0), Phase("first lease", 0.3)))
    parsed = parse_summary("2026-01-01 12:00:00,000 up INFO x: llmserve up: serving after " + report.summary())
    assert parsed.total_s == 8.4
    assert [(p.name, p.seconds, p.parallel) for p in parsed.phases] == [
        ("redis", 0.1, True), ("worker", 6.2, True), ("waiting for a worker", 1.0, False), ("first lease", 0.3, False),
        ("other", 0.9, False)]


def test_a_process_reports_its_cpu_time_too() -> None:
    clock, cpu = FakeClock(), FakeClock()
    timer = StartupTimer(clock=clock, cpu_clock=cpu)
    with timer.phase("imports"):
        clock.now += 4.0
        cpu.now = 2.5  # CPU time since the process started: a loaded machine's wall time is above it
    report = timer.report()
    assert report.cpu_s == 2.5
    assert report.summary() == "4.0 s (imports 4.0 s; 2.5 s of CPU)"
    assert parse_summary("worker ready in " + report.summary()) == report


def test_json_round_trip() -> None:
    for report in (StartupReport(3.0, (Phase("imports", 1.5), Phase("worker", 1.0, parallel=True))),
                   StartupReport(3.0, (Phase("imports", 1.5),), cpu_s=2.0)):
        assert StartupReport.from_dict(report.to_dict()) == report


@pytest.mark.parametrize("line", ["worker ready", "ready in 3.0 s", "ready in 3.0 s (imports)"])
def test_a_line_without_a_summary_is_refused(line: str) -> None:
    with pytest.raises(ValueError):
        parse_summary(line)


@pytest.mark.parametrize("name", ["", "a, b", "this and that"])
def test_phase_names_that_the_line_could_not_carry_are_refused(name: str) -> None:
    with pytest.raises(ValueError, match="phase name"):
        Phase(name, 1.0)


def test_negative_seconds_are_refused_and_added_ones_clamped() -> None:
    with pytest.raises(ValueError, match="non-negative"):
        Phase("model", -0.1)
    timer = StartupTimer(clock=FakeClock(), cpu_clock=None)
    timer.add("first lease", -0.001)  # two clocks a hair apart
    assert timer.report().seconds("first lease") == 0.0


def test_a_slow_phase_with_a_note_says_why_while_it_runs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="shared.startup_timer")
    timer = StartupTimer(cpu_clock=None)

    def said() -> list[str]:
        return [r.getMessage() for r in caplog.records if "still running" in r.getMessage()]

    with timer.phase("imports", note="compiling the kernels", slow_s=0.01):
        deadline = time.monotonic() + 30
        while not said() and time.monotonic() < deadline:  # the note comes from a timer thread
            time.sleep(0.01)
    assert said() == ["start-up: imports still running after 0 s: compiling the kernels"]
    # A phase without a note, however slow, says nothing until its summary.
    with timer.phase("model", slow_s=0.0):
        pass
    assert len(said()) == 1
    assert [p.name for p in timer.report().phases] == ["imports", "model"]


def test_a_phase_that_ends_in_time_cancels_its_note(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="shared.startup_timer")
    before = set(threading.enumerate())
    with StartupTimer(cpu_clock=None).phase("kernels", note="compiling", slow_s=600):
        (notice,) = set(threading.enumerate()) - before
    notice.join(timeout=30)  # cancelled: the timer thread ends at once instead of waiting out its 600 s
    assert not notice.is_alive() and not caplog.records

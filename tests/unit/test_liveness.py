"""Liveness as forward progress: the pure decision (shared/liveness.py)."""

from __future__ import annotations

import pytest

from shared.liveness import Activity, is_live, stalled_for


def test_an_idle_activity_is_live_however_long_ago_it_progressed() -> None:
    idle = Activity(has_work=False, last_progress=0.0)
    assert stalled_for(idle, 1e9) == 0.0
    assert is_live([idle], now=1e9, timeout_s=5.0)


def test_work_is_live_up_to_the_timeout_and_stalled_after_it() -> None:
    busy = Activity(has_work=True, last_progress=100.0)
    assert stalled_for(busy, 104.0) == 4.0
    assert is_live([busy], now=104.0, timeout_s=5.0)
    assert is_live([busy], now=105.0, timeout_s=5.0)  # exactly the timeout: not yet
    assert not is_live([busy], now=105.5, timeout_s=5.0)


def test_one_stalled_activity_among_several_makes_the_whole_unlive() -> None:
    fine = Activity(has_work=True, last_progress=99.0)
    idle = Activity(has_work=False, last_progress=0.0)
    stuck = Activity(has_work=True, last_progress=10.0)
    assert is_live([fine, idle], now=100.0, timeout_s=5.0)
    assert not is_live([fine, idle, stuck], now=100.0, timeout_s=5.0)
    assert is_live([], now=100.0, timeout_s=5.0)  # no engine loop at all is not a stall


def test_a_clock_that_reads_before_the_progress_is_no_stall() -> None:
    # last_progress is stamped by another task; a check may read `now` a moment before it.
    assert stalled_for(Activity(has_work=True, last_progress=10.0), 9.5) == 0.0


@pytest.mark.parametrize("timeout", [0.0, -1.0, float("nan")])
def test_the_timeout_must_be_positive(timeout: float) -> None:
    with pytest.raises(ValueError, match="timeout_s must be positive"):
        is_live([], now=0.0, timeout_s=timeout)

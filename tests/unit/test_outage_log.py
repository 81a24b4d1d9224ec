"""A periodic task's failures are logged as an outage: its start, a reminder every so often, its end."""

from __future__ import annotations

import logging

import pytest

from shared.outage_log import OutageLog


def test_an_outage_is_logged_at_its_start_every_reminder_and_its_end(caplog: pytest.LogCaptureFixture) -> None:
    now = [100.0]
    outage = OutageLog(logging.getLogger("t"), "heartbeat to Redis", every_s=30.0, clock=lambda: now[0])
    caplog.set_level(logging.WARNING, logger="t")
    outage.succeeded()  # no outage: nothing
    for _ in range(61):  # a failure every second for a minute
        outage.failed(ConnectionError("refused"))
        now[0] += 1.0
    outage.succeeded()
    outage.succeeded()
    assert [r.getMessage() for r in caplog.records] == [
        "heartbeat to Redis failed: refused (retrying; repeats are logged every 30 s)",
        "heartbeat to Redis still failing: 31 failed attempt(s), the first 30 s ago; the latest: refused",
        "heartbeat to Redis still failing: 61 failed attempt(s), the first 60 s ago; the latest: refused",
        "heartbeat to Redis works again: 61 failed attempt(s), the first 61.0 s ago",
    ]
    caplog.clear()
    outage.failed(ConnectionError("again"))  # a new outage starts its own count
    assert [r.getMessage() for r in caplog.records] == [
        "heartbeat to Redis failed: again (retrying; repeats are logged every 30 s)"]

"""Logging a periodic task that keeps failing (Redis away): once when it starts, then a reminder, then its end.

A heartbeat every 2 s or a supervisor tick every second that logged each failure wrote 30-60 identical warnings
a minute of a Redis outage, which buried everything else in the log. Now an operator reads when the outage began
(with its first error), a reminder every ``every_s`` with the failures so far and the latest error, and how many
there were once the task succeeds again. (Times count from the first failure, which a Redis that stopped answering
reports only when its socket times out.)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

REMIND_EVERY_S = 30.0


class OutageLog:
    """Failures and recoveries of one periodic task, logged as an outage (``what``: e.g. "heartbeat to Redis")."""

    def __init__(self, log: logging.Logger, what: str, every_s: float = REMIND_EVERY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._log, self._what, self._every_s, self._clock = log, what, every_s, clock
        self._since: float | None = None  # when the current outage began (None: the task succeeds)
        self._reminded = 0.0
        self._failures = 0

    def failed(self, exc: BaseException) -> None:
        now = self._clock()
        self._failures += 1
        if self._since is None:
            self._since = self._reminded = now
            self._log.warning("%s failed: %s (retrying; repeats are logged every %.0f s)", self._what, exc, self._every_s)
        elif now - self._reminded >= self._every_s:
            self._reminded = now
            self._log.warning("%s still failing: %d failed attempt(s), the first %.0f s ago; the latest: %s", self._what,
                              self._failures, now - self._since, exc)

    def succeeded(self) -> None:
        if self._since is not None:
            self._log.warning("%s works again: %d failed attempt(s), the first %.1f s ago", self._what, self._failures,
                              self._clock() - self._since)
            self._since, self._failures = None, 0

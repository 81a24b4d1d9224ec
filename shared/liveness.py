"""Liveness as forward progress (pure): work that makes no progress for too long is a stall.

A process whose threads all answer health checks may still be wedged: an engine loop that holds
requests but completes no step, a worker whose forward pass never returns. Liveness therefore
asks "does the work move?", not "does the server answer?":

    has work?  no  ──▶ live (an idle loop is alive, however long ago it last stepped)
               yes ──▶ live while now - last_progress <= timeout

Both services use it: the scheduler for each engine loop (progress = a completed step), the worker
for the step it executes (progress = the step's start, so a step running past the timeout stalls).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Activity:
    """What one unit of work reports for liveness.

    has_work: it holds work it should be making progress on.
    last_progress: time.monotonic() of its last progress (or of the moment it got work).
    """

    has_work: bool
    last_progress: float


def stalled_for(activity: Activity, now: float) -> float:
    """Seconds the activity has gone without progress while holding work (0 when idle)."""
    if not activity.has_work:
        return 0.0
    return max(0.0, now - activity.last_progress)


def is_live(activities: Iterable[Activity], now: float, timeout_s: float) -> bool:
    """True unless some activity holds work and made no progress for more than `timeout_s` seconds."""
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s}")
    return all(stalled_for(a, now) <= timeout_s for a in activities)

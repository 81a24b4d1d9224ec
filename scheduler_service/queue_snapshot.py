"""What of an engine loop's queues and cache changed since its last commit, written into the next one."""

from __future__ import annotations

from scheduler_service.core.scheduler import Scheduler
from scheduler_service.store import CacheStats, StepCommit


class QueueSnapshot:
    """Queue order and free blocks go into a commit only when they changed (an idle loop writes nothing)."""

    def __init__(self) -> None:
        self._waiting: list[str] | None = None
        self._running: list[str] | None = None
        self._swapped: list[str] | None = None
        self._stats: CacheStats | None = None

    def write(self, scheduler: Scheduler, commit: StepCommit) -> None:
        bm = scheduler.block_manager
        waiting = [g.request_id for g in scheduler.waiting]
        running = [g.request_id for g in scheduler.running]
        swapped = [g.request_id for g in scheduler.swapped]
        # Only the requests that just started running leave the admission queue count: sending the whole
        # running list would cost Redis a lookup per running request whenever the list changes.
        before = set(self._running or ()) | set(self._swapped or ())
        commit.newly_scheduled.extend(r for r in running + swapped if r not in before)
        commit.waiting = waiting if waiting != self._waiting else None
        commit.running = running if running != self._running else None
        commit.swapped = swapped if swapped != self._swapped else None
        self._waiting, self._running, self._swapped = waiting, running, swapped
        prefix = bm.prefix_cache_stats
        stats = CacheStats(bm.num_free_gpu_blocks, bm.num_gpu_blocks, prefix.queries, prefix.hits)
        commit.cache_stats = stats if stats != self._stats else None
        self._stats = stats

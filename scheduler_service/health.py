"""A scheduler replica's liveness and readiness, evaluated periodically (see shared/health_probes.py).

live:  every engine loop of this replica either holds no request or completed a step within the
       liveness timeout (shared/liveness.py). A worker that hangs is first the step timeout's
       business (the loop resets it and recomputes); the liveness timeout is much longer, so that
       it catches a loop that is itself wedged, which only a restart mends.
ready: Redis answers and at least one routable worker (alive, not draining) is registered, as the
       supervisor last read the registry; without either this replica cannot admit a request.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

from scheduler_service.engine_loop import EngineLoop
from scheduler_service.router import Router
from scheduler_service.store import RedisStore
from shared.health_probes import HealthState
from shared.liveness import Activity, is_live, stalled_for

# A ping slower than this counts as Redis not answering (the client's own socket timeout is 30 s).
REDIS_PING_TIMEOUT_SECONDS = 2.0


class SchedulerHealth:
    """Evaluates the replica's health from its engine loops, its router's view and a Redis ping."""

    def __init__(self, loops: Callable[[], Sequence[EngineLoop]], router: Router, store: RedisStore,
                 liveness_timeout_s: float, ping_timeout_s: float = REDIS_PING_TIMEOUT_SECONDS) -> None:
        self._loops = loops
        self._router = router
        self._store = store
        self._timeout_s = liveness_timeout_s
        self._ping_timeout_s = ping_timeout_s

    async def evaluate(self) -> HealthState:
        now = time.monotonic()
        loops = list(self._loops())
        # A loop has work while any of its requests is waiting, running or swapped.
        activities = [Activity(has_work=not loop.is_idle, last_progress=loop.last_progress) for loop in loops]
        live = is_live(activities, now, self._timeout_s)
        stalls = [] if live else [(loop, stalled_for(a, now)) for loop, a in zip(loops, activities)]
        reasons = [
            f"the engine loop of worker {loop.worker_id} has work but completed no step for "
            f"{stalled:.1f}s (--liveness-timeout {self._timeout_s:g}s)"
            for loop, stalled in stalls if stalled > self._timeout_s
        ]
        redis_ok = await self._redis_answers()
        if not redis_ok:
            reasons.append(f"Redis did not answer a ping within {self._ping_timeout_s:g}s")
        if self._router.num_workers == 0:
            reasons.append("no routable worker is registered")
        ready = redis_ok and self._router.num_workers > 0
        return HealthState(live=live, ready=ready, reason="; ".join(reasons))

    async def _redis_answers(self) -> bool:
        try:
            await asyncio.wait_for(self._store.ping(), self._ping_timeout_s)
        except Exception:  # noqa: BLE001 - any failure (timeout, connection, auth) means not ready
            return False
        return True

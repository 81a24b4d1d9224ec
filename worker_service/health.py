"""A worker's liveness and readiness, evaluated periodically (see shared/health_probes.py).

live:  no forward pass has been running for longer than the liveness timeout. The scheduler gives
       up on a step after its step timeout, but the pass goes on in the worker's thread and keeps
       the step lock: only a restart frees a worker stuck there (a wedged GPU, a deadlocked kernel).
ready: the model is loaded (the server starts only then), the worker is registered in Redis when it
       registers at all, and it is not stopping (draining on SIGTERM).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from shared.health_probes import HealthState
from shared.liveness import Activity, is_live, stalled_for


class WorkerHealth:
    """Evaluates the worker's health from its current step and its registration."""

    def __init__(self, step_activity: Callable[[], Activity], liveness_timeout_s: float,
                 registered: Callable[[], bool] | None = None) -> None:
        """registered: whether the worker's registration reached Redis; None when it does not register."""
        self._step_activity = step_activity
        self._timeout_s = liveness_timeout_s
        self._registered = registered
        self.stopping = False

    async def evaluate(self) -> HealthState:
        now = time.monotonic()
        step = self._step_activity()
        live = is_live([step], now, self._timeout_s)
        reasons = [] if live else [
            f"a step has been executing for {stalled_for(step, now):.1f}s (--liveness-timeout {self._timeout_s:g}s)"]
        registered = self._registered is None or self._registered()
        if not registered:
            reasons.append("not registered in Redis yet")
        if self.stopping:
            reasons.append("draining for shutdown")
        return HealthState(live=live, ready=registered and not self.stopping, reason="; ".join(reasons))

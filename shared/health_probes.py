"""What grpc.health.v1 answers to probes: liveness and readiness as separate service names.

    service name            meaning                                  Kubernetes probe
    "liveness"              the process makes progress on its work   livenessProbe, startupProbe
    "readiness"             it can take traffic now                  readinessProbe
    "" and the service's    the same as "readiness" (what clients,
    own name (e.g.          the HTTP front and `LocalCluster` have
    llmserve.v1.Generation) always checked)

Kubernetes restarts a container whose liveness fails and stops routing to one that is not ready;
keeping them apart lets a replica that cannot admit (Redis away, no worker) sit out without being
killed, and kills one whose engine loop is wedged although its port still answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from grpc_health.v1 import health, health_pb2

log = logging.getLogger(__name__)

LIVENESS = "liveness"
READINESS = "readiness"

_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@dataclass(frozen=True)
class HealthState:
    """One evaluation of a service's health; `reason` says why it is not live or not ready (logs)."""

    live: bool
    ready: bool
    reason: str = ""


class HealthReporter:
    """Sets the liveness and readiness statuses on a health servicer, logging each change."""

    def __init__(self, servicer: health.aio.HealthServicer, service_names: list[str]) -> None:
        self._servicer = servicer
        self._ready_names = ["", READINESS, *service_names]
        self._state: HealthState | None = None
        # Set while the published state is ready: start-up announcements wait on it instead of polling.
        self._ready = asyncio.Event()

    @property
    def state(self) -> HealthState | None:
        """The last state set (None before the first)."""
        return self._state

    async def set(self, state: HealthState) -> None:
        """Publishes `state`; statuses are written only when they change."""
        before = self._state
        self._state = state
        if before is None or before.live != state.live:
            await self._servicer.set(LIVENESS, _SERVING if state.live else _NOT_SERVING)
            if before is not None:
                _log_change("live", state.live, state.reason)
        if before is None or before.ready != state.ready:
            for name in self._ready_names:
                await self._servicer.set(name, _SERVING if state.ready else _NOT_SERVING)
            if before is not None:
                _log_change("ready", state.ready, state.reason)
        if self._state is state:  # not overtaken by a later set() while this one wrote
            (self._ready.set if state.ready else self._ready.clear)()

    async def wait_ready(self) -> None:
        """Returns once the published readiness is SERVING (at once if it is)."""
        await self._ready.wait()


def _log_change(what: str, now_ok: bool, reason: str) -> None:
    if now_ok:
        log.info("health: %s again", what)
    else:
        log.warning("health: no longer %s: %s", what, reason or "(no reason given)")


async def watch_health(reporter: HealthReporter, evaluate: Callable[[], Awaitable[HealthState]],
                       period_s: float, stop: asyncio.Event) -> None:
    """Re-evaluates health every `period_s` seconds until `stop` is set.

    An evaluation that raises is logged and skipped (the last statuses stay): a probe must never
    take the service down, and a bug here should not flap liveness.
    """
    if not period_s > 0:
        raise ValueError(f"period_s must be positive, got {period_s}")
    while not stop.is_set():
        try:
            await reporter.set(await evaluate())
        except Exception:  # noqa: BLE001 - see the docstring
            log.exception("health evaluation failed")
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), period_s)

"""Which engine loops this replica runs: leases over the registered workers, renewed every tick.

Every tick (a fraction of the lease TTL) the supervisor
  1. reads the worker registry and hands the routable workers to the router;
  2. renews the leases it holds in one round trip, and cancels at once the loop of any lease it lost
     (another replica drives that worker now; the fenced commit would refuse its writes anyway);
  3. takes free leases while it runs fewer loops than its fair share, ceil(workers / live replicas),
     and gives back an idle loop's lease when it runs more (its lightest busy one if none falls idle
     for REBALANCE_AFTER_TTLS lease TTLs), so replicas added later get work even under load;
  4. tells each loop what the registry says of its worker (draining, gone).

A replica that dies simply stops renewing: its leases expire after the TTL and the other replicas'
next tick takes them over, rebuilding each loop's state from Redis.

A front-only replica (`--front-only`) does step 1 alone: it serves clients (admission routes their requests
to workers' inboxes, their streams are read from Redis) and drives no worker, and it stays out of the
roster, so the replicas that drive workers share them among themselves. The per-token cost of the client
streams then runs on other cores than the engine loops' per-step cost (docs/scaling.md).

A worker that registers, starts draining or leaves announces it (shared/registry_changes.py): the
next tick comes at once rather than up to a tick later, so a new worker's lease is taken (and a
draining one's waiting requests handed over) the moment the registry shows it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

from redis.exceptions import RedisError

from scheduler_service.engine_loop import EngineLoop
from scheduler_service.leases import LeaseLostError, Leases
from scheduler_service.router import Router
from shared.errors import UnavailableError
from shared.outage_log import OutageLog
from shared.registry_changes import RegistryChanges
from shared.worker_registry import WorkerEntry, WorkerRegistry

log = logging.getLogger(__name__)

# How long (in lease TTLs) a replica above its fair share waits for a loop to fall idle before it gives
# back a busy one (rare: the new owner continues that worker's running requests from the state in Redis).
REBALANCE_AFTER_TTLS = 3
# After adopting a worker no replica drove for a TTL, how long (in lease TTLs) the replica keeps all its
# loops rather than balancing them away again.
ADOPTION_HOLD_TTLS = 10


@dataclass
class _Running:
    loop: EngineLoop
    task: asyncio.Task[None]
    stop: asyncio.Event


class Supervisor:
    """Starts, feeds and stops this replica's engine loops."""

    def __init__(self, registry: WorkerRegistry, leases: Leases, router: Router,
                 make_loop: Callable[[WorkerEntry], EngineLoop], changes: RegistryChanges,
                 tick_s: float | None = None, drives_workers: bool = True) -> None:
        """changes: registry changes that bring the next tick forward (its listener runs elsewhere);
        drives_workers: False for a front-only replica (routes requests, takes no lease)."""
        self._drives_workers = drives_workers
        self._registry = registry
        self._changes = changes
        self._leases = leases
        self._router = router
        self._make_loop = make_loop
        # Renewing at least three times per TTL survives a slow tick without losing a lease; at most a
        # second apart, so that a worker that drains or leaves is noticed quickly.
        self._tick_s = tick_s if tick_s is not None else min(leases.ttl_s / 3, 1.0)
        self._running: dict[str, _Running] = {}
        # Seconds until the next tick: shorter than tick_s when a lease this replica could take expires sooner.
        self._next_wait = self._tick_s
        # Since when (event-loop time) this replica has run more loops than its share, none of them idle.
        self._surplus_since: float | None = None
        # Workers whose lease this replica saw free, and since when (event-loop time).
        self._free_since: dict[str, float] = {}
        # No giving back (event-loop time) before this: set when the replica adopts an undriven worker.
        self._balance_after = 0.0

    @property
    def worker_ids(self) -> list[str]:
        """Workers whose engine loop this replica runs."""
        return sorted(self._running)

    @property
    def loops(self) -> list[EngineLoop]:
        """The engine loops still running (liveness reads their progress); ended ones await the next tick."""
        return [r.loop for r in self._running.values() if not r.task.done()]

    async def run(self, stop: asyncio.Event) -> None:
        """Ticks until `stop` is set, then stops every loop cleanly and gives its lease back."""
        outage = OutageLog(log, "supervisor tick on Redis")
        try:
            while not stop.is_set():
                try:
                    await self.tick()
                except (RedisError, OSError, UnavailableError) as exc:
                    # Redis restarting: the loops keep what they hold until their leases lapse; the next tick retries.
                    outage.failed(exc)
                except Exception:  # noqa: BLE001 - no bug in one tick may end the replica; the next tick retries
                    log.exception("supervisor tick failed")
                else:
                    outage.succeeded()
                # Until the next tick is due, `stop` is set, or a worker registers, drains or leaves.
                await self._changes.wait(self._next_wait, stop)
        finally:
            await self._stop_all()

    async def tick(self) -> None:
        entries = await self._registry.workers()
        self._router.update(entries)
        if not self._drives_workers:
            return
        replicas = await self._leases.announce()
        await self._renew()
        await self._reap()
        by_id = {e.worker_id: e for e in entries}
        share = math.ceil(len(entries) / max(replicas, 1))
        orphans = await self._orphans(entries)
        for entry in entries:
            if entry.worker_id in self._running:
                continue
            # Beyond its share only for a worker nobody has driven for a whole TTL: the replica whose share
            # it is may be stuck, and an undriven worker strands its requests.
            below = len(self._running) < share
            if (below or entry.worker_id in orphans) and await self._leases.acquire(entry.worker_id):
                self._start(entry)
                if not below:
                    # The replicas whose share it was did not take it: no balancing for a while, or the
                    # worker would bounce between being given back and adopted again.
                    self._balance_after = asyncio.get_running_loop().time() + ADOPTION_HOLD_TTLS * self._leases.ttl_s
        if asyncio.get_running_loop().time() >= self._balance_after:
            await self._give_back_idle(share)
            await self._rebalance_busy(share)
        # Below its share, the replica wakes when the next lease held elsewhere expires, so that a dead
        # replica's workers move on within the TTL of its last renewal rather than up to a tick later.
        self._next_wait = self._tick_s
        if len(self._running) < share:
            expiry = await self._leases.expiring([e.worker_id for e in entries if e.worker_id not in self._running])
            if expiry is not None:
                self._next_wait = min(self._tick_s, expiry + 0.005)
        for worker_id, running in self._running.items():
            running.loop.observe_registration(by_id.get(worker_id))

    async def _renew(self) -> None:
        held = await self._leases.renew(list(self._running))
        for worker_id, ok in held.items():
            if not ok:
                log.warning("lost the lease of worker %s: stopping its engine loop", worker_id)
                self._running.pop(worker_id).task.cancel()

    async def _reap(self) -> None:
        """Gives back the leases of loops that ended on their own (lease lost at a commit, worker evacuated, error)."""
        for worker_id in [w for w, r in self._running.items() if r.task.done()]:
            task = self._running.pop(worker_id).task
            exc = None if task.cancelled() else task.exception()
            if isinstance(exc, (LeaseLostError, UnavailableError)):
                # Expected faults: another replica took over, or Redis went away; the next ticks take the
                # lease again if it is free and restart the loop from the state in Redis.
                log.warning("engine loop for %s stopped: %s", worker_id, exc)
            elif exc is not None:
                log.error("engine loop for %s failed", worker_id, exc_info=exc)
            else:
                log.info("engine loop for %s ended", worker_id)
            await self._leases.release(worker_id)

    def _start(self, entry: WorkerEntry) -> None:
        loop = self._make_loop(entry)
        loop.observe_registration(entry)
        stop = asyncio.Event()
        task = asyncio.create_task(loop.run(stop), name=f"engine-{entry.worker_id}")
        self._running[entry.worker_id] = _Running(loop, task, stop)
        log.info("took the lease of worker %s", entry.worker_id)

    async def _give_back_idle(self, share: int) -> None:
        surplus = max(0, len(self._running) - share)
        for worker_id in [w for w, r in self._running.items() if r.loop.is_idle][:surplus]:
            await self._stop(worker_id)
            log.info("gave back the lease of idle worker %s to balance the replicas", worker_id)

    async def _orphans(self, entries: list[WorkerEntry]) -> set[str]:
        """Workers whose lease has been free for more than a TTL, as seen over this replica's ticks."""
        others = [e.worker_id for e in entries if e.worker_id not in self._running]
        owners = await self._leases.owners(others)
        now = asyncio.get_running_loop().time()
        self._free_since = {w: self._free_since.get(w, now) for w, owner in owners.items() if not owner}
        return {w for w, since in self._free_since.items() if now - since > self._leases.ttl_s}

    async def _rebalance_busy(self, share: int) -> None:
        """Above its share for REBALANCE_AFTER_TTLS TTLs with no idle loop: gives back the lightest busy one."""
        if len(self._running) <= share:
            self._surplus_since = None
            return
        now = asyncio.get_running_loop().time()
        if self._surplus_since is None:
            self._surplus_since = now
            return
        if now - self._surplus_since < REBALANCE_AFTER_TTLS * self._leases.ttl_s:
            return
        worker_id = min(self._running, key=lambda w: self._running[w].loop.num_requests)
        requests = self._running[worker_id].loop.num_requests
        await self._stop(worker_id)
        self._surplus_since = None
        log.info("gave back the lease of worker %s (%d request(s), continued by its next owner on the worker's KV "
                 "cache) to balance the replicas", worker_id, requests)

    async def _stop(self, worker_id: str) -> None:
        running = self._running.pop(worker_id)
        running.stop.set()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.shield(running.task), self._leases.ttl_s)
        running.task.cancel()
        with contextlib.suppress(Exception):
            await self._leases.release(worker_id)

    async def _stop_all(self) -> None:
        for worker_id in list(self._running):
            await self._stop(worker_id)
        if self._drives_workers:
            with contextlib.suppress(Exception):
                await self._leases.withdraw()

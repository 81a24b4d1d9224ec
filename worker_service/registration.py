"""The worker's entry in the Redis registry: heartbeats while it runs, a drain when it is asked to stop.

Stopping (SIGTERM, e.g. a Kubernetes rolling update) goes:

    draining=true ──▶ the owning scheduler routes nothing new here, hands the requests that have
                      not started to other workers, lets the running ones finish, then marks the
                      worker drained
    drained (or --drain-timeout) ──▶ deregister ──▶ the gRPC server stops

Whatever is still here at the timeout is recomputed elsewhere: the owner sees the worker leave the
registry and hands its remaining requests over with their committed outputs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from protos import worker_pb2
from shared.outage_log import OutageLog
from shared.redis_client import RedisOptions
from shared.worker_registry import WorkerRegistry

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RegistrationConfig:
    """How the worker announces itself.

    redis_url: the scheduling state's Redis; the worker registers there.
    advertise_address: host:port schedulers dial (in Kubernetes, the pod's stable DNS name).
    heartbeat_ttl_s: the worker counts as gone this long after its last heartbeat (sent every third of it).
    drain_timeout_s: longest wait on shutdown for the owner to finish or hand over this worker's requests.
    redis: AUTH password and TLS CA for redis_url (--redis-password-file, --redis-ca-file).
    """

    redis_url: str
    advertise_address: str
    heartbeat_ttl_s: float = 6.0
    drain_timeout_s: float = 30.0
    redis: RedisOptions = field(default_factory=RedisOptions)

    def __post_init__(self) -> None:
        host, sep, port = self.advertise_address.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"advertise_address must be host:port, got {self.advertise_address!r}")
        if not self.heartbeat_ttl_s >= 1:
            raise ValueError(f"heartbeat_ttl_s must be at least 1 second, got {self.heartbeat_ttl_s}")
        if self.drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s must be non-negative, got {self.drain_timeout_s}")


class Registration:
    """Keeps one worker registered while `run` runs; `drain` then `leave` on the way out."""

    def __init__(self, registry: WorkerRegistry, config: RegistrationConfig,
                 describe: Callable[[], worker_pb2.WorkerDescription]) -> None:
        self._registry = registry
        self._config = config
        self._describe = describe
        self._draining = False
        # Set by the first heartbeat that reaches Redis: the worker's readiness and its start-up line wait on it.
        self._first_beat = asyncio.Event()
        # The draining flag schedulers last heard of (CHANGES_CHANNEL); None before the first heartbeat.
        self._announced: bool | None = None
        self._wake = asyncio.Event()

    @property
    def worker_id(self) -> str:
        return self._config.advertise_address

    @property
    def registered(self) -> bool:
        """A heartbeat has reached Redis: schedulers can find this worker (its readiness waits for it)."""
        return self._first_beat.is_set()

    async def beat(self) -> None:
        """One heartbeat (also the registration itself).

        The first one, and the first after draining begins, are announced to listening schedulers, which
        then take the worker's lease (or hand its waiting requests over) at once instead of at their next tick.
        """
        draining = self._draining
        await self._registry.heartbeat(self.worker_id, self._describe(), draining, self._config.heartbeat_ttl_s,
                                       announce=draining != self._announced)
        self._announced = draining
        self._first_beat.set()

    async def wait_registered(self) -> None:
        """Returns once a heartbeat has reached Redis (at once if one has)."""
        await self._first_beat.wait()

    async def run(self) -> None:
        """Heartbeats until cancelled; a failed heartbeat is logged and retried (Redis may be restarting)."""
        interval = self._config.heartbeat_ttl_s / 3
        outage = OutageLog(log, "heartbeat to Redis")
        while True:
            try:
                await self.beat()
            except Exception as exc:  # noqa: BLE001 - the worker keeps serving its owner while Redis is away
                outage.failed(exc)
            else:
                outage.succeeded()
            self._wake.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), interval)

    async def drain(self) -> bool:
        """Marks the worker draining and waits for its owner to report it drained; False on timeout."""
        self._draining = True
        self._wake.set()  # the next heartbeat carries the flag now, not in a third of a TTL
        instance = self._describe().instance_id
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._config.drain_timeout_s
        log.info("draining: waiting up to %.0fs for the scheduler to finish or hand over this worker's requests",
                 self._config.drain_timeout_s)
        while loop.time() < deadline:
            try:
                if await self._registry.is_drained(self.worker_id, instance):
                    log.info("drained")
                    return True
            except Exception as exc:  # noqa: BLE001
                log.warning("could not read the drain state from Redis: %s", exc)
            await asyncio.sleep(0.5)
        log.warning("drain timed out after %.0fs; the scheduler recomputes what is left elsewhere",
                    self._config.drain_timeout_s)
        return False

    async def leave(self) -> None:
        """Deregisters (unless another process took over this id meanwhile)."""
        try:
            await self._registry.deregister(self.worker_id, self._describe().instance_id)
        except Exception as exc:  # noqa: BLE001
            log.warning("could not deregister from Redis: %s", exc)

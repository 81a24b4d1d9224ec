"""Wakes a scheduler the moment a worker registers, starts draining or leaves, rather than at its next read.

Workers publish their id on CHANGES_CHANNEL with those registry writes (shared/worker_registry.py).
A scheduler replica listens on one subscription; its start-up wait for a first worker and its
supervisor's ticks wait on `wait()`, which returns at the first change or at their own timeout.

A message is a hint, never the state: one published while the subscription is down (Redis
restarting) is lost. So every waiter keeps its timeout and reads the registry itself, and a
(re)subscription counts as a change, since anything may have happened while no one listened.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from shared.worker_registry import CHANGES_CHANNEL

log = logging.getLogger(__name__)

# How long one read of the subscription blocks before the listener checks whether it should stop.
_LISTEN_S = 1.0
# Pause before subscribing again after a failure.
_RETRY_S = 1.0


class RegistryChanges:
    """One replica's subscription to worker-registry changes; `run` listens, `wait` waits for the next one."""

    def __init__(self, client: aioredis.Redis) -> None:
        self._client = client
        self._changed = asyncio.Event()

    async def run(self, stop: asyncio.Event) -> None:
        """Listens until `stop` is set, subscribing again after a failure."""
        failures = 0
        while not stop.is_set():
            pubsub = self._client.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(CHANGES_CHANNEL)
                self._changed.set()
                failures = 0
                while not stop.is_set():
                    if await pubsub.get_message(timeout=_LISTEN_S) is not None:
                        self._changed.set()
            except (RedisError, OSError) as exc:
                failures += 1
                # Redis away is the supervisor's warning to give; this only slows its reaction to a tick.
                (log.info if failures == 1 else log.debug)("worker-registry subscription lost: %s", exc)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), _RETRY_S)
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()

    async def wait(self, timeout_s: float, stop: asyncio.Event | None = None) -> bool:
        """Waits up to `timeout_s` for a change since the last wait returned (or for `stop`); True on a change.

        Read the registry after it returns: a change that comes during the read wakes the next wait.
        """
        waits = [asyncio.ensure_future(self._changed.wait())]
        if stop is not None:
            waits.append(asyncio.ensure_future(stop.wait()))
        try:
            await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiting in waits:
                waiting.cancel()
        changed = self._changed.is_set()
        self._changed.clear()
        return changed

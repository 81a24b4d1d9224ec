"""Leases on workers' engine loops, with fencing epochs, and the roster of scheduler replicas.

    llmserve:w:<worker>:lease   string  owning replica id, expires after the lease TTL
    llmserve:w:<worker>:epoch   counter fencing epoch (scheduler_service.keys.epoch)
    llmserve:schedulers         zset    replica id -> time (ms) until which it counts as alive (half a TTL)

A replica drives a worker only while it holds the worker's lease. Every new epoch is taken
atomically with a check that the caller still holds the lease, so a replica that lost its lease
(paused past the TTL, partitioned) can never take an epoch above the new owner's and reset the
worker under it; plans and step commits carry the epoch and are refused once a newer one exists.
"""

from __future__ import annotations

import time

import redis.asyncio as aioredis

from scheduler_service import keys

SCHEDULERS = "llmserve:schedulers"


def lease_key(worker_id: str) -> str:
    """String: the replica that owns the worker's engine loop; expires unless renewed."""
    return f"{keys.PREFIX}:w:{worker_id}:lease"


# KEYS: lease; ARGV: replica id, ttl ms. Takes a free lease or renews one's own; 1 when held after the call.
_ACQUIRE_LUA = """
local owner = redis.call('GET', KEYS[1])
if owner and owner ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""

# KEYS: lease; ARGV: replica id, ttl ms. Renews only a lease the replica still holds.
_RENEW_LUA = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"""

# KEYS: lease, epoch; ARGV: replica id, floor. A new epoch above the floor for the holder of the lease,
# 0 for anyone else.
_NEXT_EPOCH_LUA = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
local epoch = redis.call('INCR', KEYS[2])
local floor = tonumber(ARGV[2])
if epoch <= floor then
  epoch = floor + 1
  redis.call('SET', KEYS[2], epoch)
end
return epoch
"""

# KEYS: lease; ARGV: replica id. Gives the lease back if the replica holds it.
_RELEASE_LUA = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
return redis.call('DEL', KEYS[1])
"""


class LeaseLostError(RuntimeError):
    """The replica no longer holds the worker's lease: another replica drives the worker now."""


class Leases:
    """One replica's view of the leases: acquire, renew, fence, release."""

    def __init__(self, client: aioredis.Redis, replica_id: str, ttl_s: float) -> None:
        """ttl_s: positive (SchedulerServiceConfig checks it)."""
        self._r = client
        self.replica_id = replica_id
        self.ttl_s = ttl_s
        self._ttl_ms = int(ttl_s * 1000)

    async def acquire(self, worker_id: str) -> bool:
        """Takes the worker's lease if nobody holds it (or renews it if this replica does)."""
        return bool(await self._r.eval(_ACQUIRE_LUA, 1, lease_key(worker_id), self.replica_id, self._ttl_ms))

    async def renew(self, worker_ids: list[str]) -> dict[str, bool]:
        """Renews the given leases in one round trip; False for each one this replica lost."""
        if not worker_ids:
            return {}
        async with self._r.pipeline(transaction=False) as pipe:
            for worker_id in worker_ids:
                pipe.eval(_RENEW_LUA, 1, lease_key(worker_id), self.replica_id, self._ttl_ms)
            held = await pipe.execute()
        return {w: bool(h) for w, h in zip(worker_ids, held)}

    async def next_epoch(self, worker_id: str, above: int = 0) -> int:
        """A new fencing epoch for the worker, greater than `above` too; raises LeaseLostError if the lease is
        no longer ours.

        above: the newest epoch the worker is known to have seen. The counter in Redis is always ahead of it,
        unless Redis lost its data (restarted without persistence, a failover to a replica that missed writes):
        then the counter starts again from 0 and, without the floor, the worker would refuse every epoch until
        as many had been taken as it has seen.
        """
        epoch = int(await self._r.eval(_NEXT_EPOCH_LUA, 2, lease_key(worker_id), keys.epoch(worker_id),
                                       self.replica_id, above))
        if epoch == 0:
            raise LeaseLostError(f"replica {self.replica_id} no longer holds the lease of worker {worker_id}")
        return epoch

    async def release(self, worker_id: str) -> None:
        """Gives the lease back at once (clean shutdown, surplus), so another replica need not wait for the TTL."""
        await self._r.eval(_RELEASE_LUA, 1, lease_key(worker_id), self.replica_id)

    async def owners(self, worker_ids: list[str]) -> dict[str, str]:
        """worker id -> owning replica id ("" when free), in one round trip."""
        if not worker_ids:
            return {}
        values = await self._r.mget([lease_key(w) for w in worker_ids])
        return {w: v.decode() if v is not None else "" for w, v in zip(worker_ids, values)}

    async def expiring(self, worker_ids: list[str]) -> float | None:
        """Seconds until the first of these leases (held by anyone) expires; None if none is held."""
        if not worker_ids:
            return None
        async with self._r.pipeline(transaction=False) as pipe:
            for worker_id in worker_ids:
                pipe.pttl(lease_key(worker_id))
            remaining = [ms for ms in await pipe.execute() if ms >= 0]
        return min(remaining) / 1000 if remaining else None

    async def announce(self) -> int:
        """Marks this replica alive for half a TTL and returns how many replicas are alive (itself included).

        Half: a dead replica leaves the roster before its leases expire, so the survivors' fair share
        has grown by the time those leases come free, and they take them at once.
        """
        now_ms = int(time.time() * 1000)
        async with self._r.pipeline(transaction=True) as pipe:
            pipe.zadd(SCHEDULERS, {self.replica_id: now_ms + self._ttl_ms // 2})
            pipe.zremrangebyscore(SCHEDULERS, "-inf", now_ms)
            pipe.zcard(SCHEDULERS)
            _, _, alive = await pipe.execute()
        return int(alive)

    async def withdraw(self) -> None:
        """Leaves the roster (clean shutdown)."""
        await self._r.zrem(SCHEDULERS, self.replica_id)

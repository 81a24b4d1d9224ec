"""The worker registry in Redis: which workers exist, whether they are alive, whether they are draining.

    llmserve:workers                 hash   worker id -> WorkerRegistration (protobuf)
    llmserve:worker:<id>:heartbeat   string the worker's instance id, expires after the heartbeat TTL
    llmserve:worker:<id>:drained     string the instance id, set by the owner once a draining worker is empty
    llmserve:workers:changed         channel a worker's id, published when it registers, starts draining or leaves

Workers write both (the registration again on every heartbeat, so a registry that was lost with
Redis fills again); schedulers only read them. A worker whose heartbeat key expired is dead for
routing and leases, whatever its registration says. The key names live here rather than in
scheduler_service.keys because both services use them.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import redis.asyncio as aioredis

from protos import state_pb2, worker_pb2

WORKERS = "llmserve:workers"
# Schedulers listen here to act on a change at once rather than at their next read of the registry
# (shared/registry_changes.py); the registry itself stays the truth, a lost message only delays.
CHANGES_CHANNEL = "llmserve:workers:changed"

# A restarted worker re-registers under the same id: only a registration without a heartbeat is dropped.
#   KEYS: heartbeat key, WORKERS; ARGV: worker id
_FORGET_IF_DEAD_LUA = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('DEL', unpack(KEYS, 3))
return 1
"""


def heartbeat_key(worker_id: str) -> str:
    """String: the worker's instance id while it is alive (expires after the heartbeat TTL)."""
    return f"llmserve:worker:{worker_id}:heartbeat"


def drained_key(worker_id: str) -> str:
    """String: set by the worker's owner to the instance id once that draining instance has no requests left."""
    return f"llmserve:worker:{worker_id}:drained"


# How long the drained mark outlives the worker's wait for it.
DRAINED_TTL_SECONDS = 600


@dataclass(frozen=True)
class WorkerEntry:
    """One registered worker as a scheduler sees it."""

    worker_id: str
    description: worker_pb2.WorkerDescription
    draining: bool
    # The instance id in the heartbeat key, "" when the heartbeat expired (the worker is gone or hung).
    alive_instance: str

    @property
    def alive(self) -> bool:
        return bool(self.alive_instance)

    @property
    def routable(self) -> bool:
        """New requests may go to this worker."""
        return self.alive and not self.draining


class WorkerRegistry:
    """Typed reads and writes of the registry keys."""

    def __init__(self, client: aioredis.Redis) -> None:
        self._r = client

    async def heartbeat(self, worker_id: str, description: worker_pb2.WorkerDescription, draining: bool,
                        ttl_s: float, announce: bool = False) -> None:
        """Registers (or re-registers) the worker and marks it alive for `ttl_s` seconds.

        announce: also tell listening schedulers (CHANGES_CHANNEL), in the same transaction, so that
        what they read on the message includes this write. For a first registration or a drain.
        """
        record = state_pb2.WorkerRegistration(worker_id=worker_id, draining=draining, registered_at=time.time())
        record.description.CopyFrom(description)
        async with self._r.pipeline(transaction=True) as pipe:
            pipe.hset(WORKERS, worker_id, record.SerializeToString())
            pipe.set(heartbeat_key(worker_id), description.instance_id, px=int(ttl_s * 1000))
            if announce:
                pipe.publish(CHANGES_CHANNEL, worker_id)
            await pipe.execute()

    async def deregister(self, worker_id: str, instance_id: str) -> None:
        """Removes the worker, unless another process registered under the same id since (a restart)."""
        current = await self._r.get(heartbeat_key(worker_id))
        if current is not None and current.decode() != instance_id:
            return
        async with self._r.pipeline(transaction=True) as pipe:
            pipe.hdel(WORKERS, worker_id)
            pipe.delete(heartbeat_key(worker_id))
            pipe.publish(CHANGES_CHANNEL, worker_id)
            await pipe.execute()

    async def mark_drained(self, worker_id: str, instance_id: str) -> None:
        """The owner's word that this instance of the worker has nothing left to run."""
        await self._r.set(drained_key(worker_id), instance_id, ex=DRAINED_TTL_SECONDS)

    async def is_drained(self, worker_id: str, instance_id: str) -> bool:
        value = await self._r.get(drained_key(worker_id))
        return value is not None and value.decode() == instance_id

    async def workers(self) -> list[WorkerEntry]:
        """Every registered worker with its liveness, sorted by id (one round trip for the hash, one for the keys)."""
        raw = await self._r.hgetall(WORKERS)
        records = sorted((state_pb2.WorkerRegistration.FromString(v) for v in raw.values()), key=lambda r: r.worker_id)
        if not records:
            return []
        alive = await self._r.mget([heartbeat_key(r.worker_id) for r in records])
        return [
            WorkerEntry(r.worker_id, r.description, r.draining, a.decode() if a is not None else "")
            for r, a in zip(records, alive)
        ]

    async def forget(self, worker_id: str, state_keys: Sequence[str] = ()) -> bool:
        """Drops a dead worker's registration once its requests moved on, with its drained mark and the keys of
        its state (`state_keys`), in one step; False (nothing dropped) if it came back meanwhile."""
        keys = [heartbeat_key(worker_id), WORKERS, drained_key(worker_id), *state_keys]
        return bool(await self._r.eval(_FORGET_IF_DEAD_LUA, len(keys), *keys, worker_id))

"""Chooses the worker that serves a new request: least loaded, or where its prefix is cached.

Load is the number of live requests of a worker (admitted and not finished, from Redis), so
every replica routes by the same numbers. With prefix caching on, the router also keeps an
approximate index in Redis of which worker last received each full prompt block (chained block
hashes, as the prefix cache keys them); a request goes to the worker holding its longest prefix
unless that worker is clearly busier than the least loaded one, in which case recomputing the
prefix elsewhere is cheaper than queueing behind the others.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence, Set as AbstractSet
from dataclasses import dataclass

from scheduler_service.core.prefix_hash import hash_full_blocks
from scheduler_service.store import RedisStore
from shared.errors import UnavailableError
from shared.worker_registry import WorkerEntry

# Blocks of a prompt the prefix index looks at: enough for long shared system prompts, few enough
# that a lookup stays one small MGET.
MAX_INDEXED_BLOCKS = 32


@dataclass(frozen=True)
class RouteCandidate:
    """One routable worker at the moment of the decision."""

    worker_id: str
    load: int
    # Leading full blocks of the prompt the worker received with an earlier request.
    prefix_blocks: int = 0


def choose(candidates: Sequence[RouteCandidate], request_id: str) -> str:
    """The worker for a request (pure: the whole policy).

    Workers within a slack of the least load are eligible: max(2, half the least load) more live
    requests. Among them the longest cached prefix wins, then the lighter load; ties are broken
    by the request id's hash, so a burst of requests that all see the same loads still spreads.
    """
    if not candidates:
        raise ValueError("choose needs at least one candidate")
    least = min(c.load for c in candidates)
    slack = max(2, least // 2)
    eligible = [c for c in candidates if c.load <= least + slack]
    best = max(c.prefix_blocks for c in eligible)
    if best > 0:
        eligible = [c for c in eligible if c.prefix_blocks == best]
    lightest = min(c.load for c in eligible)
    ties = sorted(c.worker_id for c in eligible if c.load == lightest)
    return ties[zlib.crc32(request_id.encode()) % len(ties)]


class Router:
    """Routes over the workers the supervisor last saw as routable (alive, not draining)."""

    def __init__(self, store: RedisStore, prefix_aware: bool = False, block_size: int = 16) -> None:
        self._store = store
        self._prefix_aware = prefix_aware
        self._block_size = block_size
        self._workers: list[str] = []

    def update(self, entries: Sequence[WorkerEntry]) -> None:
        """Takes the registry's current view (called by the supervisor on every tick)."""
        self._workers = sorted(e.worker_id for e in entries if e.routable)

    @property
    def num_workers(self) -> int:
        return len(self._workers)

    @property
    def workers(self) -> list[str]:
        return list(self._workers)

    def _prefix_hashes(self, prompt_token_ids: Sequence[int]) -> list[str]:
        num_blocks = min(len(prompt_token_ids) // self._block_size, MAX_INDEXED_BLOCKS)
        return [h.hex() for h in hash_full_blocks(prompt_token_ids, self._block_size, num_blocks)]

    async def pick(self, request_id: str, prompt_token_ids: Sequence[int], exclude: AbstractSet[str] = frozenset()
                   ) -> str:
        """The worker for a new request (`exclude`: workers that must not get it, e.g. one draining or gone)."""
        workers = [w for w in self._workers if w not in exclude]
        if not workers:
            raise UnavailableError("no worker is ready to serve requests; retry when one has registered")
        hashes = self._prefix_hashes(prompt_token_ids) if self._prefix_aware else []
        if len(workers) == 1:
            chosen = workers[0]
        else:
            loads, holders = await self._store.routing_view(workers, hashes)
            matched = {w: 0 for w in workers}
            for i, holder in enumerate(holders):
                if holder in matched:
                    matched[holder] = i + 1
            chosen = choose([RouteCandidate(w, loads[w], matched[w]) for w in workers], request_id)
        if hashes:
            await self._store.remember_prefix(hashes, chosen)
        return chosen

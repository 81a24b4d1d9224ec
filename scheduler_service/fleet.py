"""What an engine loop needs to share workers with other scheduler replicas, and the hand-over.

A request moves to another worker when its own worker leaves (deregistered, heartbeat expired)
or drains. The move is part of the loop's fenced step commit: the request's record points at the
new worker and lands in its inbox with `handed_over` set, so the new loop recomputes it from the
prompt and the outputs committed so far; the client's stream simply goes on.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from scheduler_service.core.sequence import SequenceGroup
from scheduler_service.leases import Leases
from scheduler_service.output_processor import OutputProcessor
from scheduler_service.router import Router
from scheduler_service.store import StepCommit
from shared.worker_registry import WorkerRegistry


@dataclass(frozen=True)
class Fleet:
    """The shared parts of a replica: leases on workers, the worker registry, the router."""

    leases: Leases
    registry: WorkerRegistry
    router: Router

    def others(self, worker_id: str) -> list[str]:
        """Routable workers other than this one."""
        return [w for w in self.router.workers if w != worker_id]

    async def hand_over(self, groups: Iterable[SequenceGroup], processor: OutputProcessor, worker_id: str,
                        commit: StepCommit) -> int:
        """Moves the groups to other workers (chosen like new requests) within `commit`; returns how many."""
        moved = 0
        for group in list(groups):
            target = await self.router.pick(group.request_id, group.seqs[0].prompt_token_ids, exclude={worker_id})
            record = processor.hand_over(group)
            if record is not None:
                commit.handed_over.append((record, target))
                moved += 1
        return moved

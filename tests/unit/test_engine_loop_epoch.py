"""An engine loop that finds its worker fenced past Redis's epoch counter takes an epoch above the worker's.

Only the lease holder takes epochs, so the worker can have seen a newer one than the counter only if Redis lost
its data. The loop asks the worker (Describe) and takes the next epoch above it at once, instead of retrying
one refused Reset a second until the counter catches up.
"""

from __future__ import annotations

import asyncio

import grpc

from protos import worker_pb2
from scheduler_service.core.config import CacheConfig, SchedulerConfig
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.engine_loop import EngineLoop
from scheduler_service.fleet import Fleet
from scheduler_service.output_processor import OutputProcessor
from shared.worker_registry import WorkerEntry

WORKER_EPOCH = 1000


class _Leases:
    """Redis's counter after it lost its data, with Leases.next_epoch's floor."""

    def __init__(self) -> None:
        self.counter = 0

    async def next_epoch(self, worker_id: str, above: int = 0) -> int:
        self.counter = max(self.counter + 1, above + 1)
        return self.counter


class _Worker:
    """Refuses older epochs as the worker's fence does; says its epoch when described."""

    def __init__(self) -> None:
        self.epoch = WORKER_EPOCH
        self.resets: list[int] = []

    async def Reset(self, request: worker_pb2.ResetRequest, timeout: float) -> worker_pb2.ResetResponse:
        self.resets.append(request.epoch)
        if request.epoch < self.epoch:
            raise grpc.aio.AioRpcError(grpc.StatusCode.FAILED_PRECONDITION, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                       f"epoch {request.epoch} is older than the current epoch {self.epoch}")
        self.epoch = request.epoch
        return worker_pb2.ResetResponse(instance_id="i")

    async def Describe(self, request: worker_pb2.DescribeRequest, timeout: float) -> worker_pb2.WorkerDescription:
        return worker_pb2.WorkerDescription(epoch=self.epoch, instance_id="i")


class _Router:
    workers = ["w"]


def test_a_worker_fenced_past_the_counter_is_owned_with_an_epoch_above_its_own() -> None:
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64),
                          CacheConfig(block_size=4, num_gpu_blocks=8))
    leases, worker = _Leases(), _Worker()
    # Its registration was written before its last fence: it names an older epoch.
    registration = WorkerEntry("w", worker_pb2.WorkerDescription(epoch=3), False, "i")
    loop = EngineLoop("w", worker, None, scheduler, OutputProcessor(None, scheduler),  # type: ignore[arg-type]
                      Fleet(leases, None, _Router()), registration=registration)  # type: ignore[arg-type]

    # Without a floor from the worker, this would take 997 more refused Resets, a second apart.
    asyncio.run(asyncio.wait_for(loop._own_worker(asyncio.Event()), timeout=60))  # noqa: SLF001

    assert worker.resets == [4, WORKER_EPOCH + 1]
    assert loop._planner.epoch == WORKER_EPOCH + 1  # noqa: SLF001 - the epoch its plans and commits carry

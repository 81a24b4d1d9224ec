"""The tensor-parallel process group of one worker, and what travels over it besides activations.

Rank 0 is the gRPC worker. Each step it sends the other ranks the plan it
received, as the serialized protobuf (no pickle), then every rank runs the same
step; the row-parallel layers all_reduce their partial sums (sharding.py).
Only rank 0 samples; it sends the sampled token ids back so every rank's
per-sequence cache knows the same tokens:

    rank 0                                   ranks 1..N-1
    send(STEP, plan bytes)  ── broadcast ──▶ receive() -> (STEP, plan bytes)
    forward pass            ◀─ all_reduce ─▶ forward pass (2 per layer)
    sample, send_tokens     ── broadcast ──▶ receive_tokens()

A message is a header [command, length] (int64), then the payload as uint8.
Commands and tokens go over a gloo group on the CPU (on a GPU the default
group is NCCL, which only moves device tensors), as vLLM's ``cpu_group`` does.
"""

from __future__ import annotations

import datetime
import enum
import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

# Ranks 1..N-1 wait in a broadcast for the next plan however long the worker idles; gloo times
# every operation out, so the command group's timeout is effectively forever. A dead peer is
# still noticed at once: its closed connection fails the operation.
_IDLE_TIMEOUT = datetime.timedelta(days=3650)
# The activations' group on a GPU (NCCL): a step's all_reduce that waits this long has a hung peer.
_STEP_TIMEOUT = datetime.timedelta(minutes=10)


class Command(enum.IntEnum):
    """What rank 0 asks of the other ranks."""

    STEP = 1  # payload: a serialized worker_pb2.StepPlan
    RESET = 2  # forget every sequence
    RESUME = 3  # payload: a serialized worker_pb2.ResumeSequencesRequest


class StepAbandonedError(RuntimeError):
    """Rank 0 failed the step after the forward pass (while sampling); the other ranks drop it too."""


def device_for_rank(device: str, rank: int) -> torch.device:
    """Rank r of a group on ``cuda:k`` uses ``cuda:k+r``; on a CPU every rank uses the CPU."""
    base = torch.device(device)
    return torch.device("cuda", (base.index or 0) + rank) if base.type == "cuda" else base


@dataclass
class TensorParallelGroup:
    """This process's place in the group; rank 0 is the driver (the gRPC worker)."""

    rank: int
    world_size: int
    # Carries commands and sampled tokens: the default group on a CPU, a gloo group beside NCCL on a GPU.
    cpu_group: dist.ProcessGroup

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def send(self, command: Command, payload: bytes = b"") -> None:
        """Rank 0: broadcasts one command to the other ranks."""
        header = torch.tensor([int(command), len(payload)], dtype=torch.int64)
        dist.broadcast(header, src=0, group=self.cpu_group)
        if payload:
            dist.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8), src=0, group=self.cpu_group)

    def receive(self) -> tuple[Command, bytes]:
        """Ranks 1..N-1: waits for rank 0's next command."""
        header = torch.empty(2, dtype=torch.int64)
        dist.broadcast(header, src=0, group=self.cpu_group)
        command, length = Command(int(header[0])), int(header[1])
        if not length:
            return command, b""
        payload = torch.empty(length, dtype=torch.uint8)
        dist.broadcast(payload, src=0, group=self.cpu_group)
        return command, payload.numpy().tobytes()

    def send_tokens(self, token_ids: list[int] | None) -> None:
        """Rank 0: the step's sampled ids in sampling order, or None when it failed the step.

        The other ranks know how many to expect (they built the same batch): [ok flag, ids...].
        """
        ok = token_ids is not None
        message = torch.tensor([int(ok), *(token_ids or [])], dtype=torch.int64)
        dist.broadcast(message, src=0, group=self.cpu_group)

    def receive_tokens(self, count: int) -> list[int]:
        """Ranks 1..N-1: the ids rank 0 sampled; raises StepAbandonedError if rank 0 failed the step.

        Rank 0 sends count + 1 values either way, so the group stays in step after a failure.
        """
        message = torch.empty(count + 1, dtype=torch.int64)
        dist.broadcast(message, src=0, group=self.cpu_group)
        if not int(message[0]):
            raise StepAbandonedError("rank 0 failed this step while sampling")
        return message[1:].tolist()

    def min_over_ranks(self, value: int) -> int:
        """The smallest ``value`` of all ranks (block counts: every shard must hold the same blocks)."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t[0])


def join_group(rank: int, world_size: int, init_method: str, device: torch.device) -> TensorParallelGroup:
    """Joins (rank 0: hosts) the group at ``init_method`` (tcp://127.0.0.1:PORT); blocks until all joined."""
    # NCCL between GPUs, gloo between CPU processes.
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = _STEP_TIMEOUT if backend == "nccl" else _IDLE_TIMEOUT
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timeout)
    # Every rank creates the same groups in the same order (torch.distributed's rule).
    cpu_group = dist.new_group(backend="gloo", timeout=_IDLE_TIMEOUT) if backend == "nccl" else dist.group.WORLD
    log.info("rank %d of %d joined the tensor-parallel group (%s)", rank, world_size, backend)
    return TensorParallelGroup(rank=rank, world_size=world_size, cpu_group=cpu_group)


def leave_group() -> None:
    """Tears the process group down (rank 0 at shutdown, after the other ranks were stopped)."""
    if dist.is_initialized():
        dist.destroy_process_group()

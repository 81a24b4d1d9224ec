"""The processes of a tensor-parallel worker: rank 0 starts and watches ranks 1..N-1, which follow its plans.

Rank 0 (the gRPC worker process) starts ranks 1..N-1 as subprocesses of
``python -m worker_service.tp_ranks``, hands each the WorkerConfig as JSON on
its stdin, hosts the process group on a free localhost port and loads its own
shard while they load theirs. Then every rank builds the same ModelRunner over
its shard, and ranks 1..N-1 loop: receive a command, run it.

Lifecycle:
  - a rank 1..N-1 that dies takes the worker down: rank 0's watchdog sees the
    exit, logs it, stops the other ranks and exits with status 1. Waiting on
    the step instead could hang forever (an NCCL collective with a dead peer
    never returns), and the worker cannot serve without the dead rank's heads.
  - rank 0 stopping (SIGTERM) terminates the other ranks; rank 0 dying closes
    its connections, which fails their pending broadcast, and they also watch
    their parent process, so none outlives it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import subprocess
import sys
import threading
from collections.abc import Sequence

import torch

from protos import worker_pb2
from shared.redis_server import free_port
from worker_service.config import WorkerConfig
from worker_service.model_loader import load_config
from worker_service.model_runner import ModelRunner
from worker_service.plan import plan_from_proto
from worker_service.sharding import check_tensor_parallel
from worker_service.tensor_parallel import (
    Command,
    StepAbandonedError,
    device_for_rank,
    join_group,
    leave_group,
)

# Named explicitly: ranks 1..N-1 run this module as __main__.
log = logging.getLogger("worker_service.tp_ranks")

_POLL_S = 0.2
_STOP_GRACE_S = 10.0


def _runner_fields(config: WorkerConfig) -> dict[str, object]:
    """The config's plain fields, for the other ranks' WorkerConfig (sent as JSON on their stdin).

    Structured settings (TLS, registration) are for the gRPC side, which only rank 0 has; the
    other ranks take their defaults. Stdin rather than argv keeps settings out of `ps` output.
    """
    plain = (str, int, float, bool, type(None))
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
            if isinstance(getattr(config, f.name), plain)}


class RankProcesses:
    """Ranks 1..N-1 as seen from rank 0: started, watched, stopped."""

    def __init__(self, config: WorkerConfig, init_method: str) -> None:
        """Starts ranks 1..N-1 and their watchdog; their logs go to this process's stdout/stderr."""
        config_json = json.dumps(_runner_fields(config)).encode()
        level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
        self._procs: list[subprocess.Popen] = []
        for rank in range(1, config.tensor_parallel_size):
            proc = subprocess.Popen(
                [sys.executable, "-m", "worker_service.tp_ranks", "--rank", str(rank),
                 "--world-size", str(config.tensor_parallel_size), "--init-method", init_method,
                 "--log-level", str(level)],
                stdin=subprocess.PIPE,
            )
            assert proc.stdin is not None  # stdin=PIPE above
            proc.stdin.write(config_json)
            proc.stdin.close()
            self._procs.append(proc)
            log.info("started tensor-parallel rank %d of %d (pid %d)", rank, config.tensor_parallel_size, proc.pid)
        self._stopping = threading.Event()
        threading.Thread(target=self._watch, name="tp-rank-watchdog", daemon=True).start()

    def _watch(self) -> None:
        while not self._stopping.wait(_POLL_S):
            for rank, proc in enumerate(self._procs, start=1):
                code = proc.poll()
                if code is None or self._stopping.is_set():
                    continue
                log.critical(
                    "tensor-parallel rank %d (pid %d) exited with status %s; the worker cannot run steps "
                    "without its shard and stops", rank, proc.pid, code,
                )
                self._terminate()
                os._exit(1)  # the whole worker exits non-zero (see the module docstring)

    def _terminate(self) -> None:
        for proc in self._procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self._procs:
            try:
                proc.wait(timeout=_STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def stop(self) -> None:
        """Terminates ranks 1..N-1 (rank 0 is shutting down) and leaves the group."""
        self._stopping.set()
        self._terminate()
        leave_group()
        log.info("tensor-parallel ranks stopped")


def start_runner(config: WorkerConfig) -> tuple[ModelRunner, RankProcesses | None]:
    """Rank 0's model runner; with tensor_parallel_size > 1, first starts the other ranks and joins them.

    A model whose heads the size does not divide fails here, before any process starts.
    """
    if config.simulate:
        from worker_service.simulation import SimulatedRunner, SimulationProfile  # noqa: PLC0415

        return SimulatedRunner(config, SimulationProfile.load(config.simulate)), None
    size = config.tensor_parallel_size
    if size == 1:
        return ModelRunner(config), None
    check_tensor_parallel(load_config(config.model), size)
    device = device_for_rank(config.device, 0)
    if device.type == "cuda" and (device.index or 0) + size > torch.cuda.device_count():
        raise ValueError(
            f"tensor_parallel_size={size} on {config.device} needs GPUs {device.index or 0}.."
            f"{(device.index or 0) + size - 1}, but {torch.cuda.device_count()} are visible"
        )
    init_method = f"tcp://127.0.0.1:{free_port()}"
    log.info("starting %d tensor-parallel ranks, group at %s", size, init_method)
    ranks = RankProcesses(config, init_method)
    try:
        runner = _join_as(config, 0, size, init_method)
    except BaseException:
        ranks.stop()
        raise
    log.info("tensor-parallel group of %d ready: %d KV blocks per shard, %d of %d KV heads each",
             size, runner.cache.sizing.num_gpu_blocks, runner.cache_shape.num_kv_heads, runner.shape.num_kv_heads)
    return runner, ranks


def _join_as(config: WorkerConfig, rank: int, world_size: int, init_method: str) -> ModelRunner:
    """Every rank alike: joins the group on the rank's device and builds the runner of its shard."""
    device = device_for_rank(config.device, rank)
    group = join_group(rank, world_size, init_method, device)
    return ModelRunner(dataclasses.replace(config, device=str(device)), group)


def follow(runner: ModelRunner) -> None:
    """Ranks 1..N-1: run rank 0's commands (over the runner's group) until the group breaks (rank 0 gone raises)."""
    group = runner.tp
    assert group is not None  # a runner built by _join_as
    while True:
        command, payload = group.receive()
        if command is Command.RESET:
            runner.reset()
        elif command is Command.RESUME:
            runner.resume(worker_pb2.ResumeSequencesRequest.FromString(payload))
        else:
            plan = plan_from_proto(worker_pb2.StepPlan.FromString(payload))
            try:
                runner.execute(plan)
            except (ValueError, StepAbandonedError) as exc:
                # A bad plan fails the same check on rank 0, against the same state, before any collective;
                # rank 0 answers the scheduler. Anything else (a failure inside the forward pass) ends this
                # process, since the group cannot be trusted to be in step any more.
                log.debug("step %d dropped: %s", plan.step_id, exc)


def _exit_with_parent() -> None:
    """Exits when rank 0's process is gone, even if no broadcast is pending to notice it."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            threading.Event().wait(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="tp-parent-watchdog", daemon=True).start()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ranks 1..N-1 (started by rank 0, not by hand)."""
    parser = argparse.ArgumentParser(description="a tensor-parallel rank of an llmserve worker")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--init-method", required=True)
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    from shared.logging_setup import setup_logging  # noqa: PLC0415

    setup_logging(args.log_level, name=f"worker-rank{args.rank}")
    _exit_with_parent()
    config = WorkerConfig(**json.loads(sys.stdin.read()))
    runner = _join_as(config, args.rank, args.world_size, args.init_method)
    log.info("rank %d ready: %d KV blocks of %d KV heads", args.rank, runner.cache.sizing.num_gpu_blocks,
             runner.cache_shape.num_kv_heads)
    try:
        follow(runner)
    except RuntimeError as exc:
        log.error("rank %d leaves the tensor-parallel group: %s", args.rank, exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

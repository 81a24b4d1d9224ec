"""The control plane at fleet scale: scheduler replicas driving simulated GPU workers (`make bench-fleet`).

    python -m benchmarks.fleet [--workers 1,4,16] [--replicas 1,2] [--profile llama-3-8b-h100]
                               [--streams-per-worker 32] [--window 20] [--output benchmarks/results/fleet.json]

For each (replicas, workers) it starts Redis, the workers (`llmserve worker --simulate PROFILE`, each its
own process, as on its own GPU) and the scheduler replicas, waits until every worker's lease is held,
keeps `streams-per-worker x workers` greedy requests in flight through gRPC `Generate` (round-robin over
the replicas; over the front-only replicas alone with --front-replicas), and measures a window after a
warm-up:

- per worker: steps/s achieved, and the share of the window it spent executing steps (its modelled step
  time, as it sleeps it): 100 % is a worker never kept waiting by the control plane; the wall time per
  step outside the worker's execution is the latency the control plane adds to each step;
- scheduler CPU per step (all replicas' processes; with front-only replicas, also the share of the
  replicas that drive the workers), the simulated workers' CPU per step;
- Redis commands and bytes (in + out) per step and per generated token, from INFO.

All processes share this machine's cores, the client included: where the numbers saturate, the report
says which process was busy. Results go to a JSON file (one entry per configuration).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc
import redis
from prometheus_client.parser import text_string_to_metric_families

from llmserve.client import make_request
from protos import generation_pb2_grpc
from scheduler_service.leases import lease_key
from shared.default_model import prepare_default_model
from shared.redis_server import RedisServer, free_port
from shared.worker_registry import WORKERS

_TICK = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Load:
    streams_per_worker: int = 32
    prompt_len: int = 64
    max_tokens: int = 128
    warmup_s: float = 10.0
    window_s: float = 20.0


@dataclass
class FleetResult:
    replicas: int
    workers: int
    profile: str
    streams: int
    steps_per_s_per_worker: float
    busy_fraction: float  # mean over workers of the window share spent executing steps
    added_ms_per_step: float
    modelled_ms_per_step: float
    scheduler_cpu_ms_per_step: float  # every replica, front-only ones included
    engine_cpu_ms_per_step: float  # the replicas that drive workers
    worker_cpu_ms_per_step: float
    client_cpu_ms_per_step: float
    tokens_per_s: float
    redis_commands_per_step: float
    redis_commands_per_token: float
    redis_bytes_per_step: float
    redis_bytes_per_token: float
    machine_cpus: int
    front_replicas: int = 0


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime


def _worker_steps(metrics_url: str) -> tuple[float, float]:
    """(steps executed, seconds spent executing them) from a worker's /metrics."""
    with urllib.request.urlopen(metrics_url, timeout=10) as reply:
        text = reply.read().decode()
    count = total = 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "llmserve:worker_step_seconds_count":
                count += s.value
            elif s.name == "llmserve:worker_step_seconds_sum":
                total += s.value
    return count, total


def _redis_totals(client: redis.Redis) -> tuple[int, int]:
    """(commands executed, bytes in + out) so far."""
    calls = sum(v["calls"] for v in client.info("commandstats").values())
    stats = client.info("stats")
    return calls, int(stats["total_net_input_bytes"]) + int(stats["total_net_output_bytes"])


class Fleet:
    """Redis, simulated workers and scheduler replicas as local processes; `with Fleet(...) as f:`."""

    def __init__(self, model: str, profile: str, workers: int, replicas: int, workdir: Path,
                 scheduler_args: list[str] | None = None, worker_args: list[str] | None = None,
                 front_replicas: int = 0, scheduler_log_level: str = "WARNING") -> None:
        self.model, self.profile, self.num_workers, self.num_replicas = model, profile, workers, replicas
        self.num_front_replicas = front_replicas
        self.scheduler_args = scheduler_args or []
        self.worker_args = worker_args or []
        self.workdir = workdir
        self.redis = RedisServer()
        self.procs: list[subprocess.Popen[bytes]] = []
        self.worker_pids: list[int] = []
        self.scheduler_pids: list[int] = []
        self.worker_metrics: list[str] = []
        self.worker_addresses: list[str] = []
        self.scheduler_log_level = scheduler_log_level
        self.scheduler_addresses: list[str] = []
        # Front-only replicas (--front-only): they serve the clients when there are any, and drive no worker.
        self.front_pids: list[int] = []
        self.front_addresses: list[str] = []
        self.killed: set[int] = set()

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        with open(self.workdir / f"{name}.log", "ab") as log:
            proc = subprocess.Popen([sys.executable, "-m", "llmserve", *args], stdout=log, stderr=subprocess.STDOUT,
                                    env=dict(os.environ, PYTHONUNBUFFERED="1"), start_new_session=True)
        self.procs.append(proc)
        return proc

    def __enter__(self) -> Fleet:
        try:
            self.redis.start()
            for i in range(self.num_workers):
                port, metrics = free_port(), free_port()
                proc = self._spawn(f"worker{i}", [
                    "worker", "--simulate", self.profile, "--model", self.model, "--port", str(port),
                    "--metrics-port", str(metrics), "--redis-url", self.redis.url, "--log-level", "WARNING",
                    *self.worker_args])
                self.worker_pids.append(proc.pid)
                self.worker_metrics.append(f"http://127.0.0.1:{metrics}/metrics")
                self.worker_addresses.append(f"127.0.0.1:{port}")
            for _ in range(self.num_replicas):
                self.add_replica()
            for _ in range(self.num_front_replicas):
                self.add_replica(front_only=True)
            self._wait_leased(timeout_s=120 + 15 * (self.num_workers + self.num_replicas))
        except BaseException:
            self.__exit__()
            raise
        return self

    def add_replica(self, front_only: bool = False) -> str:
        """Starts one more scheduler replica (not waited for); returns its address."""
        port = free_port()
        pids, addresses = (self.front_pids, self.front_addresses) if front_only else (
            self.scheduler_pids, self.scheduler_addresses)
        proc = self._spawn(f"{'front' if front_only else 'scheduler'}{len(pids)}", [
            "scheduler", "--model", self.model, "--port", str(port), "--redis-url", self.redis.url,
            "--log-level", self.scheduler_log_level, *self.scheduler_args, *(["--front-only"] if front_only else [])])
        pids.append(proc.pid)
        addresses.append(f"127.0.0.1:{port}")
        return addresses[-1]

    @property
    def client_addresses(self) -> list[str]:
        """Where the clients go: the front-only replicas if there are any, else every replica."""
        return self.front_addresses or self.scheduler_addresses

    def kill(self, pid: int) -> None:
        """SIGKILLs one of the fleet's processes (a crash: nothing is given back, leases expire)."""
        self.killed.add(pid)
        os.kill(pid, signal.SIGKILL)

    def _wait_leased(self, timeout_s: float) -> None:
        client = redis.Redis.from_url(self.redis.url)
        deadline = time.monotonic() + timeout_s
        while True:
            for proc in self.procs:
                if proc.poll() is not None and proc.pid not in self.killed:
                    raise RuntimeError(f"a fleet process exited with {proc.returncode}; logs in {self.workdir}")
            workers = [w.decode() for w in client.hkeys(WORKERS)]
            if len(workers) == self.num_workers and all(client.exists(lease_key(w)) for w in workers):
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(workers)} of {self.num_workers} workers registered and leased after "
                                   f"{timeout_s:.0f} s; logs in {self.workdir}")
            time.sleep(0.5)
        for address in self.scheduler_addresses + self.front_addresses:
            with grpc.insecure_channel(address) as channel:
                grpc.channel_ready_future(channel).result(timeout=max(1.0, deadline - time.monotonic()))

    def __exit__(self, *exc: object) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        self.redis.stop()


class Crowd:
    """`streams` clients that each send a greedy request as soon as their last one finished."""

    def __init__(self, addresses: list[str], streams: int, load: Load, seed: int = 0) -> None:
        self.addresses, self.streams, self.load = addresses, streams, load
        self.rng = random.Random(seed)
        self.tokens = 0
        self.errors = 0
        self._stop = asyncio.Event()

    async def _client(self, index: int, stub: generation_pb2_grpc.GenerationStub) -> None:
        while not self._stop.is_set():
            prompt = [self.rng.randrange(100, 10000) for _ in range(self.load.prompt_len)]
            request = make_request(prompt_token_ids=prompt, max_tokens=self.load.max_tokens, temperature=0.0)
            try:
                async for message in stub.Generate(request, timeout=600):
                    for output in message.outputs:
                        self.tokens += len(output.token_ids)
            except grpc.aio.AioRpcError:
                self.errors += 1
                await asyncio.sleep(0.5)

    async def run(self, measure: "asyncio.Future[None]") -> None:
        channels = [grpc.aio.insecure_channel(a) for a in self.addresses]
        stubs = [generation_pb2_grpc.GenerationStub(c) for c in channels]
        tasks = [asyncio.create_task(self._client(i, stubs[i % len(stubs)])) for i in range(self.streams)]
        await measure
        self._stop.set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for channel in channels:
            await channel.close()


def _snapshot(fleet: Fleet, client: redis.Redis) -> dict[str, object]:
    return {
        "time": time.monotonic(),
        "workers": [_worker_steps(url) for url in fleet.worker_metrics],
        "scheduler_cpu": sum(_cpu_seconds(pid) for pid in fleet.scheduler_pids),
        "front_cpu": sum(_cpu_seconds(pid) for pid in fleet.front_pids),
        "worker_cpu": sum(_cpu_seconds(pid) for pid in fleet.worker_pids),
        "client_cpu": _cpu_seconds(os.getpid()),
        "redis": _redis_totals(client),
    }


async def _measure(fleet: Fleet, load: Load, profile: str) -> FleetResult:
    streams = load.streams_per_worker * fleet.num_workers
    crowd = Crowd(fleet.client_addresses, streams, load)
    client = redis.Redis.from_url(fleet.redis.url)
    done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    runner = asyncio.create_task(crowd.run(done))
    await asyncio.sleep(load.warmup_s)
    before = await asyncio.to_thread(_snapshot, fleet, client)
    tokens_before = crowd.tokens
    await asyncio.sleep(load.window_s)
    after = await asyncio.to_thread(_snapshot, fleet, client)
    tokens = crowd.tokens - tokens_before
    done.set_result(None)
    await runner
    window = after["time"] - before["time"]  # type: ignore[operator]
    steps = [a[0] - b[0] for a, b in zip(after["workers"], before["workers"])]  # type: ignore[arg-type]
    busy = [a[1] - b[1] for a, b in zip(after["workers"], before["workers"])]  # type: ignore[arg-type]
    total_steps = max(sum(steps), 1.0)
    commands = after["redis"][0] - before["redis"][0]  # type: ignore[index]
    moved = after["redis"][1] - before["redis"][1]  # type: ignore[index]
    return FleetResult(
        replicas=fleet.num_replicas, workers=fleet.num_workers, profile=profile, streams=streams,
        steps_per_s_per_worker=sum(steps) / len(steps) / window,
        busy_fraction=sum(busy) / len(busy) / window,
        added_ms_per_step=1e3 * sum(window - b for b in busy) / total_steps,
        modelled_ms_per_step=1e3 * sum(busy) / total_steps,
        scheduler_cpu_ms_per_step=1e3 * (after["scheduler_cpu"] + after["front_cpu"] - before["scheduler_cpu"]  # type: ignore[operator]
                                         - before["front_cpu"]) / total_steps,  # type: ignore[operator]
        engine_cpu_ms_per_step=1e3 * (after["scheduler_cpu"] - before["scheduler_cpu"]) / total_steps,  # type: ignore[operator]
        front_replicas=fleet.num_front_replicas,
        worker_cpu_ms_per_step=1e3 * (after["worker_cpu"] - before["worker_cpu"]) / total_steps,  # type: ignore[operator]
        client_cpu_ms_per_step=1e3 * (after["client_cpu"] - before["client_cpu"]) / total_steps,  # type: ignore[operator]
        tokens_per_s=tokens / window,
        redis_commands_per_step=commands / total_steps, redis_commands_per_token=commands / max(tokens, 1),
        redis_bytes_per_step=moved / total_steps, redis_bytes_per_token=moved / max(tokens, 1),
        machine_cpus=os.cpu_count() or 1,
    )


def _table(results: list[FleetResult]) -> str:
    head = ("| replicas | workers | streams | steps/s per worker | worker busy | added ms/step | modelled ms/step "
            "| scheduler CPU ms/step | worker CPU ms/step | client CPU ms/step | tok/s | Redis cmds/step "
            "| Redis cmds/token | Redis bytes/step | Redis bytes/token |")
    rows = [head, "|" + "---:|" * 15]
    for r in results:
        rows.append(
            f"| {r.replicas}{f' + {r.front_replicas} front' if r.front_replicas else ''} | {r.workers} | {r.streams} | {r.steps_per_s_per_worker:.1f} | {r.busy_fraction:.0%} "
            f"| {r.added_ms_per_step:.2f} | {r.modelled_ms_per_step:.2f} | {r.scheduler_cpu_ms_per_step:.2f}"
            f"{f' ({r.engine_cpu_ms_per_step:.2f} engine)' if r.front_replicas else ''} "
            f"| {r.worker_cpu_ms_per_step:.2f} | {r.client_cpu_ms_per_step:.2f} | {r.tokens_per_s:.0f} "
            f"| {r.redis_commands_per_step:.1f} | {r.redis_commands_per_token:.2f} | {r.redis_bytes_per_step:.0f} "
            f"| {r.redis_bytes_per_token:.0f} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", default="1,4,16", help="comma-separated fleet sizes")
    parser.add_argument("--replicas", default="1,2", help="comma-separated scheduler replica counts")
    parser.add_argument("--front-replicas", type=int, default=0,
                        help="front-only replicas (--front-only) added to each configuration; the clients go to them")
    parser.add_argument("--profile", default="llama-3-8b-h100")
    parser.add_argument("--streams-per-worker", type=int, default=Load.streams_per_worker)
    parser.add_argument("--prompt-len", type=int, default=Load.prompt_len)
    parser.add_argument("--max-tokens", type=int, default=Load.max_tokens)
    parser.add_argument("--warmup", type=float, default=Load.warmup_s)
    parser.add_argument("--window", type=float, default=Load.window_s)
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/fleet.json"))
    parser.add_argument("--scheduler-arg", action="append", default=[], metavar="ARG",
                        help="passed to every scheduler replica (repeatable), e.g. --scheduler-arg=--async-scheduling")
    args = parser.parse_args(argv)
    load = Load(args.streams_per_worker, args.prompt_len, args.max_tokens, args.warmup, args.window)
    model = str(prepare_default_model())
    results: list[FleetResult] = []
    for replicas in (int(r) for r in args.replicas.split(",")):
        for workers in (int(w) for w in args.workers.split(",")):
            with tempfile.TemporaryDirectory(prefix="llmserve-fleet-") as tmp:
                print(f"{replicas} replica(s), {workers} simulated worker(s): starting", flush=True)
                with Fleet(model, args.profile, workers, replicas, Path(tmp), args.scheduler_arg,
                           front_replicas=args.front_replicas) as fleet:
                    result = asyncio.run(_measure(fleet, load, args.profile))
            results.append(result)
            print(_table([result]).splitlines()[-1], flush=True)
    print(_table(results))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                       "machine": platform.processor() or platform.machine(),
                                       "cpus": os.cpu_count(), "load": asdict(load),
                                       "scheduler_args": args.scheduler_arg, "front_replicas": args.front_replicas,
                                       "results": [asdict(r) for r in results]}, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()

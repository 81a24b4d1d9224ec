"""Failover at fleet scale: SIGKILL the scheduler replica that drives every worker, under load.

    python -m benchmarks.fleet_failover [--workers 16] [--streams-per-worker 4] [--lease-ttl 10]
                                        [--output benchmarks/results/fleet_failover.json]

One replica (A) takes the leases of all the simulated workers and serves every client; a standby replica
(B) joins once the load runs, and A is SIGKILLed while it still drives every worker. The clients' streams
break; each re-attaches to B through llmserve's own client (Resume from the next index it needs, or Generate
again with the same request id when it has no message yet), and new requests go to B. Reported:

- per worker: when its lease moved to B, after the kill, and how long after A's lease had expired;
- per stream in flight at the kill: the pause its client saw (its longest silence across the takeover);
- every request that finished: its tokens against the simulated workers' token rule (it must be exactly
  the predicted continuation, whatever was taken over or recomputed), and the tokens the workers computed
  again (0 when every sequence continued on its KV cache).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc
import redis

from benchmarks.fleet import Fleet
from llmserve.client import GenerationClient, make_request
from protos import worker_pb2, worker_pb2_grpc
from scheduler_service.leases import SCHEDULERS, lease_key
from shared.default_model import prepare_default_model
from shared.worker_registry import WORKERS
from worker_service.model_loader import load_config, model_shape
from worker_service.model_runner import eos_token_ids
from worker_service.simulation import simulated_continuation

SEED = 11


@dataclass
class _Stream:
    prompt: list[int]
    max_tokens: int
    tokens: list[int] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)  # time.monotonic() of each message
    done: bool = False


class ResumingCrowd:
    """Closed-loop greedy streams (a thread each) through llmserve's own client, whose streams re-attach to
    the next address when their call breaks (llmserve/resume.py): Resume from the next index, or Generate
    again with the same request id when nothing arrived yet."""

    def __init__(self, addresses: list[str], streams: int, prompt_len: int, max_tokens: int, seed: int = 0,
                 give_up_s: float = 300.0) -> None:
        # One client per first address, the others its fallbacks: new requests start where `prefer` says.
        self._clients = [GenerationClient(a, fallback_addresses=[b for b in addresses if b != a]) for a in addresses]
        self._client = self._clients[0]
        self.prompt_len, self.max_tokens, self.give_up_s = prompt_len, max_tokens, give_up_s
        self.requests: list[_Stream] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._loop, args=(random.Random(seed * 1000 + i),), daemon=True)
                         for i in range(streams)]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def prefer(self, index: int) -> None:
        """New requests start at `addresses[index]`, as a load balancer that took a dead replica out sends them
        (a stream's first call waits for its address to come up)."""
        self._client = self._clients[index]

    def finish(self) -> None:
        """Stops sending new requests and waits until every request in flight has ended."""
        self._stop.set()
        for thread in self._threads:
            thread.join(self.give_up_s)
        self.errors += [f"a stream did not end within {self.give_up_s:.0f} s" for t in self._threads if t.is_alive()]
        for client in self._clients:
            client.close()

    def _loop(self, rng: random.Random) -> None:
        while not self._stop.is_set():
            stream = _Stream([rng.randrange(100, 10000) for _ in range(self.prompt_len)], self.max_tokens)
            self.requests.append(stream)
            try:
                self._one(stream)
            except Exception as exc:  # noqa: BLE001 - counted and reported: a lost request is the finding
                self.errors.append(f"{type(exc).__name__}: {exc}")
                return

    def _one(self, stream: _Stream) -> None:
        request = make_request(prompt_token_ids=stream.prompt, max_tokens=stream.max_tokens, temperature=0.0)
        for message in self._client.stream(request, timeout=self.give_up_s):
            stream.arrivals.append(time.monotonic())
            for output in message.outputs:
                stream.tokens.extend(output.token_ids)
            if message.HasField("usage"):
                stream.done = True
                return
        raise RuntimeError("the stream ended without its final message")


@dataclass
class FailoverResult:
    workers: int
    streams: int
    lease_ttl_s: float
    leases_held_at_kill: int
    lease_moved_s: list[float]  # per worker: kill -> lease owned by the standby
    after_expiry_s: list[float]  # per worker: the lease's own expiry -> owned by the standby
    stream_pause_s: list[float]  # per stream in flight at the kill: its longest silence across the takeover
    all_resumed_s: float
    requests_finished: int
    requests_matching: int
    requests_lost: int
    recomputed_tokens: int
    errors: list[str]


def percentiles(values: list[float]) -> str:
    """min / median / p90 / max, in seconds."""
    if not values:
        return "-"
    ordered = sorted(values)
    pick = [ordered[min(len(ordered) - 1, int(q * len(ordered)))] for q in (0.0, 0.5, 0.9, 1.0)]
    return " / ".join(f"{v:.2f}" for v in pick)


def summary(r: FailoverResult) -> str:
    return "\n".join([
        f"{r.workers} workers, {r.streams} streams, lease TTL {r.lease_ttl_s:g} s; "
        f"the killed replica held {r.leases_held_at_kill} lease(s)",
        f"lease moved after the kill (min / p50 / p90 / max s): {percentiles(r.lease_moved_s)}",
        f"  of which after the lease expired:                  {percentiles(r.after_expiry_s)}",
        f"stream pause, longest silence across the takeover:   {percentiles(r.stream_pause_s)}",
        f"every stream resumed after {r.all_resumed_s:.2f} s",
        f"requests finished {r.requests_finished}, with the predicted tokens {r.requests_matching}, "
        f"lost {r.requests_lost}; tokens recomputed by the workers "
        f"{r.recomputed_tokens}",
    ])


def _resumed_at(arrivals: list[float], killed_at: float) -> tuple[float, float]:
    """(the stream's longest silence that ended after the kill, when it ended): the takeover as its client saw
    it, whether the last messages before the kill arrived before it or just after."""
    gaps = [(b - a, b) for a, b in zip(arrivals, arrivals[1:]) if b > killed_at]
    return max(gaps, default=(0.0, killed_at))


def _lease_state(client: redis.Redis, workers: list[str]) -> tuple[list[str], list[int]]:
    with client.pipeline(transaction=False) as pipe:
        for w in workers:
            pipe.get(lease_key(w))
        for w in workers:
            pipe.pttl(lease_key(w))
        values = pipe.execute()
    owners = [v.decode() if v else "" for v in values[:len(workers)]]
    return owners, [int(ms) for ms in values[len(workers):]]


def _recomputed_tokens(fleet: Fleet) -> int:
    total = 0
    for address in fleet.worker_addresses:
        with grpc.insecure_channel(address) as channel:
            total += worker_pb2_grpc.WorkerStub(channel).Describe(worker_pb2.DescribeRequest(),
                                                                  timeout=30).num_recomputed_tokens
    return total


async def _wait_for(predicate: Callable[[], bool], timeout_s: float, what: str, poll_s: float = 0.02) -> None:
    """Polls `predicate` (in a thread: it talks to Redis) until it holds; TimeoutError naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not await asyncio.to_thread(predicate):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not after {timeout_s:.0f} s")
        await asyncio.sleep(poll_s)


async def run_failover(fleet: Fleet, streams: int, prompt_len: int, max_tokens: int, warmup_s: float,
                       lease_ttl_s: float, after_s: float = 2.0) -> FailoverResult:
    """With `fleet` up (one replica holding every lease): load, a standby replica, the kill, the checks."""
    client = redis.Redis.from_url(fleet.redis.url)
    workers = sorted(w.decode() for w in client.hkeys(WORKERS))
    victim_pid, victim_address = fleet.scheduler_pids[0], fleet.scheduler_addresses[0]
    standby_address = fleet.add_replica()
    crowd = ResumingCrowd([victim_address, standby_address], streams, prompt_len, max_tokens)
    crowd.start()
    await asyncio.sleep(warmup_s)
    # The standby is up: serving, and counted alive in the replicas' roster.
    with grpc.insecure_channel(standby_address) as channel:
        await asyncio.to_thread(grpc.channel_ready_future(channel).result, 120)
    await _wait_for(lambda: client.zcard(SCHEDULERS) >= 2, 120, "the standby replica joined the roster")
    owners, ttl_ms = _lease_state(client, workers)
    victim_id = max(set(owners), key=owners.count)
    killed_at = time.monotonic()
    fleet.kill(victim_pid)
    crowd.prefer(1)
    expiry = {w: killed_at + ms / 1000 for w, owner, ms in zip(workers, owners, ttl_ms) if owner == victim_id}
    in_flight = [s for s in crowd.requests if not s.done and s.arrivals]
    moved: dict[str, float] = {}

    def all_moved() -> bool:
        now = time.monotonic()
        current, _ = _lease_state(client, workers)
        for w, owner in zip(workers, current):
            if w in expiry and w not in moved and owner and owner != victim_id:
                moved[w] = now
        return len(moved) == len(expiry)

    await _wait_for(all_moved, 20 * lease_ttl_s + 120, "every lease of the killed replica moved")
    # Messages committed before the kill may still arrive after it: a stream has resumed once a message
    # arrived after the last lease moved (the new owner's steps), or it finished.
    last_moved = max(moved.values(), default=killed_at)
    await _wait_for(lambda: all(s.done or s.arrivals[-1] > last_moved for s in in_flight), 20 * lease_ttl_s + 300,
                    "every stream in flight at the kill resumed")
    await asyncio.sleep(after_s)
    await asyncio.to_thread(crowd.finish)
    resumed = [_resumed_at(s.arrivals, killed_at) for s in in_flight]
    pauses = [gap for gap, _ in resumed]
    config_dir = fleet.model
    config = load_config(config_dir)
    vocab, eos = model_shape(config).vocab_size, frozenset(eos_token_ids(config, config_dir))
    finished = [s for s in crowd.requests if s.done]
    matching = [s for s in finished if s.tokens == simulated_continuation(s.prompt, s.max_tokens, SEED, vocab, eos)]
    return FailoverResult(
        workers=len(workers), streams=streams, lease_ttl_s=lease_ttl_s, leases_held_at_kill=len(expiry),
        lease_moved_s=[moved[w] - killed_at for w in sorted(moved)],
        after_expiry_s=[moved[w] - expiry[w] for w in sorted(moved)],
        stream_pause_s=pauses, all_resumed_s=max((at - killed_at for _, at in resumed), default=0.0),
        requests_finished=len(finished), requests_matching=len(matching),
        requests_lost=len(crowd.requests) - len(finished),
        recomputed_tokens=await asyncio.to_thread(_recomputed_tokens, fleet), errors=crowd.errors[:10],
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--profile", default="llama-3-8b-h100")
    parser.add_argument("--streams-per-worker", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--warmup", type=float, default=10.0)
    parser.add_argument("--lease-ttl", type=float, default=10.0)
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/fleet_failover.json"))
    args = parser.parse_args(argv)
    model = str(prepare_default_model())
    with tempfile.TemporaryDirectory(prefix="llmserve-failover-") as tmp:
        fleet = Fleet(model, args.profile, args.workers, 1, Path(tmp), scheduler_args=["--lease-ttl", str(args.lease_ttl)],
                      worker_args=["--seed", str(SEED)], scheduler_log_level="INFO")  # the takeovers' log lines
        with fleet:
            result = asyncio.run(run_failover(fleet, args.streams_per_worker * args.workers, args.prompt_len,
                                              args.max_tokens, args.warmup, args.lease_ttl))
    print(summary(result))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"machine": platform.processor() or platform.machine(),
                                       "profile": args.profile, "result": asdict(result)}, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()

"""The soak's instruments: a sampler thread (KV-cache use, process memory, request counts) and its summary.

KV-cache use is read where the engine loop commits it (the worker's stats hash in Redis: free / total
blocks as of the last committed step), memory from /proc/<pid>/status (VmRSS) of the scheduler and
worker processes, and Redis's own `used_memory`.
"""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import asdict, dataclass, field

import redis

from llmserve.local_cluster import LocalCluster
from scheduler_service import keys
from tests.e2e.soak_load import Tally

SAMPLE_EVERY_S = 0.5
ROLES = ("scheduler", "worker")


def rss_kib(pid: int) -> int:
    """Resident set size of a process, in KiB (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except FileNotFoundError:
        pass
    return 0


@dataclass
class Sample:
    t: float  # seconds since the load started
    kv_used: float  # fraction of the device KV-cache blocks in use
    preemptions: int
    swaps: int
    running: int
    waiting: int
    swapped: int
    rss_kib: dict[str, int]
    redis_used_bytes: int
    requests: dict[str, int]


@dataclass
class Sampler:
    """Samples every SAMPLE_EVERY_S seconds on its own thread until stopped."""

    cluster: LocalCluster
    tally: Tally
    samples: list[Sample] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _t0: float = 0.0

    def start(self) -> None:
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="soak-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def now(self) -> float:
        return time.monotonic() - self._t0

    def _run(self) -> None:
        client = redis.Redis.from_url(self.cluster.redis_url)
        pids = {role: self.cluster.pid(role) for role in ROLES}
        w = self.cluster.worker_address
        try:
            while not self._stop.wait(SAMPLE_EVERY_S):
                with client.pipeline(transaction=False) as pipe:
                    pipe.hgetall(keys.stats(w))
                    pipe.llen(keys.running(w))
                    pipe.llen(keys.waiting(w))
                    pipe.llen(keys.swapped(w))
                    pipe.info("memory")
                    stats_raw, running, waiting, swapped, memory = pipe.execute()
                stats = {k.decode(): int(v) for k, v in stats_raw.items()}
                total = stats.get("total", 0)
                self.samples.append(Sample(
                    t=self.now(),
                    kv_used=(total - stats.get("free", total)) / total if total else 0.0,
                    preemptions=stats.get("preemptions", 0), swaps=stats.get("swaps", 0),
                    running=running, waiting=waiting, swapped=swapped,
                    rss_kib={role: rss_kib(pid) for role, pid in pids.items()},
                    redis_used_bytes=int(memory["used_memory"]),
                    requests=self.tally.snapshot(),
                ))
        finally:
            client.close()


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]) of a non-empty list."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def rss_growth(loaded: list[Sample], role: str) -> tuple[int, int]:
    """Median RSS (KiB) over the first and over the last third of the loaded samples.

    Medians of thirds, not two single readings: RSS moves with the batch in flight (activations,
    gRPC buffers), a leak moves the whole last third.
    """
    third = max(1, len(loaded) // 3)
    first = int(statistics.median(s.rss_kib[role] for s in loaded[:third]))
    last = int(statistics.median(s.rss_kib[role] for s in loaded[-third:]))
    return first, last


def rss_trend(loaded: list[Sample], role: str) -> float:
    """Least-squares slope of RSS over the loaded samples, in MiB per minute (reported, not asserted:
    a slow creep shows here long before it crosses the growth bound)."""
    ts = [s.t for s in loaded]
    ys = [s.rss_kib[role] / 1024 for s in loaded]
    mean_t, mean_y = statistics.fmean(ts), statistics.fmean(ys)
    var = sum((t - mean_t) ** 2 for t in ts)
    return 60 * sum((t - mean_t) * (y - mean_y) for t, y in zip(ts, ys)) / var if var else 0.0


def kv_summary(loaded: list[Sample]) -> dict[str, float]:
    used = [s.kv_used for s in loaded]
    return {
        "p10": percentile(used, 10), "p50": percentile(used, 50), "p90": percentile(used, 90),
        "min": min(used), "max": max(used),
        "fraction_above_90": sum(u > 0.9 for u in used) / len(used),
    }


def as_json(samples: list[Sample]) -> list[dict[str, object]]:
    return [asdict(s) for s in samples]

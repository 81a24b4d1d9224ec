"""Per-request timings and the summary metrics of vLLM's serving benchmark."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field


@dataclass
class RequestTiming:
    """One request as a client saw it (seconds, on one monotonic clock)."""

    prompt_len: int
    sent: float
    # Arrival time of every output token (tokens of one message share its time).
    token_times: list[float] = field(default_factory=list)
    done: float = 0.0
    error: str = ""

    @property
    def output_len(self) -> int:
        return len(self.token_times)

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.sent

    @property
    def e2e(self) -> float:
        return self.done - self.sent

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first; None for single-token outputs."""
        if self.output_len < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (self.output_len - 1)

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]


@dataclass(frozen=True)
class Distribution:
    mean: float
    median: float
    p99: float

    @classmethod
    def of(cls, values: list[float]) -> Distribution:
        if not values:
            return cls(float("nan"), float("nan"), float("nan"))
        ordered = sorted(values)
        p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
        return cls(statistics.fmean(ordered), statistics.median(ordered), p99)


@dataclass(frozen=True)
class Summary:
    """What one backend achieved on one workload."""

    backend: str
    duration_s: float
    completed: int
    failed: int
    input_tokens: int
    output_tokens: int
    # None where the backend cannot observe them (static batching returns whole outputs).
    ttft_ms: Distribution | None = None
    tpot_ms: Distribution | None = None
    itl_ms: Distribution | None = None
    e2e_ms: Distribution | None = None

    @property
    def request_throughput(self) -> float:
        return self.completed / self.duration_s

    @property
    def output_throughput(self) -> float:
        return self.output_tokens / self.duration_s

    @property
    def total_throughput(self) -> float:
        return (self.input_tokens + self.output_tokens) / self.duration_s


def summarize(backend: str, timings: list[RequestTiming], duration_s: float) -> Summary:
    ok = [t for t in timings if not t.error and t.output_len]
    ms = 1000.0
    return Summary(
        backend=backend,
        duration_s=duration_s,
        completed=len(ok),
        failed=len(timings) - len(ok),
        input_tokens=sum(t.prompt_len for t in ok),
        output_tokens=sum(t.output_len for t in ok),
        ttft_ms=Distribution.of([t.ttft * ms for t in ok]),
        tpot_ms=Distribution.of([t.tpot * ms for t in ok if t.tpot is not None]),
        itl_ms=Distribution.of([x * ms for t in ok for x in t.itls]),
        e2e_ms=Distribution.of([t.e2e * ms for t in ok]),
    )

"""Where a start-up spent its time, phase by phase, for one log line per process.

    worker ready in 6.2 s (imports 2.9 s, kernels 0.4 s, model 1.6 s, server 0.1 s, registration 0.1 s; 5.9 s of CPU)
    llmserve up: serving after 8.4 s (redis 0.1 s and worker 6.2 s and scheduler 5.0 s in parallel, first lease 0.3 s)

A phase is a span of wall time; consecutive phases marked `parallel` ran at the same time and count
as the longest of them. Whatever no phase covers is shown as `other`, so the parts add up to the
total (to the rounding of the line). A process's own line also gives the CPU time it has used: on a
shared machine, wall time far above it is time spent waiting for a core. The report also travels as
JSON: each local service sends its own to `llmserve up` (llmserve/ready_pipe.py), which puts them in
its line.
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

# A remainder shorter than this is rounding, not a phase worth a word.
_MIN_OTHER_S = 0.05
# A phase given a note says so in the log once it has run this long: a long start-up explains itself while it
# runs, not only in its `ready in` line minutes later.
SLOW_PHASE_S = 10.0
# Why a worker's phases can take minutes (the CPU kernels' compile: 139 s for a float32 worker on a 2-core Zen 3
# EPYC, ~200 s for a bf16 one, most of it the paged decode attention; seconds to load from the cache).
NUMBA_COMPILE_NOTE = ("the first start on a machine (or after a kernel source changed) compiles the Numba kernels "
                      "into their cache, minutes on a small CPU; later starts load them in seconds")


@dataclass(frozen=True)
class Phase:
    """One named span of a start-up. parallel: ran at the same time as its parallel neighbours."""

    name: str
    seconds: float
    parallel: bool = False

    def __post_init__(self) -> None:
        if not self.name or ", " in self.name or " and " in self.name:
            raise ValueError(f"phase name must be non-empty without ', ' or ' and ', got {self.name!r}")
        if self.seconds < 0:
            raise ValueError(f"phase {self.name!r}: seconds must be non-negative, got {self.seconds}")


def _groups(phases: tuple[Phase, ...]) -> list[list[Phase]]:
    """Sequential phases alone, consecutive parallel ones together."""
    groups: list[list[Phase]] = []
    for phase in phases:
        if phase.parallel and groups and groups[-1][-1].parallel:
            groups[-1].append(phase)
        else:
            groups.append([phase])
    return groups


@dataclass(frozen=True)
class StartupReport:
    """A start-up's total wall time and the phases it went through (in order)."""

    total_s: float
    phases: tuple[Phase, ...] = field(default_factory=tuple)
    cpu_s: float | None = None  # CPU time of the process (all its threads), when the report is its own

    @property
    def accounted_s(self) -> float:
        """Wall time the phases cover: sequential ones add up, a parallel group counts its longest."""
        return sum(max(p.seconds for p in group) for group in _groups(self.phases))

    def seconds(self, name: str) -> float:
        """The named phase's seconds; KeyError when there is none."""
        for phase in self.phases:
            if phase.name == name:
                return phase.seconds
        raise KeyError(name)

    def summary(self) -> str:
        """`6.2 s (imports 2.9 s, ..., other 0.3 s)`: the total, then the parts."""
        parts = []
        for group in _groups(self.phases):
            words = " and ".join(f"{p.name} {p.seconds:.1f} s" for p in group)
            parts.append(f"{words} in parallel" if len(group) > 1 else words)
        other = self.total_s - self.accounted_s
        if other >= _MIN_OTHER_S:
            parts.append(f"other {other:.1f} s")
        cpu = f"; {self.cpu_s:.1f} s of CPU" if self.cpu_s is not None else ""
        return f"{self.total_s:.1f} s ({', '.join(parts)}{cpu})"

    def to_dict(self) -> dict[str, object]:
        return {"total_s": self.total_s, "cpu_s": self.cpu_s,
                "phases": [{"name": p.name, "seconds": p.seconds, "parallel": p.parallel} for p in self.phases]}

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> StartupReport:
        phases = data.get("phases", [])
        if not isinstance(phases, list):
            raise ValueError(f"phases must be a list, got {phases!r}")
        cpu = data.get("cpu_s")
        return cls(float(data["total_s"]),  # type: ignore[arg-type]
                   tuple(Phase(str(p["name"]), float(p["seconds"]), bool(p.get("parallel", False))) for p in phases),
                   None if cpu is None else float(cpu))  # type: ignore[arg-type]


_SUMMARY = re.compile(r"(?P<total>\d+\.\d) s \((?P<parts>[^();]*)(; (?P<cpu>\d+\.\d) s of CPU)?\)$")
_PART = re.compile(r"(?P<name>.+?) (?P<seconds>\d+\.\d) s")


def parse_summary(line: str) -> StartupReport:
    """The report a line ending in StartupReport.summary() shows (seconds to its 0.1 s rounding).

    `other` comes back as a phase of its own; ValueError when the line holds no summary.
    """
    match = _SUMMARY.search(line)
    if match is None:
        raise ValueError(f"no start-up summary in {line!r}")
    phases: list[Phase] = []
    for part in match.group("parts").split(", "):
        parallel = part.endswith(" in parallel")
        members = part.removesuffix(" in parallel").split(" and ") if parallel else [part]
        for member in members:
            found = _PART.fullmatch(member)
            if found is None:
                raise ValueError(f"not a phase: {member!r} in {line!r}")
            phases.append(Phase(found.group("name"), float(found.group("seconds")), parallel))
    cpu = match.group("cpu")
    return StartupReport(float(match.group("total")), tuple(phases), None if cpu is None else float(cpu))


class StartupTimer:
    """Times the phases of one start-up from `started` (time.monotonic(); default: now).

    cpu_clock: the process's CPU time for the report (None: leave it out, e.g. for a report made of
    other processes' start-ups).
    """

    def __init__(self, started: float | None = None, clock: Callable[[], float] = time.monotonic,
                 cpu_clock: Callable[[], float] | None = time.process_time) -> None:
        self._clock = clock
        self._cpu_clock = cpu_clock
        self.started = clock() if started is None else started
        self._phases: list[Phase] = []

    def elapsed(self) -> float:
        """Seconds since the start."""
        return self._clock() - self.started

    @contextlib.contextmanager
    def phase(self, name: str, note: str = "", slow_s: float = SLOW_PHASE_S) -> Iterator[None]:
        """Times the block as the phase `name` (recorded even when the block raises).

        note: why the phase can be slow, logged (from a timer thread) should it still run after `slow_s`.
        """
        begun = self._clock()
        slow = None
        if note:
            slow = threading.Timer(slow_s, log.info, ("start-up: %s still running after %.0f s: %s", name, slow_s, note))
            slow.daemon = True
            slow.start()
        try:
            yield
        finally:
            if slow is not None:
                slow.cancel()
            self.add(name, self._clock() - begun)

    def add(self, name: str, seconds: float, parallel: bool = False) -> None:
        """Records a phase measured elsewhere (e.g. another process's start-up)."""
        self._phases.append(Phase(name, max(0.0, seconds), parallel))

    def report(self) -> StartupReport:
        """The phases so far, with the time since the start as the total."""
        cpu = self._cpu_clock() if self._cpu_clock is not None else None
        return StartupReport(self.elapsed(), tuple(self._phases), cpu)

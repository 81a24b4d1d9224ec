"""How idle OpenMP threads wait (a short spin for a worker, sleeping for the tests); the cores a process may use.

Both are read by libgomp when torch loads, so they must be set before torch is imported; afterwards
they do nothing, and neither overrides a setting the user made (OMP_WAIT_POLICY or GOMP_SPINCOUNT).
"""

from __future__ import annotations

import os
import sys

# Spins of an idle libgomp thread before it sleeps: ~90 us on the 2-core AMD EPYC of docs/benchmarks.md
# (a pause instruction per spin). Threads that sleep at once pay a wake-up for every parallel region of
# a step (one sequence, default model: 22 ms a step sleeping, 15 spinning). A decode step runs its regions
# back to back in one compiled call (worker_service/models/compiled_decode.py), so a short spin covers the
# gaps: in-process, 1000 and 10000 spins give the same step at 1 and 64 sequences. Where the scheduler,
# Redis and the clients share the worker's cores, a long spin holds a core they wait for, between steps
# and while a thread waits for the other at a region's end: through the services the steady 64-sequence
# step's median over 16 runs each, alternating, was 121.8 ms spinning 10000 times (~0.9 ms) and 113.8
# spinning 1000 (docs/benchmarks-history.md).
WORKER_SPIN_COUNT = 1_000


def _already_decided() -> bool:
    # Too late once torch is loaded; never over the user's own setting.
    return "torch" in sys.modules or "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ


def prefer_short_spins() -> None:
    """A worker's setting: idle OpenMP threads spin WORKER_SPIN_COUNT times, then sleep.

    libgomp cuts any spin to ~1000 turns while the process's OpenMP threads outnumber its cores, so
    the gain needs one thread team: the worker runs its torch work on one thread (worker_service/model_thread.py).
    A core taken by another busy process makes spinning cost instead (one step at one sequence with a
    busy-looping process beside it: 40 ms spinning, 22 sleeping); `OMP_WAIT_POLICY=PASSIVE` is then
    the better setting, as it is for the test suite.
    """
    if not _already_decided():
        os.environ["GOMP_SPINCOUNT"] = str(WORKER_SPIN_COUNT)


def prefer_sleeping_threads() -> None:
    """Idle OpenMP threads sleep at once (the test suite's setting: it runs services on busy cores).

    On 2 busy cores a decode-sized matmul (8 x 576 by 576 x 1536) took 0.36 ms with sleeping threads
    and 5-11 ms with threads spinning libgomp's default (docs/benchmarks-history.md).
    """
    if not _already_decided():
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"


def usable_cpus() -> int:
    """Cores this process may run on: a container's cpuset or taskset can allow fewer than the host has."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1

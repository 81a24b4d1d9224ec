"""OpenMP threads that sleep when idle, for processes that share their cores; the cores a process may use."""

from __future__ import annotations

import os
import sys


def prefer_sleeping_threads() -> None:
    """Idle OpenMP threads sleep instead of spinning (unless the user chose otherwise).

    Read by libgomp when torch loads, so it must run before torch is imported; afterwards it does
    nothing. A worker shares its cores with the scheduler, Redis and clients (and the tests with the
    services they start); spinning threads then fight them for the CPU: on 2 busy cores a decode-sized
    matmul (8 x 576 by 576 x 1536) took 0.36 ms with sleeping threads and 5-11 ms with spinning ones.
    """
    if "torch" in sys.modules:
        return
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def usable_cpus() -> int:
    """Cores this process may run on: a container's cpuset or taskset can allow fewer than the host has."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1

"""Python's garbage collector around a service's start-up: paused while it loads, its heap frozen after.

A worker holds ~415 k Python objects once torch, Numba, the tokenizer and the model are loaded (a
scheduler ~95 k), and a full collection scans every one of them. The default model's worker ran six
during its start-up on a 2-core AMD EPYC, 19 to 164 ms each, 0.54 s in all, for ~200 objects freed;
a server that has moved enough objects into the oldest generation runs one more now and then while
serving, ~160 ms in which no step runs. So a service's command pauses automatic collection before its
imports, and once the service has loaded (after its model, before it reports ready) one collection
frees what start-up left and ``gc.freeze()`` moves every live object to the permanent generation,
which later collections never scan. vLLM freezes its engine's start-up heap for the same reason.

Settling also hands the C heap's free pages back to the system (glibc's ``malloc_trim``): loading a
model frees large temporaries (fused projections' concatenations, checkpoint copies) that glibc keeps
resident while memory above them is in use, ~200 MB in the default model's worker
(docs/benchmarks-history.md).

Only a process that paused the collector settles its heap: a service started in-process (the tests,
the offline API's cluster) keeps the collector as its host process has it.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import time
from pathlib import Path

log = logging.getLogger(__name__)


def pause_collection() -> None:
    """No automatic collection until :func:`settle_startup_heap` (a service's command, before its imports)."""
    gc.disable()


def settle_startup_heap(service: str) -> float | None:
    """Collect once, freeze what is alive and collect automatically again: the seconds it took, or None (and
    nothing done) when collection was not paused."""
    if gc.isenabled():
        return None
    started = time.perf_counter()
    freed = gc.collect()
    gc.freeze()
    gc.enable()
    returned = return_free_heap()
    seconds = time.perf_counter() - started
    log.info("%s start-up heap frozen: %d objects kept out of later collections, %d freed, %s (%.0f ms)",
             service, gc.get_freeze_count(), freed,
             "no malloc_trim" if returned is None else f"{returned / 2**20:.0f} MiB of free heap returned",
             seconds * 1e3)
    return seconds


def return_free_heap() -> int | None:
    """Gives the C heap's free pages back to the system: the bytes of resident anonymous memory that went (0 where
    /proc does not say), or None where the C library has no ``malloc_trim`` (not glibc)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    before = resident_anonymous_bytes()
    trim(0)
    after = resident_anonymous_bytes()
    return 0 if before is None or after is None else max(0, before - after)


def resident_anonymous_bytes() -> int | None:
    """This process's resident anonymous memory (RssAnon: heap and mappings, not files), None without /proc."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return None

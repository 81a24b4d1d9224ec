"""Python's garbage collector around a service's start-up: paused while it loads, its heap frozen after.

A worker holds ~415 k Python objects once torch, Numba, the tokenizer and the model are loaded (a
scheduler ~95 k), and a full collection scans every one of them. The default model's worker ran six
during its start-up on a 2-core AMD EPYC, 19 to 164 ms each, 0.54 s in all, for ~200 objects freed;
a server that has moved enough objects into the oldest generation runs one more now and then while
serving, ~160 ms in which no step runs. So a service's command pauses automatic collection before its
imports, and once the service has loaded (after its model, before it reports ready) one collection
frees what start-up left and ``gc.freeze()`` moves every live object to the permanent generation,
which later collections never scan. vLLM freezes its engine's start-up heap for the same reason.

Only a process that paused the collector settles its heap: a service started in-process (the tests,
the offline API's cluster) keeps the collector as its host process has it.
"""

from __future__ import annotations

import gc
import logging
import time

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
    seconds = time.perf_counter() - started
    log.info("%s start-up heap frozen: %d objects kept out of later collections, %d freed (%.0f ms)",
             service, gc.get_freeze_count(), freed, seconds * 1e3)
    return seconds

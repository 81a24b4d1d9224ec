"""Kernel variants compiled when a worker first needs them, not at import.

The CPU kernels are compiled at import (or loaded from Numba's cache) for float32 caches, with explicit
signatures: Numba then locks a kernel, so a call with other types is an error, never a compilation in the
middle of a step. Their variants for bf16 caches (read as int16) take as long again to compile (the decode
attention's alone ~55 s of a first start's ~200 s on a 2-core EPYC) and only a bf16 worker runs them, so
they are compiled (or loaded from the cache) by ``require`` where the worker learns its dtype, at its
start, and the kernel is locked again.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from numba.core.dispatcher import Dispatcher
from numba.core.typing import Signature

_LOCK = threading.Lock()


def has_signatures(kernel: Dispatcher, signatures: Sequence[Signature]) -> bool:
    """Whether every one of ``signatures`` is compiled (or loaded) in ``kernel``."""
    return all(tuple(sig.args) in kernel.overloads for sig in signatures)


def require(kernel: Dispatcher, signatures: Sequence[Signature]) -> None:
    """Compiles the ``signatures`` of ``kernel`` it lacks, or loads them from Numba's cache; it stays locked."""
    if has_signatures(kernel, signatures):
        return
    with _LOCK:
        kernel.disable_compile(False)
        try:
            for sig in signatures:
                if tuple(sig.args) not in kernel.overloads:
                    kernel.compile(sig)
        finally:
            kernel.disable_compile(True)

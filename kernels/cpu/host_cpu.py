"""What the CPU this process runs on is, as LLVM (and so Numba's code) sees it.

Kernel choices that were measured per CPU family key on these: the panel GEMM and the GEMV without
software prefetch on AVX-512 AMD cores (Zen 4 and later), wide prefill tiles on any AVX-512 CPU.
"""

from __future__ import annotations

import functools

import llvmlite.binding as llvm


@functools.cache
def has_avx512() -> bool:
    """AVX-512 Foundation: 32 vector registers of 16 float32."""
    return bool(llvm.get_host_cpu_features().get("avx512f", False))


@functools.cache
def is_amd_avx512() -> bool:
    """An AMD core with AVX-512 (LLVM names AMD's cores ``znver*``; Zen 4 is the first with AVX-512)."""
    return has_avx512() and llvm.get_host_cpu_name().startswith("znver")

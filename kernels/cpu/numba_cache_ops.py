"""CPU ``reshape_and_cache`` with Numba: each token's keys/values copied straight into its cache slot.

Same signature and semantics as :func:`llmserve.kernels.cpu.cache_ops.reshape_and_cache`
(the torch twin, which stays the fallback for tensors it does not cover). The
torch version is advanced-index assignments with their index tensors rebuilt per
call: ~120 us for one token and ~3.3 ms for 512 on one core, paid by every layer
of every step. This is a plain copy loop, ~1 us for one token.

It moves bits, not numbers: caches of any 2-, 4- or 8-byte dtype are viewed as
integers of that size, so bf16 and fp16 take the same compiled code as float32.

    key[t, h, d]   -> key_cache[b, h, d // x, o, d % x]      with slot[t] = b * block_size + o
    value[t, h, d] -> value_cache[b, h, d, o]
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from llmserve.kernels.cache_op_checks import check_reshape_and_cache_args
from llmserve.kernels.cpu._numba_bf16 import narrow_to
from llmserve.kernels.cpu import cache_ops as torch_cache_ops
from llmserve.kernels.cpu.numpy_views import numpy_view
from llmserve.kernels.metadata_memo import arguments_layout, reduce_once
from llmserve.kernels.numba_cache import versioned_cache

# Before any decorator below: the cache of these kernels is invalidated by a change to any kernel source.
versioned_cache()

# Element size -> the integer dtype the copy sees.
_BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}
# Tokens from which the copy runs over tokens on several threads. A decode step's tokens each write one
# float32 into each of 64 cache lines of a value block (its [D, BS] layout), lines mostly out of the caches:
# for 64 tokens of the default model, 30 layers, ~100 us a layer on one thread. Measured inside the worker's
# step (64 sequences, each kernel's own time, two alternating rounds on a 2-core Zen 4): 2.95-3.09 ms a step
# on one thread, 1.81-1.83 ms on two. At 16 sequences two threads saved only 0.2 ms (0.75-0.83 -> 0.58-0.60).
PARALLEL_MIN_TOKENS = 32


def _signatures(compiled_step: bool = False) -> list[object]:
    """Bits of one integer type into caches of that type (what reshape_and_cache passes); with ``compiled_step`` also
    float32 keys and values into float32 or bf16 caches (the compiled decode step's, worker_service/models)."""
    pairs = [(element, element) for element in (numba.int16, numba.int32, numba.int64)]
    if compiled_step:
        pairs += [(numba.float32, numba.float32), (numba.float32, numba.int16)]
    # key/value may be strided views (slices of a fused QKV output): any layout.
    return [numba.void(kv[:, :, :], kv[:, :, :], cache[:, :, :, :, ::1], cache[:, :, :, ::1], numba.int64[::1])
            for kv, cache in pairs]


@numba.njit(inline="always")
def write_token(key: np.ndarray, value: np.ndarray, key_cache: np.ndarray, value_cache: np.ndarray,
                 slots: np.ndarray, t: int) -> None:
    # Bits of the caches' own type are copied; float32 keys/values into a bf16 cache (the compiled decode
    # step's GEMV form) are rounded to bf16.
    slot = slots[t]
    if slot < 0:  # padding
        return
    block_size, chunks, x = value_cache.shape[3], key_cache.shape[2], key_cache.shape[4]
    block, offset = slot // block_size, slot % block_size
    for h in range(key.shape[1]):
        for c in range(chunks):
            for i in range(x):
                key_cache[block, h, c, offset, i] = narrow_to(key[t, h, c * x + i], key_cache)
        for d in range(value.shape[2]):
            value_cache[block, h, d, offset] = narrow_to(value[t, h, d], value_cache)


@numba.njit(_signatures(), cache=True, nogil=True)
def _write_serial(key: np.ndarray, value: np.ndarray, key_cache: np.ndarray, value_cache: np.ndarray,
                  slots: np.ndarray) -> None:
    for t in range(key.shape[0]):
        write_token(key, value, key_cache, value_cache, slots, t)


@numba.njit(_signatures(compiled_step=True), parallel=True, cache=True, nogil=True)
def write_parallel(key: np.ndarray, value: np.ndarray, key_cache: np.ndarray, value_cache: np.ndarray,
                   slots: np.ndarray) -> None:
    # Slots are distinct (a reshape_and_cache precondition), so tokens never write the same element.
    for t in numba.prange(key.shape[0]):
        write_token(key, value, key_cache, value_cache, slots, t)


def supports(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> bool:
    """Whether :func:`reshape_and_cache` copies these with Numba (otherwise the torch kernel runs)."""
    tensors = (key, value, key_cache, value_cache)
    return (
        all(isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.dtype == key_cache.dtype for t in tensors)
        and key_cache.element_size() in _BITS
        and key_cache.is_contiguous()
        and value_cache.is_contiguous()
        and key.dim() == 3
        and value.dim() == 3
        and key.stride(-1) == 1
        and value.stride(-1) == 1
    )


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Writes each token's key/value (``[T, num_kv_heads, head_size]``) into its cache slot; see the torch twin."""

    def validate() -> np.ndarray | None:
        if not supports(key, value, key_cache, value_cache):
            return None
        check_reshape_and_cache_args(key, value, key_cache, value_cache, slot_mapping)
        return slot_mapping.to(torch.int64).contiguous().numpy()

    # Decided and checked once per step and layout: every layer passes the same slots and tensors laid out
    # alike (the layout covers all that `supports` reads but the types).
    slots = None
    if all(isinstance(t, torch.Tensor) for t in (key, value, key_cache, value_cache, slot_mapping)):
        layout = arguments_layout(key, value, key_cache, value_cache)
        slots = reduce_once(slot_mapping, (), ("numba cache write", layout), validate)
    if slots is None:
        torch_cache_ops.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
        return
    if slots.shape[0] == 0:
        return
    bits = _BITS[key_cache.element_size()]
    kernel = write_parallel if key.shape[0] >= PARALLEL_MIN_TOKENS else _write_serial
    kernel(key.view(bits).numpy(), value.view(bits).numpy(), numpy_view(key_cache, bits), numpy_view(value_cache, bits),
           slots)

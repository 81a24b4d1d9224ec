"""The elementwise ops between a decoder layer's matmuls, fused: RMSNorm (+ residual add), rotary, SiLU-and-mul.

Each op has a torch implementation that computes exactly what transformers' modules
compute, in the same dtype steps (float32 norms of 16-bit activations, and so on),
and a Numba kernel (``_numba_ops``) that runs instead for float32 tensors on the CPU,
where the torch version is several dispatched ops per call. The torch version serves
every other case (CUDA, bf16/fp16 on the CPU) and is the Numba kernels' reference.

Conventions as vLLM's layers: ``add_rms_norm`` keeps the running residual stream in
``residual`` (updated in place) and returns the normalised input of the next block.
"""

from __future__ import annotations

import numba
import torch
import torch.nn.functional as F

from worker_service.models import _numba_ops as nb
from worker_service.models._numba_ops import PARALLEL_MIN_ELEMENTS


def _numba_ok(*tensors: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)


def full_team() -> int:
    """Numba's threads for the next parallel kernel: the worker's count (torch's), all of them (returned).

    Numba's count is per calling thread and the decode-attention kernel lowers it for small
    calls (llmserve.kernels.cpu.numba_attention.kernel_threads); reading it costs ~1 us, setting it ~6 us.
    """
    want = min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS)
    if numba.get_num_threads() != want:
        numba.set_num_threads(want)
    return want


def _variant(serial: object, parallel: object, elements: int) -> object:
    if elements < PARALLEL_MIN_ELEMENTS:
        return serial
    full_team()
    return parallel


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm of ``x`` ``[T, H]``: a new tensor."""
    if _numba_ok(x, weight) and x.is_contiguous():
        out = torch.empty_like(x)
        _variant(nb.rms_norm_serial, nb.rms_norm_parallel, x.numel())(x.numpy(), weight.numpy(), eps, out.numpy())
        return out
    dtype = x.dtype
    wide = x.to(torch.float32)
    variance = wide.pow(2).mean(-1, keepdim=True)
    return weight * (wide * torch.rsqrt(variance + eps)).to(dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``residual += x`` in place, then RMSNorm of the new residual (written over ``x`` where possible)."""
    if _numba_ok(x, residual, weight) and x.is_contiguous() and residual.is_contiguous():
        kernel = _variant(nb.add_rms_norm_serial, nb.add_rms_norm_parallel, x.numel())
        kernel(x.numpy(), residual.numpy(), weight.numpy(), eps, x.numpy())
        return x
    residual.add_(x)
    return rms_norm(residual, weight, eps)


def apply_rotary(qkv: torch.Tensor, heads: int, positions: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> None:
    """Rotates the first ``heads`` heads of ``qkv`` ``[T, H, D]`` in place (halves paired): q's and k's heads of the
    fused QKV rows. cos/sin ``[max_positions, D/2]`` in qkv's dtype."""
    # The kernels index qkv's heads unchecked: a count past them would write outside the rows.
    if not 0 <= heads <= qkv.shape[1]:
        raise ValueError(f"cannot rotate {heads} heads of a [T, {qkv.shape[1]}, D] qkv")
    if _numba_ok(qkv, cos, sin) and qkv.is_contiguous():
        kernel = _variant(nb.rotary_serial, nb.rotary_parallel, qkv.shape[0] * heads * qkv.shape[2])
        kernel(qkv.numpy(), heads, positions.numpy(), cos.numpy(), sin.numpy())
        return
    qk = qkv[:, :heads]
    half = qk.shape[-1] // 2
    c = cos[positions].unsqueeze(1)  # [T, 1, D/2]
    s = sin[positions].unsqueeze(1)
    x1, x2 = qk[..., :half], qk[..., half:]
    # transformers: q * cos + rotate_half(q) * sin, each product rounded in qk's dtype.
    rotated1 = x1 * c - x2 * s
    rotated2 = x2 * c + x1 * s
    x1.copy_(rotated1)
    x2.copy_(rotated2)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of ``gate_up`` ``[T, 2I]`` (the gate's I features first): ``[T, I]``."""
    width = gate_up.shape[-1] // 2
    if _numba_ok(gate_up) and gate_up.is_contiguous():
        out = torch.empty(gate_up.shape[0], width, dtype=gate_up.dtype)
        _variant(nb.silu_and_mul_serial, nb.silu_and_mul_parallel, out.numel())(gate_up.numpy(), out.numpy())
        return out
    return F.silu(gate_up[:, :width]) * gate_up[:, width:]

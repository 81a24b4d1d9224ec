"""A projection ``x @ W^T (+ b)`` whose weight is laid out once, at load, for the CPU's fastest GEMM.

torch's F.linear on a float32 CPU tensor calls MKL's sgemm, which on AMD processors
takes its AVX2 code path whatever the CPU offers; oneDNN (bundled with torch as
mkldnn) picks its kernels by the CPU's actual ISA. oneDNN also takes a weight reordered
ahead of time into its blocked layout, so a call reads the weight once, sequentially,
instead of packing it again per call as sgemm does. On the 2-core AMD EPYC (AVX-512) of
docs/benchmarks.md, the default model's matmuls of one decode step took, in one run:

    rows            1      4     16     64     512
    F.linear (MKL)  12.3   28.3   41.1  120.1  713.8 ms
    oneDNN, packed   7.1    6.5   12.7   38.5  305.8 ms

(every layer's four projections plus the LM head; docs/benchmarks-history.md). One
packing serves every row count: the row count given to the reorder is only a hint,
and hints from 16 to 256 measured the same.

oneDNN builds (JIT-compiles) a primitive for every input row count it sees and keeps it in its
primitive cache (1024 entries): serving varies the row count every step, and the cache's growth
and evictions grew a worker's memory by gigabytes (599 row counts twice over the default model's
shapes: 458 MB -> 4.8 GB). Inputs are therefore padded to a bounded set of row counts
(``bucket_rows``): at most 12.5 % more rows from 64 rows up, and at most 7 more below, where
reading the weights, not the rows, sets a projection's time. RSS over that loop then stays bounded
(458 -> 702 MB, unchanged on the second and third pass).

On AVX-512 AMD CPUs a float32 weight is laid out in column panels instead and multiplied by a
Numba register-tile kernel (models/_numba_panels.py): on a Zen 4 faster than oneDNN at 16 and 512
rows, even at 64-100, no row buckets, and each row's result independent of the rows beside it.
``--cpu-matmul`` chooses (``auto``: panels where they were measured faster; ``onednn``; ``panels``).

Where neither takes the weight (CUDA, float16 without AVX512-FP16, a torch built without oneDNN)
the projection keeps the dense weight and calls F.linear.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
import torch.nn.functional as F

from llmserve.kernels.cpu.host_cpu import is_amd_avx512
from shared.defaults import CPU_MATMULS
from worker_service.models._numba_panels import pack_panels, panel_matmul, panel_widths
from worker_service.models.fused_ops import full_team

log = logging.getLogger(__name__)

# The row count oneDNN lays the weight out for: a decode batch (the bulk of serving steps).
PACK_ROWS_HINT = 64
_PACKABLE_DTYPES = (torch.float32, torch.bfloat16)


def _pack(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight in oneDNN's blocked layout, or None where oneDNN cannot take it."""
    if weight.device.type != "cpu" or weight.dtype not in _PACKABLE_DTYPES or not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACK_ROWS_HINT)
    except (RuntimeError, AttributeError) as exc:  # an ISA or build without the path: F.linear serves
        log.info("oneDNN cannot pack a %s %s weight (%s); using F.linear", weight.dtype, tuple(weight.shape), exc)
        return None


def onednn_has_kernels(dtype: torch.dtype) -> bool:
    """Whether oneDNN (torch's mkldnn) has matmul kernels for the 16-bit ``dtype`` on this CPU."""
    check = {torch.bfloat16: "_is_mkldnn_bf16_supported", torch.float16: "_is_mkldnn_fp16_supported"}[dtype]
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        return bool(getattr(torch.ops.mkldnn, check)())
    except (AttributeError, RuntimeError):  # a torch whose oneDNN lacks the query
        return False


# The instructions oneDNN's 16-bit matmul kernels need, by dtype: bf16 kernels do not serve float16.
_16BIT_KERNELS_NEED = {torch.bfloat16: ("bfloat16", "AVX512-BF16 or AMX"),
                       torch.float16: ("float16", "AVX512-FP16 or AMX")}


def slow_dtype_warning(dtype: torch.dtype, device: torch.device) -> str | None:
    """Why a 16-bit ``dtype`` will run slower than float32 on this CPU, or None.

    Without the dtype's instructions oneDNN has no kernels for it and the projections fall back to
    generic ones: on a 2-core AVX2 EPYC, a [64, 576] x [576, 3072] projection took 12.1 ms in bf16 and
    10.1 ms in fp16 against 1.65 ms in float32, and `make bench`'s workload ran at 21.8 output tok/s in
    bf16 against 103.9 in float32 (docs/benchmarks-history.md). A CPU can have one dtype's kernels and
    not the other's: on a 2-core AMD Zen 4 (AVX512-BF16, no AVX512-FP16) the same projection took 0.62 ms
    in bf16, 5.9 ms in fp16 and 1.15 ms in float32; the message then names bf16 as the 16-bit way out.
    """
    if device.type != "cpu" or dtype not in _16BIT_KERNELS_NEED or onednn_has_kernels(dtype):
        return None
    name, needs = _16BIT_KERNELS_NEED[dtype]
    way_out = "--dtype float32 (the CPU default) unless memory is the limit"
    if dtype != torch.bfloat16 and onednn_has_kernels(torch.bfloat16):
        way_out = "--dtype bfloat16, which this CPU has kernels for, or --dtype float32 (the CPU default)"
    return (f"--dtype {name}: this CPU ({torch.backends.cpu.get_cpu_capability()}) has no {name} matmul kernels "
            f"(oneDNN needs {needs}), so the model runs several times slower than in float32; use {way_out}")


def use_panels(choice: str, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether float32 projections run the panel kernel under ``--cpu-matmul choice``.

    ``auto`` takes it on AMD CPUs with AVX-512 (LLVM names them znver4 and later), where it was measured
    faster than oneDNN (docs/benchmarks-history.md); Intel's AVX-512 CPUs keep oneDNN until measured.
    """
    if choice not in CPU_MATMULS:
        raise ValueError(f"cpu_matmul must be one of {', '.join(CPU_MATMULS)}, got {choice!r}")
    if choice == "onednn" or dtype != torch.float32 or device.type != "cpu":
        return False
    if choice == "panels":
        return True
    return is_amd_avx512()


def can_use_panels(weight: torch.Tensor) -> bool:
    """Whether the panel kernel takes ``weight`` when panels are chosen (float32, CPU, whole 16-column vectors)."""
    return weight.dtype == torch.float32 and weight.device.type == "cpu" and panel_widths(weight.shape[0])


def bucket_rows(rows: int) -> int:
    """The row count a packed projection runs ``rows`` as: exact up to 16, then multiples of 8, 16 and 64.

    Each bucket is one oneDNN primitive per weight shape: 16 + 14 + 24 below 512 rows, one per 64 above.
    """
    if rows <= 16:
        return rows
    step = 8 if rows <= 128 else 16 if rows <= 512 else 64
    return -(-rows // step) * step


class Linear:
    """``x [T, in] -> [T, out]``; the weight is not kept dense when panels or oneDNN hold a laid-out copy.

    ``panels``: lay a float32 CPU weight out for the panel kernel (see ``use_panels``); a weight whose
    row count is not a multiple of 16 goes to oneDNN instead. ``panels_into``: where the panels go (a row of
    a stack, ``pack_panels``), else an array of their own.
    """

    __slots__ = ("out_features", "in_features", "bias", "_dense", "_packed", "_panels", "_panel_bias")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, panels: bool = False,
                 panels_into: np.ndarray | None = None) -> None:
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self._panels = self._panel_bias = None
        if panels and can_use_panels(weight):
            self._panels = pack_panels(weight.detach(), panels_into)
            self._panel_bias = (np.empty(0, np.float32) if bias is None
                                else bias.detach().to(torch.float32).contiguous().numpy())
        self._packed = None if self._panels is not None else _pack(weight)
        self._dense = weight if self._packed is None and self._panels is None else None

    @property
    def packed(self) -> bool:
        """Whether the weight is held laid out for a CPU kernel (panels or oneDNN) rather than dense."""
        return self._packed is not None or self._panels is not None

    @property
    def kernel(self) -> str:
        """Which kernel multiplies: ``panels``, ``onednn`` or ``dense`` (F.linear)."""
        return "panels" if self._panels is not None else "onednn" if self._packed is not None else "dense"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"projection of {self.in_features} features got input of shape {tuple(x.shape)}")
        if self._panels is not None:
            out = x.new_empty(x.shape[0], self.out_features)
            panel_matmul(out.numpy(), x.contiguous().numpy(), self._panels, self._panel_bias, full_team())
            return out
        if self._packed is None:
            return F.linear(x, self._dense, self.bias)
        rows = x.shape[0]
        padded = bucket_rows(rows)
        if padded != rows:
            wide = x.new_empty(padded, self.in_features)
            wide[:rows] = x
            wide[rows:] = 0
            return torch.ops.mkldnn._linear_pointwise(wide, self._packed, self.bias, "none", [], "")[:rows]
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")

"""The CPU kernels' bf16 variants: compiled where a bf16 worker loads its model, never by a float32 worker, and
never in a step (the kernels stay locked to their compiled signatures)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numba
import numpy as np
import pytest

from llmserve.kernels.cpu._numba_variants import has_signatures, require

F32, I16 = numba.void(numba.float32[::1]), numba.void(numba.int16[::1])


def _negate_in_place(x: np.ndarray) -> None:
    for i in range(x.shape[0]):
        x[i] = -x[i]


def test_require_compiles_what_is_missing_and_keeps_the_kernel_locked() -> None:
    kernel = numba.njit([F32])(_negate_in_place)
    assert has_signatures(kernel, [F32]) and not has_signatures(kernel, [I16])
    with pytest.raises(TypeError, match="No matching definition"):
        kernel(np.ones(3, dtype=np.int16))  # locked: not compiled on a call
    require(kernel, [I16])
    assert has_signatures(kernel, [F32, I16])
    x = np.arange(3, dtype=np.int16)
    kernel(x)
    assert x.tolist() == [0, -1, -2]
    with pytest.raises(TypeError, match="No matching definition"):
        kernel(np.ones(3, dtype=np.float64))  # still locked
    require(kernel, [I16])  # nothing to do
    assert len(kernel.overloads) == 2


_CHECK = """
import sys, torch
from llmserve.kernels.cpu import _numba_decode, _numba_prefill
from llmserve.kernels.cpu._numba_variants import has_signatures
from worker_service.config import WorkerConfig
from worker_service.model_runner import ModelRunner
from worker_service.models import _numba_decode_step as step

runner = ModelRunner(WorkerConfig(model=sys.argv[1], dtype=sys.argv[2], num_gpu_blocks_override=8, max_model_len=128))
print(has_signatures(_numba_decode.decode_attention, _numba_decode.BF16_SIGNATURES),
      has_signatures(_numba_prefill.context_attention, _numba_prefill.BF16_SIGNATURES),
      has_signatures(step.decode_layers, step._BF16_LAYERS))
"""


@pytest.mark.parametrize(("dtype", "expected"), [("float32", "False False False"), ("bfloat16", "True True True")])
def test_a_runner_holds_the_bf16_variants_only_for_bf16(tiny_llama_dir: Path, dtype: str, expected: str) -> None:
    """In a fresh process, before any step: a float32 runner has compiled none of them (the first start of a
    float32 worker skips their ~70 s of compilation), a bf16 one all of them (its steps compile nothing)."""
    done = subprocess.run([sys.executable, "-c", _CHECK, str(tiny_llama_dir), dtype], capture_output=True, text=True,
                          timeout=900, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.split("\n")[-2] == expected, done.stdout + done.stderr

"""The fused elementwise ops against transformers' modules and float64, on both of their paths.

The torch path (every dtype and device) must compute exactly what transformers'
Llama modules compute; the Numba path (float32 on the CPU) must agree with a
float64 reference within float32 rounding, and its serial and parallel variants
with each other.
"""

from __future__ import annotations

import numba
import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from worker_service.models import _numba_ops as nb
from worker_service.models import fused_ops

EPS = 1e-5


def _rms_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    wide = x.double()
    return (weight.double() * wide / torch.sqrt(wide.pow(2).mean(-1, keepdim=True) + EPS)).float()


@pytest.mark.parametrize("rows", [1, 7, 600])
def test_rms_norm_numba_matches_float64(rows: int) -> None:
    torch.manual_seed(rows)
    x, weight = torch.randn(rows, 576) * 3, torch.randn(576)
    out = fused_ops.rms_norm(x, weight, EPS)
    torch.testing.assert_close(out, _rms_reference(x, weight), rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_torch_path_is_transformers(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    module = LlamaRMSNorm(96, eps=EPS).to(dtype)
    module.weight.data = torch.randn(96).to(dtype)
    x = (torch.randn(5, 96) * 2).to(dtype)
    # A strided input takes the torch path even in float32.
    strided = torch.randn(5, 192).to(dtype)[:, ::2]
    for tensor in (x, strided):
        assert torch.equal(fused_ops.rms_norm(tensor, module.weight.data, EPS), module(tensor))


@pytest.mark.parametrize("rows", [3, 600])
def test_add_rms_norm_updates_the_residual_and_normalises_it(rows: int) -> None:
    torch.manual_seed(1)
    x, residual, weight = torch.randn(rows, 64), torch.randn(rows, 64), torch.randn(64)
    expected_residual = residual + x
    out = fused_ops.add_rms_norm(x.clone(), residual, weight, EPS)
    assert torch.equal(residual, expected_residual)
    torch.testing.assert_close(out, _rms_reference(expected_residual, weight), rtol=2e-6, atol=2e-6)
    # bf16 (torch path): transformers' order, the add rounded in bf16 before the norm.
    x16, r16, w16 = x.bfloat16(), residual.bfloat16(), weight.bfloat16()
    module = LlamaRMSNorm(64, eps=EPS).bfloat16()
    module.weight.data = w16
    expected = module(r16 + x16)
    out16 = fused_ops.add_rms_norm(x16, r16, w16, EPS)
    assert torch.equal(out16, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_is_transformers_rotary_bit_for_bit(dtype: torch.dtype) -> None:
    torch.manual_seed(2)
    tokens, heads, dim, positions_max = 9, 5, 32, 64
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    angles = torch.arange(positions_max).float()[:, None] * inv_freq
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    positions = torch.randint(0, positions_max, (tokens,))
    # q's and k's heads are the first of the fused QKV rows; the others are left as they are.
    qkv = torch.randn(tokens, heads + 2, dim).to(dtype)
    qk, others = qkv[:, :heads], qkv[:, heads:].clone()
    full_cos, full_sin = torch.cat([cos, cos], -1)[positions], torch.cat([sin, sin], -1)[positions]
    # transformers' layout: [batch, heads, T, D] with cos/sin [batch, T, D].
    expected, _ = apply_rotary_pos_emb(qk.transpose(0, 1)[None], qk.transpose(0, 1)[None], full_cos[None],
                                       full_sin[None])
    fused_ops.apply_rotary(qkv, heads, positions, cos, sin)
    assert torch.equal(qk, expected[0].transpose(0, 1))
    assert torch.equal(qkv[:, heads:], others)
    with pytest.raises(ValueError, match="cannot rotate"):
        fused_ops.apply_rotary(qkv, heads + 3, positions, cos, sin)


@pytest.mark.parametrize("rows", [2, 300])
def test_silu_and_mul_matches_float64(rows: int) -> None:
    torch.manual_seed(3)
    gate_up = torch.randn(rows, 2 * 256) * 4
    expected = (F.silu(gate_up[:, :256].double()) * gate_up[:, 256:].double()).float()
    torch.testing.assert_close(fused_ops.silu_and_mul(gate_up), expected, rtol=3e-6, atol=1e-6)
    bf16 = gate_up.bfloat16()
    assert torch.equal(fused_ops.silu_and_mul(bf16), F.silu(bf16[:, :256]) * bf16[:, 256:])


def test_silu_and_mul_saturates_like_torch_at_extreme_gates() -> None:
    gate = torch.tensor([-1e4, -100.0, -88.0, -20.0, -0.0, 0.0, 1e-30, 20.0, 88.0, 100.0, 1e4])
    gate_up = torch.cat([gate, torch.full_like(gate, 3.0)])[None]
    torch.testing.assert_close(fused_ops.silu_and_mul(gate_up), F.silu(gate)[None] * 3.0, rtol=3e-7, atol=1e-30)


def test_serial_and_parallel_variants_agree() -> None:
    torch.manual_seed(4)
    x, weight = torch.randn(33, 128), torch.randn(128)
    outs = [torch.empty_like(x), torch.empty_like(x)]
    for kernel, out in zip((nb.rms_norm_serial, nb.rms_norm_parallel), outs):
        kernel(x.numpy(), weight.numpy(), EPS, out.numpy())
    assert torch.equal(outs[0], outs[1])
    gate_up = torch.randn(33, 256)
    outs = [torch.empty(33, 128), torch.empty(33, 128)]
    for kernel, out in zip((nb.silu_and_mul_serial, nb.silu_and_mul_parallel), outs):
        kernel(gate_up.numpy(), out.numpy())
    assert torch.equal(outs[0], outs[1])


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="Numba runs one thread here")
def test_parallel_kernels_take_the_workers_threads_back_from_a_small_attention_call() -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        numba.set_num_threads(1)  # as the decode-attention kernel leaves it after a small call
        fused_ops.rms_norm(torch.randn(fused_ops.PARALLEL_MIN_ELEMENTS // 64, 64), torch.randn(64), EPS)
        assert numba.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)

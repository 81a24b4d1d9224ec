"""The Llama family (Llama, Mistral, Qwen2) as the worker runs it: fused projections over a flat token batch.

One step's tokens are one flat batch ``[T, hidden]`` (no padding, no batch axis), and
each decoder layer is:

    x, residual = add_rms_norm(x, residual)      residual += x; x = norm(residual)   (one pass)
    qkv = x @ W_qkv^T (+ b)                      q, k, v projections as one matmul
    rotary(qkv[:, :Hq + Hkv] of [T, heads, D])  q and k rotated in place, one pass
    o = attend(q, k, v)                          paged KV cache write + attention
    x = o @ W_o^T                                (all_reduce over tensor-parallel ranks)
    x, residual = add_rms_norm(x, residual)
    x = silu_and_mul(x @ W_gate_up^T) @ W_down^T (all_reduce)

    qkv row:  [ q: Hq * D | k: Hkv * D | v: Hkv * D ]

as vLLM, TGI and nano-vllm lay it out. transformers' modules compute the same
functions with separate projections, [1, heads, T, D] transposes and several ops
per norm and rotary; they stay the reference this model is tested against.
Logits are computed only for the rows asked for (the sampled positions).

Tensor parallelism keeps rank r's share of the heads and MLP features (the layout: llama_loader);
the row-parallel projections' partial sums are all-reduced, and their bias is added once, after.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from worker_service.attention import AttentionMetadata, attend
from worker_service.models.compiled_decode import CompiledDecode
from worker_service.models.fused_ops import add_rms_norm, apply_rotary, rms_norm, silu_and_mul
from worker_service.models.linear import Linear
from worker_service.models.rotary import RotaryTable


@dataclass
class LlamaLayer:
    """One decoder layer's weights in the fused layout (this rank's share)."""

    input_norm: torch.Tensor  # [hidden]
    qkv: Linear  # [(Hq + 2 Hkv) * D, hidden], with the fused bias (Qwen2)
    o: Linear  # [hidden, Hq * D], no bias: o_bias is added after the tensor-parallel reduction
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor  # [hidden]
    gate_up: Linear  # [2 * I, hidden]: gate's I rows, then up's
    down: Linear  # [hidden, I], no bias (as o)
    down_bias: torch.Tensor | None
    # Keys this layer attends back to (Mistral; Qwen2's sliding layers), None for full attention.
    sliding_window: int | None


@dataclass
class LlamaDims:
    """This rank's head counts and the constants of every layer."""

    num_heads: int
    num_kv_heads: int
    head_size: int
    rms_norm_eps: float
    # Row-parallel outputs are partial sums over this many ranks (1: no tensor parallelism).
    tp_size: int = 1

    @property
    def scaling(self) -> float:
        return self.head_size**-0.5


@dataclass(eq=False)
class LlamaModel:
    """The decoder and LM head of a Llama-family checkpoint, in the fused layout."""

    dims: LlamaDims
    embed: torch.Tensor  # [vocab, hidden]
    layers: list[LlamaLayer]
    norm: torch.Tensor
    lm_head: Linear  # [vocab, hidden]; the embedding's weights when they are tied
    rotary: RotaryTable
    # Decode steps as one compiled call through every layer (None: every step layer by layer).
    compiled: CompiledDecode | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata) -> torch.Tensor:
        """Hidden states after the final norm, ``[T, hidden]``, for the step's flat batch."""
        dims = self.dims
        heads = (dims.num_heads, dims.num_kv_heads, dims.num_kv_heads)
        tokens = input_ids.shape[0]
        if self.compiled is not None and self.compiled.covers(tokens, attn):
            return self.compiled(input_ids, positions, attn)
        eps = dims.rms_norm_eps
        residual = F.embedding(input_ids, self.embed)
        x = rms_norm(residual, self.layers[0].input_norm, eps)
        for index, layer in enumerate(self.layers):
            if index:
                x = add_rms_norm(x, residual, layer.input_norm, eps)
            qkv = layer.qkv(x).view(tokens, sum(heads), dims.head_size)
            apply_rotary(qkv, dims.num_heads + dims.num_kv_heads, positions, self.rotary.cos, self.rotary.sin)
            q, k, v = qkv.split(heads, dim=1)
            out = attend(attn, index, q, k, v, dims.scaling, layer.sliding_window)
            x = self._row_parallel(out.flatten(1), layer.o, layer.o_bias)
            x = add_rms_norm(x, residual, layer.post_norm, eps)
            x = self._row_parallel(silu_and_mul(layer.gate_up(x)), layer.down, layer.down_bias)
        return add_rms_norm(x, residual, self.norm, eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits ``[rows, vocab]`` of the given hidden rows."""
        logits = None if self.compiled is None else self.compiled.logits(hidden)
        return self.lm_head(hidden).float() if logits is None else logits

    def _row_parallel(self, x: torch.Tensor, projection: Linear, bias: torch.Tensor | None) -> torch.Tensor:
        y = projection(x)
        if self.dims.tp_size > 1:
            dist.all_reduce(y)
        return y if bias is None else y.add_(bias)

"""Decode steps of a few sequences as one compiled call over dense weights (float32 or bf16, CPU, one rank).

A step of one to a few decode tokens reads every weight once; the fastest way to do that is
a GEMV at the memory's bandwidth with nothing between the layers. oneDNN's packed projections
(models/linear.py) win from a handful of rows up, but at one row they read the weights slower
than a plain GEMV, and the layer-by-layer path adds ~20 dispatches per layer. On the 2-core
AMD EPYC (Zen 1, AVX2) of docs/benchmarks-history.md, a one-sequence step of the default model
took 61 ms layer by layer, of which ~40 ms were projections that a GEMV reads in ~28 ms and
~11 ms host work between the kernels.

The logits of a few rows are a GEMV too, over the LM head's dense weight (the embedding's
tensor when the two are tied).

The price is memory: the layer weights (and an untied LM head) are held twice, dense here
and packed for oneDNN. The worker's ``--decode-gemv-rows 0`` turns the path off and frees it.

A bf16 model's weights, embedding and caches are read as bf16 (half the bytes per token) and
widened in registers; its activations stay float32 between the ops, where transformers and the
layer-by-layer path round each op's output to bf16, so the two differ by bf16's rounding (the
parity tests hold both to transformers' bf16 outputs within the half-precision tolerance). Keys
and values are rounded to bf16 as they are written, as the layer-by-layer path stores them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from llmserve.kernels.attention_checks import check_paged_attention_args
from llmserve.kernels.cache_op_checks import check_reshape_and_cache_args
from llmserve.kernels.cpu.numba_attention import kernel_threads
from llmserve.kernels.layout import stacked_layers
from worker_service.attention import AttentionMetadata
from worker_service.models._numba_decode_step import decode_layers, gemv
from worker_service.models.fused_ops import full_team
from worker_service.models.rotary import RotaryTable

if TYPE_CHECKING:
    from worker_service.models.llama import LlamaDims

# The projections each layer holds densely here, in the order decode_layers takes them.
PROJECTIONS = ("qkv", "o", "gate_up", "down")
# Model dtypes the compiled call reads, and the NumPy view it takes of each (Numba has no bf16).
ELEMENT_VIEWS = {torch.float32: torch.float32, torch.bfloat16: torch.int16}


def _elements(tensor: torch.Tensor) -> np.ndarray:
    """A float32 or bf16 tensor as the array the compiled call takes (bf16 as int16 bits; no copy)."""
    return tensor.contiguous().view(ELEMENT_VIEWS[tensor.dtype]).numpy()


class FewRowDecode:
    """The dense layer weights and the call that runs a decode step of at most ``max_rows`` sequences."""

    def __init__(self, num_layers: int, max_rows: int) -> None:
        self.max_rows = max_rows
        self.num_layers = num_layers
        self._weights: dict[str, torch.Tensor] = {}
        self._biases: dict[str, torch.Tensor] = {}
        self._caches: tuple[list[torch.Tensor], np.ndarray | None, np.ndarray | None] | None = None

    def hold(self, name: str, layer: int, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """Copies layer ``layer``'s ``name`` projection into the stack; returns the stack's row (a view)."""
        if name not in self._weights:
            self._weights[name] = torch.empty((self.num_layers, *weight.shape), dtype=weight.dtype)
            width = 0 if bias is None else weight.shape[0]
            self._biases[name] = torch.zeros((self.num_layers, width), dtype=torch.float32)
        if (bias is None) != (self._biases[name].shape[1] == 0):
            raise ValueError(f"layer {layer}'s {name} projection has a bias where other layers do not (or the reverse)")
        self._weights[name][layer].copy_(weight)
        if bias is not None:
            self._biases[name][layer].copy_(bias)
        return self._weights[name][layer]

    def finish(self, dims: LlamaDims, embed: torch.Tensor, rotary: RotaryTable, input_norms: list[torch.Tensor],
               post_norms: list[torch.Tensor], final_norm: torch.Tensor, windows: list[int | None],
               head: torch.Tensor) -> None:
        """Everything else the call reads, as arrays, once every layer is held; ``head``: the LM head's dense
        weight (the embedding's own tensor when they are tied, so nothing more is held)."""
        self._dims = dims
        self._dtype = embed.dtype
        self._embed = _elements(embed)
        self._cos, self._sin = rotary.cos.float().contiguous().numpy(), rotary.sin.float().contiguous().numpy()
        self._input_norms = torch.stack(input_norms).float().contiguous().numpy()
        self._post_norms = torch.stack(post_norms).float().contiguous().numpy()
        self._final_norm = final_norm.float().contiguous().numpy()
        self._windows = np.array([w or 0 for w in windows], dtype=np.int64)
        self._arrays = [a for name in PROJECTIONS for a in (_elements(self._weights[name]), self._biases[name].numpy())]
        self._head = _elements(head)
        self._no_bias = np.empty(0, dtype=np.float32)

    def extra_bytes(self) -> int:
        """Memory this path holds beyond the packed weights: the dense stacks, and the LM head unless it is
        the embedding."""
        stacks = sum(t.nbytes for t in (*self._weights.values(), *self._biases.values()))
        return stacks + (0 if np.shares_memory(self._head, self._embed) else self._head.nbytes)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits of a few hidden rows, by GEMV over the LM head's dense weight."""
        out = torch.empty((hidden.shape[0], self._head.shape[0]), dtype=torch.float32)
        full_team()
        gemv(hidden.float().contiguous().numpy(), self._head, self._no_bias, out.numpy())
        return out

    def covers(self, tokens: int, attn: AttentionMetadata) -> bool:
        """Whether this step is a few decodes over caches of the model's dtype that the Numba kernels read."""
        if not 0 < tokens <= self.max_rows or attn.num_prefill_tokens or attn.num_decodes != tokens:
            return False
        key, value = attn.key_caches[0], attn.value_caches[0]
        if not (key.dtype == self._dtype and value.dtype == self._dtype and key.device.type == "cpu"
                and key.dim() == 5):
            return False
        keys, values = self._numba_caches(attn)
        return keys is not None and values is not None

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata) -> torch.Tensor:
        """Final hidden states ``[T, hidden]`` of a step that ``covers`` accepted."""
        dims, rows = self._dims, input_ids.shape[0]
        tables, lens, slots = self._checked(rows, attn)
        key_caches, value_caches = self._numba_caches(attn)
        threads = kernel_threads(rows, dims.num_heads, dims.num_kv_heads, dims.head_size, attn.decode_max_context_len)
        full_team()
        out = torch.empty((rows, self._embed.shape[1]), dtype=torch.float32)
        decode_layers(
            input_ids.to(torch.int64).contiguous().numpy(), positions.to(torch.int64).contiguous().numpy(),
            self._embed, self._input_norms, self._post_norms, self._final_norm,
            *self._arrays, self._windows, self._cos, self._sin,
            key_caches, value_caches, slots, tables, lens, dims.num_heads, dims.num_kv_heads,
            np.float32(dims.rms_norm_eps), np.float32(dims.scaling), threads, out.numpy(),
        )  # fmt: skip
        return out

    def _checked(self, rows: int, attn: AttentionMetadata) -> tuple[np.ndarray, ...]:
        """The step's metadata as the kernels take it, after the checks the layer-by-layer path runs once per step
        (every block id the attention reads and every slot written are in range)."""
        dims = self._dims
        key_cache, value_cache = attn.key_caches[0], attn.value_caches[0]
        query = torch.empty((rows, dims.num_heads, dims.head_size), dtype=torch.float32)
        kv = torch.empty((rows, dims.num_kv_heads, dims.head_size), dtype=key_cache.dtype)
        check_reshape_and_cache_args(kv, kv, key_cache, value_cache, attn.slot_mapping)
        for window in set(self._windows.tolist()):  # the block ids read depend on the window
            check_paged_attention_args(query, query, key_cache, value_cache, dims.num_kv_heads, dims.scaling,
                                       attn.decode_block_tables, attn.decode_context_lens, attn.block_size,
                                       attn.decode_max_context_len, None, window or None)
        return (attn.decode_block_tables.to(torch.int32).contiguous().numpy(),
                attn.decode_context_lens.to(torch.int32).contiguous().numpy(),
                attn.slot_mapping.to(torch.int64).contiguous().numpy())

    def _numba_caches(self, attn: AttentionMetadata) -> tuple[np.ndarray | None, np.ndarray | None]:
        # The cache engine's caches live as long as the worker: looked at once (and again only if they change).
        if self._caches is None or self._caches[0] is not attn.key_caches:
            keys, values = stacked_layers(attn.key_caches), stacked_layers(attn.value_caches)
            self._caches = (attn.key_caches, None if keys is None else _elements(keys),
                            None if values is None else _elements(values))
        return self._caches[1], self._caches[2]

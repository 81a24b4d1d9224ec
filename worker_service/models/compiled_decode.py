"""Decode steps as one compiled call through every layer (CPU, one rank): no Python between the kernels.

The layer-by-layer path (models/llama.py) makes ~20 Python-level calls per layer: oneDNN, Numba
and torch dispatches, tensor views. At one sequence that host work costs as much as a layer's
projections; at 8 to 64 sequences it was still 6-18 % of a step (2-core Zen 4,
docs/benchmarks-history.md). Here a decode-only step runs
models/_numba_decode_step.py's layer loop in one call, in one of two forms:

- the panel form, where the float32 projections are in panels (models/linear.py's ``use_panels``):
  the panel kernel over the very weights the layer-by-layer path multiplies (each layer's panels
  are a row of one stack per projection, so nothing more is held), with the same kernels between:
  the same results bit for bit, without the Python between them. It serves every decode step.
- the GEMV form otherwise (bf16, or float32 through oneDNN), for up to ``--decode-gemv-rows`` (4)
  rows: GEMV projections over a dense copy of the weights. A step of a few rows reads every weight
  once; a GEMV does that at the memory's bandwidth, where oneDNN's packed projections read them
  slower at one row. On the 2-core AMD EPYC (Zen 1, AVX2) of docs/benchmarks-history.md, a
  one-sequence step of the default model took 61 ms layer by layer, of which ~40 ms were
  projections that a GEMV reads in ~28 ms and ~11 ms host work between the kernels. The logits of
  a few rows are a GEMV too, over the LM head's dense weight (the embedding's tensor when the two
  are tied). Its price is memory: the layer weights (and an untied LM head) are held twice, dense
  there and packed for oneDNN; ``--decode-gemv-rows 0`` turns it off and frees the copy. Where both
  could run, the panel form was the faster from one row up (2-core Zen 4, one process alternating:
  docs/benchmarks-history.md), so the loader holds no dense copy with panels.

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
from worker_service.models._numba_decode_step import decode_layers, decode_layers_panels, gemv, require_bf16
from worker_service.models.fused_ops import full_team
from worker_service.models.linear import can_use_panels
from worker_service.models.rotary import RotaryTable

if TYPE_CHECKING:
    from worker_service.models.llama import LlamaDims, LlamaLayer

# The projections of a layer, in the order the compiled calls take them.
PROJECTIONS = ("qkv", "o", "gate_up", "down")
# Model dtypes the GEMV form reads, and the NumPy view it takes of each (Numba has no bf16).
ELEMENT_VIEWS = {torch.float32: torch.float32, torch.bfloat16: torch.int16}


def _elements(tensor: torch.Tensor) -> np.ndarray:
    """A float32 or bf16 tensor as the array the compiled call takes (bf16 as int16 bits; no copy)."""
    return tensor.contiguous().view(ELEMENT_VIEWS[tensor.dtype]).numpy()


def _stacked_biases(biases: list[torch.Tensor | None]) -> np.ndarray:
    """``[L, out]`` float32, or ``[L, 0]`` when no layer has the bias."""
    if all(b is None for b in biases):
        return np.zeros((len(biases), 0), dtype=np.float32)
    if any(b is None for b in biases):
        raise ValueError("a projection has a bias in some layers only")
    return torch.stack(biases).float().contiguous().numpy()  # type: ignore[arg-type]


class CompiledDecode:
    """What the compiled calls read, and the choice between them for a step.

    ``max_rows``: the GEMV form's row limit (0: no dense copy is held); ``panels``: the model lays its float32
    projections out in panels, which the panel form then takes as stacks over the layers (steps of more than
    ``max_rows`` rows run it).
    """

    def __init__(self, num_layers: int, max_rows: int, panels: bool) -> None:
        self.max_rows = max_rows
        self.num_layers = num_layers
        self._weights: dict[str, torch.Tensor] = {}
        self._biases: dict[str, torch.Tensor] = {}
        self._panel_stacks: dict[str, np.ndarray] | None = {} if panels else None
        self._panel_layers: dict[str, set[int]] = {name: set() for name in PROJECTIONS}
        # The panel form's weight and bias arrays (finish), None while it cannot run.
        self._panel_arrays: list[np.ndarray] | None = None
        self._caches: tuple[list[torch.Tensor], np.ndarray | None, np.ndarray | None] | None = None

    @property
    def panels(self) -> bool:
        """Whether steps of more than ``max_rows`` rows run the panel form."""
        return self._panel_arrays is not None

    def hold(self, name: str, layer: int, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """Copies layer ``layer``'s ``name`` projection into the dense stack; returns the stack's row (a view).
        The weight itself without the GEMV form."""
        if not self.max_rows:
            return weight
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

    def panels_into(self, name: str, layer: int, weight: torch.Tensor) -> np.ndarray | None:
        """The row of ``name``'s panel stack that layer ``layer``'s weight is to be laid out into (models/linear.py),
        None where the weight gets no panels."""
        if self._panel_stacks is None or not can_use_panels(weight):
            return None
        size = weight.numel()
        if name not in self._panel_stacks:
            self._panel_stacks[name] = np.empty((self.num_layers, size), dtype=np.float32)
        stack = self._panel_stacks[name]
        if stack.shape[1] != size:
            raise ValueError(f"layer {layer}'s {name} projection is {tuple(weight.shape)}, unlike the layers before it")
        self._panel_layers[name].add(layer)
        return stack[layer]

    def finish(self, dims: LlamaDims, embed: torch.Tensor, rotary: RotaryTable, layers: list[LlamaLayer],
               final_norm: torch.Tensor, head: torch.Tensor) -> None:
        """Everything else the calls read, as arrays, once every layer is loaded; ``head``: the LM head's dense
        weight (the embedding's own tensor when they are tied, so nothing more is held)."""
        self._dims = dims
        self._dtype = embed.dtype
        self._embed = _elements(embed)
        self._cos, self._sin = rotary.cos.float().contiguous().numpy(), rotary.sin.float().contiguous().numpy()
        self._input_norms = torch.stack([layer.input_norm for layer in layers]).float().contiguous().numpy()
        self._post_norms = torch.stack([layer.post_norm for layer in layers]).float().contiguous().numpy()
        self._final_norm = final_norm.float().contiguous().numpy()
        self._windows = np.array([layer.sliding_window or 0 for layer in layers], dtype=np.int64)
        if self.max_rows:
            if self._dtype == torch.bfloat16:
                require_bf16()  # at the model's load, not in the first step
            self._arrays = [a for name in PROJECTIONS for a in (_elements(self._weights[name]), self._biases[name].numpy())]
            self._head = _elements(head)
            self._no_bias = np.empty(0, dtype=np.float32)
        every_layer = set(range(self.num_layers))
        if self._panel_stacks is not None and all(self._panel_layers[name] == every_layer for name in PROJECTIONS):
            # The sums of qkv and gate/up start from their biases in the panel kernel; o's and down's biases are
            # added after it, as the layer-by-layer path adds them (after a tensor-parallel reduction).
            self._panel_arrays = [
                self._panel_stacks["qkv"], _stacked_biases([layer.qkv.bias for layer in layers]),
                self._panel_stacks["o"], _stacked_biases([layer.o_bias for layer in layers]),
                self._panel_stacks["gate_up"], _stacked_biases([layer.gate_up.bias for layer in layers]),
                self._panel_stacks["down"], _stacked_biases([layer.down_bias for layer in layers]),
            ]  # fmt: skip

    def extra_bytes(self) -> int:
        """Memory held beyond what the layer-by-layer path holds: the dense stacks, and the LM head unless it is
        the embedding (the panel stacks are the layers' own panels)."""
        if not self.max_rows:
            return 0
        stacks = sum(t.nbytes for t in (*self._weights.values(), *self._biases.values()))
        return stacks + (0 if np.shares_memory(self._head, self._embed) else self._head.nbytes)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """float32 logits of at most ``max_rows`` hidden rows by GEMV over the LM head's dense weight; None for more
        rows (the LM head's own kernel serves them)."""
        if not 0 < hidden.shape[0] <= self.max_rows:
            return None
        out = torch.empty((hidden.shape[0], self._head.shape[0]), dtype=torch.float32)
        full_team()
        gemv(hidden.float().contiguous().numpy(), self._head, self._no_bias, out.numpy())
        return out

    def covers(self, tokens: int, attn: AttentionMetadata) -> bool:
        """Whether this step is decodes only, of a row count one of the forms runs, over caches of the model's dtype
        that the Numba kernels read."""
        runs = 0 < tokens and (tokens <= self.max_rows or self.panels)
        if not runs or attn.num_prefill_tokens or attn.num_decodes != tokens:
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
        attention_threads = kernel_threads(rows, dims.num_heads, dims.num_kv_heads, dims.head_size,
                                           attn.decode_max_context_len)
        threads = full_team()
        out = torch.empty((rows, self._embed.shape[1]), dtype=torch.float32)
        ids, positions = input_ids.to(torch.int64).contiguous().numpy(), positions.to(torch.int64).contiguous().numpy()
        common = (self._windows, self._cos, self._sin, key_caches, value_caches, slots, tables, lens, dims.num_heads,
                  dims.num_kv_heads, np.float32(dims.rms_norm_eps), np.float32(dims.scaling), attention_threads)
        norms = (self._embed, self._input_norms, self._post_norms, self._final_norm)
        if rows <= self.max_rows:
            decode_layers(ids, positions, *norms, *self._arrays, *common, out.numpy())
        else:
            assert self._panel_arrays is not None  # covers() let a step of more rows through only then
            decode_layers_panels(ids, positions, *norms, *self._panel_arrays, *common, threads, out.numpy())
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

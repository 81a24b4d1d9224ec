"""Builds a LlamaModel from a checkpoint: Hugging Face tensor names into the fused, sharded layout.

    checkpoint (per layer)                         fused (rank r of N)
    self_attn.q_proj [Hq*D, H]  ─┐
    self_attn.k_proj [Hkv*D, H] ─┼─ rows of r ──▶  qkv [(Hq + 2 Hkv) * D / N, H]
    self_attn.v_proj [Hkv*D, H] ─┘
    self_attn.o_proj [H, Hq*D]  ── columns of r ─▶ o [H, Hq*D / N]
    mlp.gate_proj    [I, H]     ─┐
    mlp.up_proj      [I, H]     ─┴─ rows of r ──▶  gate_up [2 I / N, H]
    mlp.down_proj    [H, I]     ── columns of r ─▶ down [H, I / N]

Query head h uses KV head h // (Hq / Hkv); rank r keeps query heads [r Hq/N, (r+1) Hq/N)
and KV heads [r Hkv/N, (r+1) Hkv/N), so every GQA group stays on one rank.
"""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

from worker_service.model_loader import model_shape
from worker_service.models.checkpoint_tensors import CheckpointTensors
from worker_service.models.compiled_decode import ELEMENT_VIEWS, CompiledDecode
from worker_service.models.linear import Linear, use_panels
from worker_service.models.llama import LlamaDims, LlamaLayer, LlamaModel
from worker_service.models.rotary import DYNAMIC_ROPE_TYPES, build_rotary_table, rope_type
from worker_service.sharding import local_shape, rank_share

# The model types whose transformers modules the fused LlamaModel computes (their rotary modules are one code).
FUSED_MODEL_TYPES = ("llama", "mistral", "qwen2")


def fused_llama_supports(config: PretrainedConfig) -> str | None:
    """None if the fused model computes what transformers' modules do for ``config``; else why not."""
    if config.model_type not in FUSED_MODEL_TYPES:
        return f"model type {config.model_type!r} is not in the Llama family"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r} (the fused MLP is SiLU-and-mul)"
    if rope_type(config) in DYNAMIC_ROPE_TYPES:
        return f"rope type {rope_type(config)!r} (frequencies that change with the sequence length)"
    return None


def _rows(tensor: torch.Tensor | None, index: slice) -> torch.Tensor | None:
    return None if tensor is None else tensor[index]


def _cat(parts: list[torch.Tensor | None]) -> torch.Tensor | None:
    """The fused bias of projections that all have one (Qwen2's q/k/v), None when none has."""
    if all(p is None for p in parts):
        return None
    if any(p is None for p in parts):
        raise ValueError("checkpoint has biases on some of a fused projection's parts only")
    return torch.cat(parts).contiguous()  # type: ignore[arg-type]


def _sliding_window(config: PretrainedConfig, index: int) -> int | None:
    """The window of layer ``index`` as transformers' module for the family passes it to attention."""
    window = getattr(config, "sliding_window", None)
    if config.model_type == "llama" or not window:
        return None
    layer_types = getattr(config, "layer_types", None)
    if config.model_type == "qwen2" and layer_types is not None:
        return int(window) if layer_types[index] == "sliding_attention" else None
    return int(window)


def _load_layer(tensors: CheckpointTensors, config: PretrainedConfig, index: int, q_rows: slice, kv_rows: slice,
                mlp_rows: slice, compiled: CompiledDecode | None, panels: bool) -> LlamaLayer:
    prefix = f"model.layers.{index}."

    def linear(name: str, weight: torch.Tensor, bias: torch.Tensor | None, dense_bias: torch.Tensor | None = None
               ) -> Linear:
        if compiled is None:
            return Linear(weight, bias, panels)
        # The GEMV form's dense stack holds the weight (oneDNN packs its own copy from the stack's row); the
        # panels go into a row of the panel form's stack.
        weight = compiled.hold(name, index, weight, bias if dense_bias is None else dense_bias)
        return Linear(weight, bias, panels, compiled.panels_into(name, index, weight))

    def get(name: str) -> torch.Tensor | None:
        return tensors.get(prefix + name)

    def need(name: str) -> torch.Tensor:
        return tensors.require(prefix + name)

    parts = (("q", q_rows), ("k", kv_rows), ("v", kv_rows))
    o_bias, down_bias = get("self_attn.o_proj.bias"), get("mlp.down_proj.bias")
    return LlamaLayer(
        input_norm=need("input_layernorm.weight"),
        qkv=linear("qkv", torch.cat([need(f"self_attn.{p}_proj.weight")[rows] for p, rows in parts]),
                   _cat([_rows(get(f"self_attn.{p}_proj.bias"), rows) for p, rows in parts])),
        o=linear("o", need("self_attn.o_proj.weight")[:, q_rows].contiguous(), None, o_bias),
        o_bias=o_bias,
        post_norm=need("post_attention_layernorm.weight"),
        gate_up=linear("gate_up", torch.cat([need("mlp.gate_proj.weight")[mlp_rows],
                                             need("mlp.up_proj.weight")[mlp_rows]]),
                       _cat([_rows(get("mlp.gate_proj.bias"), mlp_rows), _rows(get("mlp.up_proj.bias"), mlp_rows)])),
        down=linear("down", need("mlp.down_proj.weight")[:, mlp_rows].contiguous(), None, down_bias),
        down_bias=down_bias,
        sliding_window=_sliding_window(config, index),
    )


def load_llama(config: PretrainedConfig, path: str, dtype: torch.dtype, device: torch.device,
               max_positions: int, rank: int = 0, tp_size: int = 1, decode_gemv_rows: int = 0,
               cpu_matmul: str = "auto") -> LlamaModel:
    """Reads ``path``'s weights into rank ``rank``'s share of the fused layout (of ``tp_size`` ranks).

    ``decode_gemv_rows``: decode steps of up to this many sequences run models/compiled_decode.py's GEMV form
    (float32 or bf16 on a CPU, one rank, projections not in panels; 0: never). ``cpu_matmul``: the projections'
    kernel (models/linear.py); with panels, every decode step runs compiled_decode.py's panel form (one rank).
    """
    tensors = CheckpointTensors(path, dtype, device)
    shape = model_shape(config)
    local = local_shape(shape, tp_size)
    dims = LlamaDims(local.num_heads, local.num_kv_heads, shape.head_size, float(config.rms_norm_eps), tp_size)
    q_rows = rank_share(shape.num_heads * shape.head_size, rank, tp_size)
    kv_rows = rank_share(shape.num_kv_heads * shape.head_size, rank, tp_size)
    mlp_rows = rank_share(config.intermediate_size, rank, tp_size)
    panels = use_panels(cpu_matmul, dtype, device)
    # With panels the panel form serves every decode step: it was faster than the GEMV form from one row up
    # (models/compiled_decode.py), so the GEMV form's dense copy is not held.
    gemv_rows = 0 if panels else decode_gemv_rows
    compiled = None
    if dtype in ELEMENT_VIEWS and device.type == "cpu" and tp_size == 1 and (gemv_rows > 0 or panels):
        compiled = CompiledDecode(shape.num_layers, gemv_rows, panels)
    layers = [_load_layer(tensors, config, i, q_rows, kv_rows, mlp_rows, compiled, panels)
              for i in range(shape.num_layers)]
    embed = tensors.require("model.embed_tokens.weight")
    tied = getattr(config, "tie_word_embeddings", False)
    head_weight = embed if tied else tensors.require("lm_head.weight")
    lm_head = Linear(head_weight, None, panels)
    rotary = build_rotary_table(config, max_positions, dtype, device)
    norm = tensors.require("model.norm.weight")
    if compiled is not None:
        compiled.finish(dims, embed, rotary, layers, norm, head_weight)
    return LlamaModel(dims, embed, layers, norm, lm_head, rotary, compiled)

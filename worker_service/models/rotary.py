"""Rotary position embeddings as a cached cos/sin table, indexed by position.

transformers recomputes ``cos(position * inv_freq)`` for every forward pass; the
table holds it once for every position up to the model length. It is computed as
the Llama family's rotary module (LlamaRotaryEmbedding; Mistral's and Qwen2's are
the same code) computes it, from transformers' own rope initialisation functions,
so every static rope type they know (default, linear, llama3, yarn, ...) gives
exactly its frequencies and scaling, bit for bit (tests/unit/test_rotary_table.py).
It does not build the module: that would import transformers' model code, which
costs a worker's start-up over a second. Types whose frequencies change with the
sequence length (dynamic NTK, longrope) cannot be a table: models using them keep
transformers' modules.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

# Frequencies that depend on the longest position in the batch.
DYNAMIC_ROPE_TYPES = ("dynamic", "longrope")


def rope_type(config: PretrainedConfig) -> str:
    params = getattr(config, "rope_parameters", None) or {}
    return str(params.get("rope_type", "default"))


@dataclass
class RotaryTable:
    """cos/sin of every position: ``[max_positions, head_size / 2]`` each, in the model's dtype."""

    cos: torch.Tensor
    sin: torch.Tensor


def rotary_frequencies(config: PretrainedConfig) -> tuple[torch.Tensor, float]:
    """``inv_freq`` ([head_size / 2], float32) and the cos/sin scale of the config's rope type."""
    kind = rope_type(config)
    if kind == "default":
        # The rotary modules' own compute_default_rope_parameters: the one type not in ROPE_INIT_FUNCTIONS.
        base = config.rope_parameters["rope_theta"]
        dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: PLC0415

    if kind not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unknown rope type {kind!r}")
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[kind](config)
    return inv_freq, float(scaling)


def build_rotary_table(config: PretrainedConfig, max_positions: int, dtype: torch.dtype,
                       device: torch.device) -> RotaryTable:
    """The table for positions ``0 .. max_positions - 1``."""
    inv_freq, scaling = rotary_frequencies(config)
    # The module's operations on the module's shapes ([1, positions, head_size]): torch's vectorized cos/sin
    # can round a lane differently from its scalar tail, so the same shapes keep the table bit for bit its.
    freqs = torch.arange(max_positions)[None, :, None].float() * inv_freq.float()
    angles = torch.cat((freqs, freqs), dim=-1)
    cos, sin = angles.cos() * scaling, angles.sin() * scaling
    # The two halves of each row are the same numbers.
    half = cos.shape[-1] // 2
    return RotaryTable(
        cos=cos[0, :, :half].to(device=device, dtype=dtype).contiguous(),
        sin=sin[0, :, :half].to(device=device, dtype=dtype).contiguous(),
    )

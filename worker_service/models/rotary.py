"""Rotary position embeddings as a cached cos/sin table, indexed by position.

transformers recomputes ``cos(position * inv_freq)`` for every forward pass; the
table holds it once for every position up to the model length. It is built by
the family's own transformers rotary module, so every static rope type it knows
(default, linear, llama3, yarn, ...) gives exactly its frequencies and scaling.
Types whose frequencies change with the sequence length (dynamic NTK, longrope)
cannot be a table: models using them keep transformers' modules.
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


def build_rotary_table(rotary_module_type: type, config: PretrainedConfig, max_positions: int,
                       dtype: torch.dtype, device: torch.device) -> RotaryTable:
    """The table of ``rotary_module_type`` (e.g. LlamaRotaryEmbedding) for positions ``0 .. max_positions - 1``."""
    module = rotary_module_type(config=config)
    positions = torch.arange(max_positions).unsqueeze(0)
    # The module returns cat(freqs, freqs) per position: the two halves are the same numbers.
    cos, sin = module(torch.empty(0, dtype=torch.float32), positions)
    half = cos.shape[-1] // 2
    return RotaryTable(
        cos=cos[0, :, :half].to(device=device, dtype=dtype).contiguous(),
        sin=sin[0, :, :half].to(device=device, dtype=dtype).contiguous(),
    )

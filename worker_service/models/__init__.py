"""The models a worker runs: its own fused Llama family, transformers' modules for the rest.

Both kinds answer the same two calls: ``forward(input_ids, positions, attn)`` ->
final hidden states ``[T, hidden]`` of the step's flat batch, and
``compute_logits(hidden_rows)`` -> float32 logits.
"""

from __future__ import annotations

import logging
from typing import Protocol

import torch
from transformers import PretrainedConfig

from worker_service.attention import AttentionMetadata

log = logging.getLogger(__name__)


class CausalLM(Protocol):
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


def build_model(config: PretrainedConfig, path: str, dtype: torch.dtype, device: torch.device, max_positions: int,
                rank: int = 0, tp_size: int = 1, decode_gemv_rows: int = 0, cpu_matmul: str = "auto") -> CausalLM:
    """The fused model where it covers ``config``, else transformers' modules (with the reason logged)."""
    from worker_service.models.llama_loader import fused_llama_supports, load_llama

    why_not = fused_llama_supports(config)
    if why_not is None:
        model = load_llama(config, path, dtype, device, max_positions, rank, tp_size, decode_gemv_rows, cpu_matmul)
        log.info("loaded %s (%s) on %s: fused Llama-family layers", path, dtype, device)
        compiled = model.compiled
        if compiled is not None and compiled.max_rows:
            log.info("decode steps of up to %d sequences run as one compiled call over a dense copy of the weights "
                     "(%.0f MiB more; --decode-gemv-rows 0 turns it off)", compiled.max_rows,
                     compiled.extra_bytes() / 2**20)
        if compiled is not None and compiled.panels:
            log.info("decode steps run as one compiled call over the panel weights")
        return model
    from worker_service.models.transformers_model import TransformersModel

    log.info("running transformers' modules for %s: %s", path, why_not)
    return TransformersModel(path, dtype, device, rank, tp_size)

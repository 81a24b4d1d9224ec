"""transformers' own modules over the paged attention function: the path for families without a fused model.

OPT and GPT-2 (and Llama-family checkpoints the fused model does not cover, such as
dynamic rope scaling) run transformers' decoder with its attention function
replaced by `worker_service.attention` (registered as a transformers attention
implementation). On a CPU the small ops between matmuls run on one thread
(`MatmulThreads`).
"""

from __future__ import annotations

import contextlib
import logging

import torch
from transformers import AutoModelForCausalLM

from shared.checkpoint import pretrained_source
from worker_service import attention
from worker_service.attention import METADATA_KWARG, AttentionMetadata
from worker_service.matmul_threads import MatmulThreads
from worker_service.sharding import shard_model

log = logging.getLogger(__name__)


class TransformersModel:
    """A loaded transformers causal LM, called with the step's flat batch."""

    def __init__(self, path: str, dtype: torch.dtype, device: torch.device, rank: int = 0, tp_size: int = 1) -> None:
        source, kwargs = pretrained_source(path)
        self.model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, attn_implementation=attention.register(),
                                                          **kwargs)
        # Sharded on the host copy: only this rank's share moves to the device.
        shard_model(self.model, rank, tp_size)
        self.model.to(device)
        self.model.eval()
        log.info("loaded %s (%s) on %s", path, dtype, device)
        self.decoder = self.model.base_model
        self.lm_head = self.model.get_output_embeddings()
        self._threads = MatmulThreads(self.decoder) if device.type == "cpu" else None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata) -> torch.Tensor:
        """The decoder's last hidden states, ``[T, hidden]``."""
        threads = contextlib.nullcontext()
        if self._threads is not None:
            attn.kernel_threads = self._threads.full
            threads = self._threads.forward(int(input_ids.shape[0]))
        with threads:
            return self.decoder(
                input_ids=input_ids.unsqueeze(0),
                position_ids=positions.unsqueeze(0),
                use_cache=False,
                **{METADATA_KWARG: attn},
            ).last_hidden_state[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits ``[rows, vocab]`` of the given hidden rows."""
        return self.lm_head(hidden).float()

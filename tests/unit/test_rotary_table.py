"""The fused models' rotary table is, bit for bit, what each family's transformers rotary module computes."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, MistralConfig, Qwen2Config
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.mistral.modeling_mistral import MistralRotaryEmbedding
from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

from worker_service.models.rotary import build_rotary_table

FAMILIES = [(LlamaConfig, LlamaRotaryEmbedding), (MistralConfig, MistralRotaryEmbedding),
            (Qwen2Config, Qwen2RotaryEmbedding)]
# The static rope types, with the parameters each needs (beside rope_theta).
ROPE_PARAMETERS = {
    "default": {},
    "linear": {"factor": 4.0},
    "llama3": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 256},
    "yarn": {"factor": 4.0, "original_max_position_embeddings": 256},
}
MAX_POSITIONS = 1024


@pytest.mark.parametrize("rope", sorted(ROPE_PARAMETERS))
@pytest.mark.parametrize(("config_type", "module_type"), FAMILIES, ids=lambda t: t.__name__)
def test_the_table_is_the_rotary_modules_output(config_type: type, module_type: type, rope: str) -> None:
    config = config_type(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         rope_parameters={"rope_type": rope, "rope_theta": 50000.0, **ROPE_PARAMETERS[rope]})
    table = build_rotary_table(config, MAX_POSITIONS, torch.float32, torch.device("cpu"))
    cos, sin = module_type(config=config)(torch.empty(0), torch.arange(MAX_POSITIONS)[None])
    half = cos.shape[-1] // 2
    assert table.cos.shape == (MAX_POSITIONS, 256 // 4 // 2)
    assert torch.equal(table.cos, cos[0, :, :half]) and torch.equal(table.sin, sin[0, :, :half])
    if rope != "default":  # the type's parameters change the frequencies: the comparison is not of default tables
        config.rope_parameters = {"rope_type": "default", "rope_theta": 50000.0}
        assert not torch.equal(table.cos, build_rotary_table(config, MAX_POSITIONS, torch.float32, torch.device("cpu")).cos)

def test_the_table_in_bfloat16_rounds_the_float32_table() -> None:
    config = LlamaConfig(hidden_size=128, num_attention_heads=2, max_position_embeddings=512)
    wide = build_rotary_table(config, 512, torch.float32, torch.device("cpu"))
    narrow = build_rotary_table(config, 512, torch.bfloat16, torch.device("cpu"))
    assert narrow.cos.dtype == torch.bfloat16 and torch.equal(narrow.cos, wide.cos.bfloat16())

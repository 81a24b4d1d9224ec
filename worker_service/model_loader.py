"""A Hugging Face checkpoint's config: the architecture check, the shape the KV cache needs, the dtype."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AutoConfig, PretrainedConfig

from shared.checkpoint import pretrained_source

# Architectures whose transformers modules run unchanged over the paged attention function.
# model_type -> architecture: GGUF checkpoints carry only the model type.
_ARCHITECTURE_OF_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "opt": "OPTForCausalLM",
    "gpt2": "GPT2LMHeadModel",
}
SUPPORTED_ARCHITECTURES = tuple(_ARCHITECTURE_OF_TYPE.values())

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture is not one llmserve serves."""


@dataclass
class ModelShape:
    """The numbers the KV cache and the scheduler need from a model config."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    vocab_size: int
    max_position_embeddings: int
    # Tokens every layer attends back to, when all layers use a sliding window (None otherwise).
    sliding_window: int | None = None


def resolve_dtype(name: str, config: PretrainedConfig, device: torch.device) -> torch.dtype:
    """vLLM's rule for --dtype auto: float32 on a CPU, else the checkpoint's 16-bit dtype."""
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.float32
    checkpoint = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(checkpoint, str):
        checkpoint = _DTYPES.get(checkpoint)
    return checkpoint if checkpoint in (torch.float16, torch.bfloat16) else torch.float16


def model_shape(config: PretrainedConfig) -> ModelShape:
    """Reads layer, head and vocabulary sizes from a config."""
    num_heads = config.num_attention_heads
    head_size = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    return ModelShape(
        num_layers=config.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
        head_size=head_size,
        vocab_size=config.vocab_size,
        max_position_embeddings=config.max_position_embeddings,
        sliding_window=_uniform_sliding_window(config),
    )


def _uniform_sliding_window(config: PretrainedConfig) -> int | None:
    """The window when every layer slides (Mistral); None with any full-attention layer (Qwen2's lower layers)."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if not window or (layer_types is not None and any(t != "sliding_attention" for t in layer_types)):
        return None
    return int(window)


def load_config(path: str) -> PretrainedConfig:
    """Loads and checks a checkpoint's config; unsupported architectures fail here, at start-up."""
    source, kwargs = pretrained_source(path)
    config = AutoConfig.from_pretrained(source, **kwargs)
    archs = list(getattr(config, "architectures", None) or [])
    if not archs and getattr(config, "model_type", None) in _ARCHITECTURE_OF_TYPE:
        archs = [_ARCHITECTURE_OF_TYPE[config.model_type]]
        config.architectures = archs
    if not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        raise UnsupportedModelError(
            f"model architecture {archs or 'unknown'} is not supported; "
            f"supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return config

"""Tiny random-weight checkpoints built from configs, for fast exact-match tests.

Weights are initialised with a large std so next-token distributions are
peaked: greedy near-ties (which make token-exact comparisons flaky) stay rare.
The tokenizer is the default model's, so text prompts work too.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer


def build_tiny_llama(directory: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """Writes a 2-layer GQA Llama (4 query / 2 KV heads, head size 32) with the default tokenizer."""
    return build_tiny_model(directory, tokenizer_dir, "llama", seed)


def build_tiny_model(directory: Path, tokenizer_dir: Path, model_type: str, seed: int = 0, **overrides: object) -> Path:
    """The tiny Llama's shape in another family ("llama", "mistral", "qwen2"), with config overrides."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    fields: dict[str, object] = dict(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        initializer_range=0.2,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
        tie_word_embeddings=False,
    )
    fields.update(overrides)
    config = AutoConfig.for_model(model_type, **fields)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    return directory

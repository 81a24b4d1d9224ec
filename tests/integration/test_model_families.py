"""The worker's model runner against transformers, per supported architecture (tiny random weights).

The runner executes plans directly (no services): three prompts prefilled
together, then decoded together step by step; greedy tokens must equal
transformers' `generate` for each prompt alone. Mistral runs with a sliding
window shorter than the sequences, so the windowed kernels are exercised.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from shared.sampling_params import SamplingParams
from tests.hf_reference import HFReference, compare_greedy
from worker_service.config import WorkerConfig
from worker_service.model_loader import UnsupportedModelError, load_config
from worker_service.model_runner import ModelRunner
from worker_service.plan import NewSequenceData, SequenceDeltaData, StepPlanData

COMMON = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2, tie_word_embeddings=False,
)
FAMILIES = {
    "llama": dict(model_type="llama", architectures=["LlamaForCausalLM"]),
    "mistral": dict(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=24),
    "qwen2": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"]),
}
NEW_TOKENS = 12


def _build(directory: Path, family: str) -> Path:
    spec = dict(FAMILIES[family])
    config = AutoConfig.for_model(spec.pop("model_type"), **COMMON, **spec)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    return directory


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_batch_matches_transformers(family: str, tmp_path: Path) -> None:
    model_dir = _build(tmp_path / family, family)
    runner = ModelRunner(WorkerConfig(model=str(model_dir), num_gpu_blocks_override=64, max_model_len=256,
                                      block_size=8))
    prompts = [list(range(3, 40)), [7, 8, 9, 10, 11], list(range(100, 119))]
    greedy = SamplingParams(temperature=0.0)
    tables = {i: list(range(i * 10, i * 10 + 10)) for i in range(len(prompts))}
    outputs: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    plan = StepPlanData(1, 1, [], [], [], [NewSequenceData(i, p, [], greedy, tables[i], 0, len(p))
                                           for i, p in enumerate(prompts)], [], [])
    for step in range(NEW_TOKENS):
        for s in runner.execute(plan).sampled:
            outputs[s.seq_id].append(s.token_id)
        plan = StepPlanData(1, step + 2, [], [], [], [], [SequenceDeltaData(i, [], 1) for i in outputs], [])
    reference = HFReference(str(model_dir))
    for i, prompt in enumerate(prompts):
        cmp = compare_greedy(outputs[i], reference.greedy(prompt, NEW_TOKENS, stop_at_eos=False))
        assert cmp.matched, f"{family}, prompt {i}: {cmp.detail}"


def test_unsupported_architecture_names_the_supported_ones(tmp_path: Path) -> None:
    config = AutoConfig.for_model("gpt_neox", hidden_size=32, num_attention_heads=2, num_hidden_layers=1,
                                  intermediate_size=64, vocab_size=64, architectures=["GPTNeoXForCausalLM"])
    config.save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match="supported architectures: LlamaForCausalLM, MistralForCausalLM"):
        load_config(str(tmp_path))

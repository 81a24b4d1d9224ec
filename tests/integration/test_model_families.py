"""The worker's model runner against transformers, per supported architecture (tiny random weights).

The runner executes plans directly (no services): three prompts prefilled
together, then decoded together step by step; greedy tokens must equal
transformers' `generate` for each prompt alone, and each token's logprob must
be HF's log_softmax within 1e-4. Mistral runs with a sliding window shorter
than the sequences, so the windowed kernels are exercised; a Llama with
Llama 3.1 rope scaling covers scaled rotary positions; OPT (facebook/opt-125m's
architecture) and GPT-2 cover learned positions and tied embeddings. The Llama
family runs the worker's fused layers, the others (and dynamic rope scaling)
transformers' modules; bf16 and fp16 are compared with transformers in the same
dtype, within a tolerance set by the dtype's precision (HALF_TOLERANCE).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from shared.sampling_params import SamplingParams
from tests.hf_reference import HALF_TOLERANCE, HFReference, compare_greedy
from worker_service.config import WorkerConfig
from worker_service.model_loader import UnsupportedModelError, load_config
from worker_service.model_runner import ModelRunner
from worker_service.models.llama import LlamaModel
from worker_service.models.transformers_model import TransformersModel
from worker_service.plan import NewSequenceData, SequenceDeltaData, StepPlanData

COMMON = dict(
    vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=256,
    initializer_range=0.2,
)
GQA = dict(intermediate_size=128, num_key_value_heads=2, tie_word_embeddings=False)
LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=32)
FAMILIES = {
    "llama": dict(model_type="llama", architectures=["LlamaForCausalLM"], **GQA),
    # Llama 3.1's rope scaling, with an original context short enough that the test's positions use it.
    "llama3-rope": dict(model_type="llama", architectures=["LlamaForCausalLM"], rope_parameters=LLAMA3_ROPE, **GQA),
    "mistral": dict(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=24, **GQA),
    "qwen2": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], **GQA),
    # facebook/opt-125m's layout (learned positions offset by 2, pre-layer-norm, biases), smaller.
    "opt": dict(model_type="opt", architectures=["OPTForCausalLM"], ffn_dim=128, word_embed_proj_dim=64,
                init_std=0.2),
    "gpt2": dict(model_type="gpt2", architectures=["GPT2LMHeadModel"], n_inner=128),
}
NEW_TOKENS = 12


def _build(directory: Path, family: str) -> Path:
    spec = dict(FAMILIES[family])
    config = AutoConfig.for_model(spec.pop("model_type"), **COMMON, **spec)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    return directory


PROMPTS = [list(range(3, 40)), [7, 8, 9, 10, 11], list(range(100, 119))]
# Families the worker runs with its own fused layers; the others run transformers' modules.
FUSED = {"llama", "llama3-rope", "mistral", "qwen2"}


def _greedy_batch(model_dir: Path, dtype: str = "auto", **worker: object
                  ) -> tuple[ModelRunner, dict[int, list[int]], dict[int, list[float]]]:
    """The three prompts prefilled together, then decoded together: (runner, tokens, logprobs) per prompt."""
    runner = ModelRunner(WorkerConfig(model=str(model_dir), num_gpu_blocks_override=64, max_model_len=256,
                                      block_size=8, dtype=dtype, **worker))
    greedy = SamplingParams(temperature=0.0)
    tables = {i: list(range(i * 10, i * 10 + 10)) for i in range(len(PROMPTS))}
    outputs: dict[int, list[int]] = {i: [] for i in range(len(PROMPTS))}
    logprobs: dict[int, list[float]] = {i: [] for i in range(len(PROMPTS))}
    plan = StepPlanData(1, 1, [], [], [], [NewSequenceData(i, p, [], greedy, tables[i], 0, len(p))
                                           for i, p in enumerate(PROMPTS)], [], [])
    for step in range(NEW_TOKENS):
        for s in runner.execute(plan).sampled:
            outputs[s.seq_id].append(s.token_id)
            logprobs[s.seq_id].append(s.logprob)
        plan = StepPlanData(1, step + 2, [], [], [], [], [SequenceDeltaData(i, [], 1) for i in outputs], [])
    return runner, outputs, logprobs


def _assert_matches(label: str, reference: HFReference, outputs: dict[int, list[int]],
                    logprobs: dict[int, list[float]], tolerance: float) -> None:
    for i, prompt in enumerate(PROMPTS):
        ref = reference.greedy(prompt, NEW_TOKENS, stop_at_eos=False)
        cmp = compare_greedy(outputs[i], ref, near_tie=tolerance)
        assert cmp.matched, f"{label}, prompt {i}: {cmp.detail}"
        if cmp.near_tie_at is not None:
            print(f"{label}, prompt {i}: {cmp.detail}")
        # Each sampled token's logprob is HF's log_softmax at that position (up to any accepted near-tie).
        same = NEW_TOKENS if cmp.near_tie_at is None else cmp.near_tie_at
        expected = [float(ref.logprobs[t, tok]) for t, tok in enumerate(outputs[i][:same])]
        assert logprobs[i][:same] == pytest.approx(expected, abs=tolerance), f"{label}, prompt {i}"


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_batch_matches_transformers(family: str, tmp_path: Path) -> None:
    model_dir = _build(tmp_path / family, family)
    runner, outputs, logprobs = _greedy_batch(model_dir)
    assert isinstance(runner.model, LlamaModel if family in FUSED else TransformersModel)
    _assert_matches(family, HFReference(str(model_dir)), outputs, logprobs, 1e-4)


@pytest.mark.parametrize("cpu_matmul", ["onednn", "panels"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_each_float32_cpu_kernel_matches_transformers(family: str, cpu_matmul: str, tmp_path: Path) -> None:
    # No GEMV form of the compiled decode call, so every projection runs the chosen kernel (with panels, decode steps
    # run the compiled call's panel form: the same kernel).
    model_dir = _build(tmp_path / family, family)
    runner, outputs, logprobs = _greedy_batch(model_dir, cpu_matmul=cpu_matmul, decode_gemv_rows=0)
    compiled = runner.model.compiled
    assert (compiled is not None and compiled.panels) == (cpu_matmul == "panels")
    assert compiled is None or not compiled.max_rows
    kernels = {runner.model.lm_head.kernel} | {p.kernel for layer in runner.model.layers
                                                 for p in (layer.qkv, layer.o, layer.gate_up, layer.down)}
    assert kernels == {cpu_matmul}
    _assert_matches(f"{family} {cpu_matmul}", HFReference(str(model_dir)), outputs, logprobs, 1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_half_precision_matches_transformers_in_the_same_dtype(family: str, dtype: torch.dtype,
                                                               tmp_path: Path) -> None:
    model_dir = _build(tmp_path / family, family)
    runner, outputs, logprobs = _greedy_batch(model_dir, str(dtype).removeprefix("torch."))
    # bf16 decode steps of the three prompts run the compiled call's GEMV form; fp16 ones run layer by layer.
    assert (runner.model.compiled is not None) == (dtype == torch.bfloat16)
    _assert_matches(f"{family} {dtype}", HFReference(str(model_dir), dtype), outputs, logprobs,
                    HALF_TOLERANCE[dtype])


def test_dynamic_rope_scaling_runs_transformers_modules(tmp_path: Path) -> None:
    """Frequencies that change with the sequence length have no cached table: transformers' modules serve it."""
    spec = dict(FAMILIES["llama"])
    spec.pop("model_type")
    rope = dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0)
    config = AutoConfig.for_model("llama", **COMMON, **spec, rope_parameters=rope)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    runner, outputs, logprobs = _greedy_batch(tmp_path)
    assert isinstance(runner.model, TransformersModel)
    _assert_matches("llama dynamic rope", HFReference(str(tmp_path)), outputs, logprobs, 1e-4)


def test_unsupported_architecture_names_the_supported_ones(tmp_path: Path) -> None:
    config = AutoConfig.for_model("gpt_neox", hidden_size=32, num_attention_heads=2, num_hidden_layers=1,
                                  intermediate_size=64, vocab_size=64, architectures=["GPTNeoXForCausalLM"])
    config.save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match="supported architectures: LlamaForCausalLM, MistralForCausalLM"):
        load_config(str(tmp_path))


def test_a_gguf_file_is_served_like_its_converted_checkpoint(default_model_dir: Path) -> None:
    """--model FILE.gguf: transformers dequantizes it; the tokens equal the converted safetensors model's."""
    from shared.default_model import gguf_path

    gguf = gguf_path()
    config = load_config(str(gguf))
    assert config.architectures == ["LlamaForCausalLM"]  # the GGUF carries only the model type
    prompt = list(range(300, 330))
    greedy = SamplingParams(temperature=0.0)
    tokens = []
    for model in (str(gguf), str(default_model_dir)):
        runner = ModelRunner(WorkerConfig(model=model, num_gpu_blocks_override=8, max_model_len=128))
        plan = StepPlanData(1, 1, [], [], [], [NewSequenceData(0, prompt, [], greedy, [0, 1, 2], 0, len(prompt))], [], [])
        (sampled,) = runner.execute(plan).sampled
        tokens.append(sampled.token_id)
    assert tokens[0] == tokens[1]


def test_a_missing_gguf_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="GGUF checkpoint .* does not exist"):
        load_config(str(tmp_path / "missing.gguf"))

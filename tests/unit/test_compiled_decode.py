"""Decode steps in one compiled call (models/compiled_decode.py) against the layer-by-layer path.

Two runners on the same checkpoint, one with the compiled call and one without, run the
same plans. The GEMV form (a few rows) must agree to float32 rounding (the GEMV sums in
another order than oneDNN) in every step's sampled tokens, top logprobs and the KV caches
written; the panel form (more rows) runs the layer-by-layer path's kernels and must agree
bit for bit. The checkpoint has every bias the family allows and a sliding window shorter
than the sequences, so each argument of the compiled calls is exercised. In bf16 the GEMV
form keeps float32 activations where the layer-by-layer path rounds them, so there it is
held to transformers' bf16 outputs under the half-precision rule instead.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from shared.sampling_params import SamplingParams
from tests.hf_reference import HALF_TOLERANCE, HFReference, compare_greedy
from worker_service.attention import AttentionMetadata
from worker_service.config import WorkerConfig
from worker_service.model_runner import ModelRunner
from worker_service.models._numba_decode_step import gemv
from worker_service.models.compiled_decode import CompiledDecode
from worker_service.plan import NewSequenceData, SequenceDeltaData, StepPlanData

PROMPTS = [list(range(3, 40)), [7, 8, 9, 10, 11], list(range(100, 119)), list(range(200, 230))]
STEPS = 24


def _mistral(path: Path, intermediate_size: int, biases: bool) -> Path:
    """A 2-layer Mistral with a sliding window shorter than the sequences; ``biases``: on every projection."""
    config = AutoConfig.for_model(
        "mistral", architectures=["MistralForCausalLM"], vocab_size=512, hidden_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, intermediate_size=intermediate_size, max_position_embeddings=256,
        initializer_range=0.2, sliding_window=24, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    state = model.state_dict()
    # Mistral's config has no bias switches; the loader reads whichever biases the checkpoint holds.
    for name, tensor in list(state.items()):
        if biases and name.endswith("_proj.weight"):
            state[name.removesuffix("weight") + "bias"] = torch.randn(tensor.shape[0]) * 0.1
    model.save_pretrained(path, state_dict=state)
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _mistral(tmp_path_factory.mktemp("few-rows"), 128, biases=True)


def _runner(model_dir: Path, rows: int, dtype: str = "auto", cpu_matmul: str = "onednn", blocks: int = 64,
            layer_by_layer: bool = False) -> ModelRunner:
    """oneDNN projections unless asked: the panel form (panels only) then never runs. ``layer_by_layer``: no
    compiled call at all, whatever the projections."""
    runner = ModelRunner(WorkerConfig(model=str(model_dir), num_gpu_blocks_override=blocks, max_model_len=256,
                                      block_size=8, decode_gemv_rows=rows, dtype=dtype, cpu_matmul=cpu_matmul))
    if layer_by_layer:
        runner.model.compiled = None
    return runner


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The rows of every call of the compiled path, in order."""
    rows: list[int] = []
    original = CompiledDecode.__call__

    def counted(self: CompiledDecode, input_ids: torch.Tensor, *args: object) -> torch.Tensor:
        rows.append(input_ids.shape[0])
        return original(self, input_ids, *args)

    monkeypatch.setattr(CompiledDecode, "__call__", counted)
    return rows


def _run(runner: ModelRunner, prompts: list[list[int]]) -> list[list[tuple[int, float, list[float]]]]:
    """Per step, per sequence: (token, logprob, top-3 logprobs)."""
    sampling = SamplingParams(temperature=0.0, logprobs=3)
    plan = StepPlanData(1, 1, [], [], [], [NewSequenceData(i, p, [], sampling, list(range(i * 10, i * 10 + 10)), 0,
                                                           len(p)) for i, p in enumerate(prompts)], [], [])
    steps = []
    for step in range(STEPS):
        out = runner.execute(plan).sampled
        steps.append([(s.token_id, s.logprob, [lp for _, lp in s.top_logprobs]) for s in out])
        plan = StepPlanData(1, step + 2, [], [], [], [], [SequenceDeltaData(i, [], 1) for i in range(len(prompts))],
                            [])
    return steps


# 1, 3 and 4 rows: the GEMV takes rows four at a time, then two, then one.
@pytest.mark.parametrize("batch", [1, 3, 4])
def test_few_row_steps_match_the_layer_by_layer_path(model_dir: Path, batch: int, calls: list[int]) -> None:
    prompts = PROMPTS[:batch]
    fast, reference = _runner(model_dir, 4), _runner(model_dir, 0)
    assert reference.model.compiled is None
    got, want = _run(fast, prompts), _run(reference, prompts)
    # Every decode step (all but the prefill) took the compiled call, with all its sequences.
    assert calls == [batch] * (STEPS - 1)
    for step, (row, ref_row) in enumerate(zip(got, want, strict=True)):
        assert [t for t, _, _ in row] == [t for t, _, _ in ref_row], f"step {step}"
        for (_, logprob, top), (_, ref_logprob, ref_top) in zip(row, ref_row, strict=True):
            assert logprob == pytest.approx(ref_logprob, abs=1e-4)
            assert top == pytest.approx(ref_top, abs=1e-4)
    # The keys and values each path wrote into its cache (the window slides over them).
    for key, ref_key in zip(fast.cache.key_caches, reference.cache.key_caches, strict=True):
        torch.testing.assert_close(key, ref_key, rtol=1e-4, atol=1e-4)
    for value, ref_value in zip(fast.cache.value_caches, reference.cache.value_caches, strict=True):
        torch.testing.assert_close(value, ref_value, rtol=1e-4, atol=1e-4)


def test_more_sequences_than_the_limit_run_layer_by_layer(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runner = _runner(model_dir, 2)
    monkeypatch.setattr(CompiledDecode, "__call__", lambda *args: pytest.fail("three rows took the two-row path"))
    assert len(_run(runner, PROMPTS[:3])) == STEPS


def test_a_block_id_out_of_range_is_refused_before_any_kernel_runs(model_dir: Path) -> None:
    runner = _runner(model_dir, 4)
    model, cache = runner.model, runner.cache
    before = [k.clone() for k in cache.key_caches]
    attn = AttentionMetadata(
        backend=runner.backend, key_caches=cache.key_caches, value_caches=cache.value_caches, block_size=8,
        slot_mapping=torch.tensor([3]), num_prefill_tokens=0,
        prefill_block_tables=torch.zeros(0, 1, dtype=torch.int32),
        prefill_query_start_loc=torch.zeros(1, dtype=torch.int32), prefill_seq_lens=torch.zeros(0, dtype=torch.int32),
        decode_block_tables=torch.tensor([[64]], dtype=torch.int32), decode_context_lens=torch.tensor([4]),
        decode_max_context_len=4, wait_for_layer=lambda layer: None,
    )  # fmt: skip
    assert model.compiled.covers(1, attn)
    with pytest.raises(ValueError, match="block"):
        model.forward(torch.tensor([5]), torch.tensor([3]), attn)
    for key, old in zip(cache.key_caches, before, strict=True):
        assert torch.equal(key, old)


def test_the_memory_it_holds_is_the_dense_weights_and_the_untied_head(model_dir: Path) -> None:
    model = _runner(model_dir, 4).model
    hidden, layers, vocab, kv, inter = 64, 2, 512, 2 * 16, 128  # head size 16, 2 KV heads
    per_layer = (hidden + 2 * kv) * (hidden + 1) + hidden * (hidden + 1) + 2 * inter * (hidden + 1) + hidden * (inter + 1)
    assert model.compiled.extra_bytes() == 4 * (layers * per_layer + vocab * hidden)


def test_a_negative_row_limit_is_a_clear_configuration_error(model_dir: Path) -> None:
    with pytest.raises(ValueError, match="decode_gemv_rows must be non-negative, got -1"):
        WorkerConfig(model=str(model_dir), decode_gemv_rows=-1)


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Qwen2 (q/k/v biases, which transformers reads too) with an untied LM head."""
    config = AutoConfig.for_model(
        "qwen2", architectures=["Qwen2ForCausalLM"], vocab_size=512, hidden_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, max_position_embeddings=256,
        initializer_range=0.2, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("few-rows-qwen2")
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


@pytest.mark.parametrize("batch", [1, 3, 4])
def test_bf16_few_row_steps_match_transformers_in_bf16(qwen2_dir: Path, batch: int, calls: list[int]) -> None:
    """bf16 weights and caches, float32 activations: transformers' bf16 outputs within the half-precision rule."""
    prompts = PROMPTS[:batch]
    runner = _runner(qwen2_dir, 4, "bfloat16")
    steps = _run(runner, prompts)
    assert calls == [batch] * (STEPS - 1)
    assert runner.cache.key_caches[0].dtype == torch.bfloat16
    reference, tolerance = HFReference(str(qwen2_dir), torch.bfloat16), HALF_TOLERANCE[torch.bfloat16]
    for i, prompt in enumerate(prompts):
        tokens, logprobs = [row[i][0] for row in steps], [row[i][1] for row in steps]
        ref = reference.greedy(prompt, STEPS, stop_at_eos=False)
        cmp = compare_greedy(tokens, ref, near_tie=tolerance)
        assert cmp.matched, f"prompt {i}: {cmp.detail}"
        same = STEPS if cmp.near_tie_at is None else cmp.near_tie_at
        expected = [float(ref.logprobs[t, token]) for t, token in enumerate(tokens[:same])]
        assert logprobs[:same] == pytest.approx(expected, abs=tolerance), f"prompt {i}"


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5])
def test_gemv_over_bf16_weights_matches_a_float64_reference(rows: int) -> None:
    """The GEMV widens bf16 weights exactly and sums in float32: float64's result within float32 rounding."""
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=generator)
    weight = torch.randn(40, 96, generator=generator).to(torch.bfloat16)
    bias = torch.randn(40, generator=generator)
    out = np.empty((rows, 40), dtype=np.float32)
    gemv(x.numpy(), weight.view(torch.int16).numpy(), bias.numpy(), out)
    expected = x.double() @ weight.double().T + bias.double()
    torch.testing.assert_close(torch.from_numpy(out).double(), expected, rtol=1e-5, atol=1e-5)


def test_an_unknown_cpu_matmul_is_a_clear_configuration_error(model_dir: Path) -> None:
    with pytest.raises(ValueError, match="cpu_matmul must be one of auto, onednn, panels, got 'blas'"):
        WorkerConfig(model=str(model_dir), cpu_matmul="blas")


@pytest.fixture(scope="module")
def wide_mlp_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2048-feature MLP: SiLU-and-mul of 32+ rows runs on every thread, as it does in the layer-by-layer path
    (models/fused_ops.py's threshold)."""
    return _mistral(tmp_path_factory.mktemp("wide-mlp"), 2048, biases=False)


# Sequences whose decodes cross the parallel cache write's 32 rows (llmserve.kernels.cpu.numba_cache_ops).
MANY_PROMPTS = [[(7 * i + j) % 500 + 3 for j in range(5 + i % 7)] for i in range(40)]


# 1 to 4 rows: the panel kernel's row tiles of 1, 2, 3 and 4; 40 rows: tiles of 8.
@pytest.mark.parametrize(("checkpoint", "rows"), [
    ("model_dir", 1), ("model_dir", 2), ("model_dir", 3), ("model_dir", 4), ("wide_mlp_dir", 40),
], ids=["1-row", "2-rows", "3-rows", "4-rows", "40-rows-wide-mlp"])
def test_panel_steps_equal_the_layer_by_layer_path_bit_for_bit(
    request: pytest.FixtureRequest, checkpoint: str, rows: int, calls: list[int],
) -> None:
    """With panels every decode step runs the panel form (--decode-gemv-rows holds no dense copy then): the
    layer-by-layer path's kernels, so the same tokens, the same logprobs and the same cache contents to the bit."""
    model_dir = request.getfixturevalue(checkpoint)
    prompts = PROMPTS[:rows] if rows <= len(PROMPTS) else MANY_PROMPTS[:rows]
    fast = _runner(model_dir, 4, cpu_matmul="panels", blocks=400)
    reference = _runner(model_dir, 4, cpu_matmul="panels", blocks=400, layer_by_layer=True)
    assert fast.model.compiled.panels and fast.model.compiled.max_rows == 0
    got, want = _run(fast, prompts), _run(reference, prompts)
    assert calls == [rows] * (STEPS - 1)
    assert got == want
    for mine, theirs in zip([*fast.cache.key_caches, *fast.cache.value_caches],
                            [*reference.cache.key_caches, *reference.cache.value_caches], strict=True):
        assert torch.equal(mine, theirs)


def test_the_panel_form_reads_the_layers_own_panels(model_dir: Path) -> None:
    """No second copy: each layer's projection multiplies a row of the stack the compiled call reads."""
    model = _runner(model_dir, 4, cpu_matmul="panels").model
    assert model.compiled.panels and model.compiled.extra_bytes() == 0
    stacks = model.compiled._panel_arrays[::2]  # qkv, o, gate_up, down; a bias stack after each
    for index, layer in enumerate(model.layers):
        for stack, projection in zip(stacks, (layer.qkv, layer.o, layer.gate_up, layer.down), strict=True):
            assert projection.kernel == "panels"
            assert np.shares_memory(stack[index], projection._panels)


def test_onednn_projections_leave_larger_steps_layer_by_layer(model_dir: Path) -> None:
    model = _runner(model_dir, 2, cpu_matmul="onednn").model
    assert not model.compiled.panels

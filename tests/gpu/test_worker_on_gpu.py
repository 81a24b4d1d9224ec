"""The worker on a GPU: the model, the Numba-CUDA kernels and the KV cache in device memory, against transformers.

Greedy outputs of the in-process engine (the scheduler core and the worker's model runner, as the
services run them) equal transformers' `generate` on the same device and weights, under the near-tie
rule of tests/hf_reference.py; a second run keeps too few device blocks for its batch, so groups are
swapped out to pinned host memory and back (LayerSwapper's side stream) and their outputs must not
change. Skipped without a CUDA device.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from llmserve import LLM, SamplingParams  # noqa: E402
from tests.hf_reference import HFReference, compare_greedy  # noqa: E402

# Prompts of 3 to 300 tokens: prefill attention over several blocks, decode over up to 340 positions.
PROMPTS = [[7, 8, 9], list(range(500, 540)), [(i * 37) % 4000 + 100 for i in range(300)], list(range(1000, 1130))]
MAX_TOKENS = 40


def _greedy_equal_to_transformers(outputs: list, reference: HFReference) -> None:
    for out, prompt in zip(outputs, PROMPTS):
        assert not out.error, out.error
        for completion in out.outputs:
            assert len(completion.token_ids) == MAX_TOKENS
            cmp = compare_greedy(completion.token_ids, reference.greedy(prompt, MAX_TOKENS, stop_at_eos=False))
            assert cmp.matched, cmp.detail


def test_greedy_outputs_on_the_gpu_equal_transformers(tiny_llama_dir: Path) -> None:
    with LLM(model=str(tiny_llama_dir), device="cuda", dtype="float32", max_model_len=512) as llm:
        outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
                               use_tqdm=False)
    _greedy_equal_to_transformers(outputs, HFReference(str(tiny_llama_dir), device="cuda"))


def test_swapped_groups_on_the_gpu_keep_their_outputs(tiny_llama_dir: Path) -> None:
    # Two sequences per prompt (n=2: a group of decoding sequences is preempted by swap, not recompute),
    # both the argmax (top_k=1: greedy, which n=2 refuses by name), in 40 blocks of 16 slots where the batch
    # needs ~55: groups leave and come back.
    swapped: list[int] = []
    with LLM(model=str(tiny_llama_dir), device="cuda", dtype="float32", max_model_len=512, num_gpu_blocks_override=40,
             block_size=16, swap_space=1) as llm:
        cache = llm._engine._runner.cache  # noqa: SLF001 - counts the swaps the plans asked for
        swap_out = cache.swap_out

        def counting_swap_out(pairs: list[tuple[int, int]]) -> None:
            swapped.append(len(pairs))
            swap_out(pairs)

        cache.swap_out = counting_swap_out
        outputs = llm.generate(PROMPTS, SamplingParams(n=2, top_k=1, max_tokens=MAX_TOKENS, ignore_eos=True),
                               use_tqdm=False)
    assert sum(swapped) > 0, "no block was swapped out: the case does not exercise the swaps"
    _greedy_equal_to_transformers(outputs, HFReference(str(tiny_llama_dir), device="cuda"))

"""The offline API: LLM(model=...).generate(prompts, SamplingParams(...)) over local services."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from llmserve import LLM, SamplingParams
from tests.hf_reference import HFReference, compare_greedy


def test_generate_returns_outputs_in_prompt_order_equal_to_transformers(tiny_llama_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    text = ["The quick brown fox", "Once upon a time, in a land far away,", "1 2 3 4"]
    ids = [list(range(500, 540)), [7, 8, 9]]
    with LLM(model=str(tiny_llama_dir), max_model_len=256, num_threads=1) as llm:
        outputs = llm.generate(text + ids, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                               use_tqdm=False)
        # Per-prompt parameters, and several sequences per prompt.
        seeded = llm.generate(["Hello"] * 2, [SamplingParams(n=2, temperature=0.9, seed=5, max_tokens=6)] * 2,
                              use_tqdm=False)
        answer = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(temperature=0.0, max_tokens=4),
                          use_tqdm=False)
        with pytest.raises(TypeError, match="unknown engine arguments: bogus"):
            LLM(model=str(tiny_llama_dir), bogus=1)
    reference = HFReference(str(tiny_llama_dir))
    assert [o.prompt for o in outputs] == text + [None, None]
    for out, prompt in zip(outputs, [tokenizer(t).input_ids for t in text] + ids):
        assert out.prompt_token_ids == prompt and out.finished and not out.error
        (completion,) = out.outputs
        assert completion.finish_reason == "length" and len(completion.token_ids) == 8
        cmp = compare_greedy(completion.token_ids, reference.greedy(prompt, 8, stop_at_eos=False))
        assert cmp.matched, cmp.detail
        assert completion.text == tokenizer.decode(completion.token_ids, skip_special_tokens=True)
    # The same seed gives the same two sequences for both prompts, and they differ from each other.
    assert [[c.token_ids for c in o.outputs] for o in seeded][0] == [[c.token_ids for c in o.outputs] for o in seeded][1]
    assert len(seeded[0].outputs) == 2 and seeded[0].outputs[0].token_ids != seeded[0].outputs[1].token_ids
    assert len(answer) == 1 and len(answer[0].outputs[0].token_ids) >= 1
    # A conversation's prompt tokens are the chat template's rendering, as transformers tokenizes it.
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                             tokenize=True, return_dict=True)["input_ids"]
    assert answer[0].prompt is None and answer[0].prompt_token_ids == list(rendered)

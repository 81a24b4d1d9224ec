"""The offline API: LLM(model=...).generate(prompts, SamplingParams(...)), in process and over local services."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from unittest import mock

import pytest
import torch
from transformers import AutoTokenizer

from llmserve import LLM, SamplingParams, StructuredOutputsParams
from tests.hf_reference import HFReference, compare_greedy


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
TOOL_TURN = [{"role": "user", "content": "Weather in Paris?"},
             {"role": "assistant", "content": None, "tool_calls": [
                 {"id": "call-1", "type": "function",
                  "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
             {"role": "tool", "tool_call_id": "call-1", "content": "18 C"}]


def test_generate_returns_outputs_in_prompt_order_equal_to_transformers(tiny_llama_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    text = ["The quick brown fox", "Once upon a time, in a land far away,", "1 2 3 4"]
    ids = [list(range(500, 540)), [7, 8, 9]]
    # In process: no Redis, no service, not one subprocess.
    with mock.patch.object(subprocess, "Popen", side_effect=AssertionError("the in-process engine started a process")), \
            LLM(model=str(tiny_llama_dir), max_model_len=256, num_threads=1) as llm:
        outputs = llm.generate(text + ids, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                               use_tqdm=False)
        # Per-prompt parameters, and several sequences per prompt.
        seeded = llm.generate(["Hello"] * 2, [SamplingParams(n=2, temperature=0.9, seed=5, max_tokens=6)] * 2,
                              use_tqdm=False)
        answer = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(temperature=0.0, max_tokens=4),
                          use_tqdm=False)
        (continued,) = llm.chat([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}],
                                SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False,
                                add_generation_prompt=False, continue_final_message=True)
        # A turn that called a tool and got its answer, with the tools (vLLM's LLM.chat(tools=...)).
        (tooled,) = llm.chat(TOOL_TURN, SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False, tools=TOOLS)
        with pytest.raises(ValueError, match=re.escape("tools[0] must be {\"type\": \"function\"")):
            llm.chat(TOOL_TURN, tools=[{"name": "get_weather"}], use_tqdm=False)
        # vLLM's prompt dicts (TextPrompt, TokensPrompt), and prompt logprobs.
        as_dicts = llm.generate([{"prompt": text[0]}, {"prompt_token_ids": ids[1]}],
                                SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        (scored,) = llm.generate({"prompt_token_ids": ids[0]}, SamplingParams(max_tokens=1, prompt_logprobs=3),
                                 use_tqdm=False)
        (stopped,) = llm.generate([ids[1]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True,
                                                           logit_bias={777: 100.0}, stop_token_ids=[777]),
                                  use_tqdm=False)
        with pytest.raises(TypeError, match="exactly one of 'prompt'"):
            llm.generate({"text": "Hi"})
        with pytest.raises(TypeError, match="a prompt is a str, a list of token ids"):
            llm.generate(3)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="unknown engine arguments: bogus"):
            LLM(model=str(tiny_llama_dir), bogus=1)
    reference = HFReference(str(tiny_llama_dir))
    assert [o.prompt for o in outputs] == text + [None, None]
    assert all(o.prompt_logprobs is None for o in outputs)  # not asked for
    # vLLM's stop_reason: a stop token id is an int.
    assert (stopped.outputs[0].finish_reason, stopped.outputs[0].stop_reason) == ("stop", 777)
    assert [(o.prompt, o.prompt_token_ids, o.outputs[0].token_ids) for o in as_dicts] == [
        (o.prompt, o.prompt_token_ids, o.outputs[0].token_ids) for o in (outputs[0], outputs[4])]
    # Each prompt token's logprob and the top 3 there, as transformers' log_softmax gives them.
    prompt = ids[0]
    assert scored.prompt_logprobs[0] is None and len(scored.prompt_logprobs) == len(prompt)
    with torch.inference_mode():
        expected = torch.log_softmax(reference.model(torch.tensor([prompt])).logits[0, :-1].float(), dim=-1)
    for position, (logprob, top) in enumerate(scored.prompt_logprobs[1:]):
        assert abs(logprob - float(expected[position, prompt[position + 1]])) < 1e-4
        values, top_ids = expected[position].topk(3)
        assert list(top) == top_ids.tolist()
        assert max(abs(top[t] - float(v)) for t, v in zip(top_ids.tolist(), values)) < 1e-4
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
    # vLLM's assistant prefill: the answer begun by the caller stays open.
    opened = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}],
                                           add_generation_prompt=False, continue_final_message=True, tokenize=True,
                                           return_dict=True)["input_ids"]
    assert continued.prompt_token_ids == list(opened) and tokenizer.decode(opened).endswith("Hello")
    # The template is given the call's arguments as an object, and the tools.
    template_turn = [TOOL_TURN[0], {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call-1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        TOOL_TURN[2]]
    assert tooled.prompt_token_ids == tokenizer.apply_chat_template(
        template_turn, tools=TOOLS, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    assert "18 C" in tokenizer.decode(tooled.prompt_token_ids)


def test_in_process_and_services_give_the_same_outputs(tiny_llama_dir: Path) -> None:
    """The same prompts and parameters through the in-process engine and through Redis + gRPC services."""
    prompts = ["The quick brown fox", list(range(700, 760)), "1 2 3", [9] * 40, "Yes or no?", "Call"]
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
              SamplingParams(n=2, temperature=0.8, top_p=0.9, seed=11, max_tokens=10, logprobs=2),
              SamplingParams(temperature=0.0, max_tokens=6, stop=["3"], prompt_logprobs=2),
              SamplingParams(temperature=0.7, seed=3, max_tokens=9, presence_penalty=0.5),
              # A random model follows a grammar only because the worker masks every other token.
              SamplingParams(n=2, temperature=1.0, seed=4, max_tokens=8,
                             structured_outputs=StructuredOutputsParams(choice=["yes", "no", "maybe not"])),
              SamplingParams(temperature=0.0, max_tokens=16,
                             structured_outputs=StructuredOutputsParams(regex="[0-9]{3}-[0-9]{4}"))]
    engine_args = dict(max_model_len=256, num_threads=1, max_num_seqs=3, enable_prefix_caching=True)

    def run(services: bool) -> list[tuple]:
        with LLM(model=str(tiny_llama_dir), services=services, **engine_args) as llm:
            outputs = llm.generate(prompts, params, use_tqdm=False)
            # Refused prompts fail alone, each with its reason, beside one that runs.
            bad = llm.generate(["x", "", "y"], [SamplingParams(max_tokens=1000), SamplingParams(max_tokens=2),
                                                SamplingParams(max_tokens=2, temperature=0.0)], use_tqdm=False)
        assert bad[0].error.startswith("INVALID_ARGUMENT: ") and "maximum context length is 256" in bad[0].error
        assert bad[1].error.startswith("INVALID_ARGUMENT: ") and "prompt is empty" in bad[1].error
        assert (bad[0].outputs, bad[1].outputs, bad[1].prompt_token_ids) == ([], [], [])
        assert not bad[2].error and len(bad[2].outputs[0].token_ids) == 2 and bad[2].prompt_token_ids
        return [(o.prompt_token_ids, o.prompt_logprobs, [(c.token_ids, c.text, c.finish_reason,
                                                          [lp for lp, _ in c.logprobs]) for c in o.outputs])
                for o in outputs]

    in_process, services = run(False), run(True)
    choices, (phone,) = [c[1] for c in in_process[4][2]], in_process[5][2]
    assert set(choices) <= {"yes", "no", "maybe not"} and phone[2] == "stop", (choices, phone)
    assert re.fullmatch("[0-9]{3}-[0-9]{4}", phone[1]), phone
    assert [p for p, _, _ in in_process] == [p for p, _, _ in services]
    # Prompt logprobs where asked (the third prompt), with the same positions left out; values as below.
    assert [plp is None for _, plp, _ in in_process] == [False if i == 2 else True for i in range(len(prompts))]
    (_, plp_mine, _), (_, plp_theirs, _) = in_process[2], services[2]
    assert [e is None for e in plp_mine] == [e is None for e in plp_theirs] == [True] + [False] * (len(plp_mine) - 1)
    assert [e[0] for e in plp_mine[1:]] == pytest.approx([e[0] for e in plp_theirs[1:]], abs=1e-4)
    for (_, _, mine), (_, _, theirs) in zip(in_process, services):
        assert [(t, text, reason) for t, text, reason, _ in mine] == [(t, text, reason) for t, text, reason, _ in theirs]
        for (*_, lp_mine), (*_, lp_theirs) in zip(mine, theirs):
            # The two engines batch the requests differently (the services' steps depend on arrival timing), so
            # the float32 GEMMs round differently: on this tiny model's large logits that moves a log-probability
            # by up to ~1e-4 (2.1e-5 seen here in a loaded run; 9.5e-5 between batched and single transformers).
            assert lp_mine == pytest.approx(lp_theirs, abs=1e-4)

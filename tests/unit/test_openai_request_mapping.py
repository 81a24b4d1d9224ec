"""OpenAI request fields -> the public gRPC API's GenerateRequest and SamplingParams."""

from __future__ import annotations

import json

import pytest

from openai_api.errors import OpenAIError
from openai_api.protocol import ChatCompletionRequest, CompletionRequest, TokenizeRequest
from openai_api.request_mapping import chat_request, completion_requests, tokenize_request
from openai_api.tools import tool_call_mode
from shared.sampling_proto import sampling_from_proto


_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def _completion(**fields: object) -> list:
    return completion_requests(CompletionRequest(**{"prompt": "hi", **fields}), "cmpl-1")


def _chat(**fields: object):
    req = ChatCompletionRequest(**{"messages": [{"role": "user", "content": "hi"}], **fields})
    return chat_request(req, "chat-1", tool_call_mode(req))


def test_completion_sampling_fields_map_one_to_one() -> None:
    (req,) = _completion(max_tokens=7, temperature=0.5, top_p=0.75, n=2, stop="END", seed=3, presence_penalty=0.5,
                         frequency_penalty=-0.5, logprobs=2, best_of=3)
    assert req.request_id == "cmpl-1" and req.prompt == "hi"
    params = sampling_from_proto(req.sampling)
    assert (params.max_tokens, params.temperature, params.top_p, params.n, params.best_of) == (7, 0.5, 0.75, 2, 3)
    assert params.stop == ["END"] and params.seed == 3 and params.logprobs == 2
    assert (params.presence_penalty, params.frequency_penalty) == (0.5, -0.5)


def test_unset_fields_keep_the_engine_defaults() -> None:
    (req,) = _completion()
    assert not req.sampling.HasField("max_tokens")  # completions: OpenAI's and the engine's default of 16
    assert not req.sampling.HasField("temperature") and not req.sampling.HasField("logprobs")
    assert sampling_from_proto(req.sampling).max_tokens == 16


def test_vllm_extra_parameters_are_honoured() -> None:
    (req,) = _completion(top_k=5, min_p=0.1, repetition_penalty=1.2, min_tokens=2, stop_token_ids=[9],
                         ignore_eos=True, include_stop_str_in_output=True, skip_special_tokens=False)
    params = sampling_from_proto(req.sampling)
    assert (params.top_k, params.min_tokens, params.stop_token_ids) == (5, 2, [9])
    assert params.min_p == pytest.approx(0.1) and params.repetition_penalty == pytest.approx(1.2)
    assert params.ignore_eos and params.include_stop_str_in_output and not params.skip_special_tokens


def test_spaces_between_special_tokens_reaches_the_sampling_params() -> None:
    (unset,) = _completion()
    assert not unset.sampling.HasField("spaces_between_special_tokens")
    (req,) = _completion(spaces_between_special_tokens=False)
    assert not sampling_from_proto(req.sampling).spaces_between_special_tokens
    assert not sampling_from_proto(_chat(spaces_between_special_tokens=False).sampling).spaces_between_special_tokens


def test_prompt_logprobs_echo_and_priority_zero() -> None:
    assert not _completion()[0].sampling.HasField("prompt_logprobs")
    assert _completion(prompt_logprobs=0)[0].sampling.prompt_logprobs == 0
    assert _chat(prompt_logprobs=3).sampling.prompt_logprobs == 3
    # Echo with logprobs reports the prompt's too: `logprobs` of them unless prompt_logprobs says otherwise.
    assert _completion(echo=True, logprobs=2)[0].sampling.prompt_logprobs == 2
    assert _completion(echo=True, logprobs=2, prompt_logprobs=0)[0].sampling.prompt_logprobs == 0
    assert not _completion(echo=True)[0].sampling.HasField("prompt_logprobs")
    (req,) = _completion(priority=0)
    assert req.prompt == "hi" and _chat(priority=0).messages


def test_prompt_forms_and_batches() -> None:
    assert [r.prompt_token_ids for r in _completion(prompt=[1, 2, 3])] == [[1, 2, 3]]
    batch = _completion(prompt=["a", "b"])
    assert [(r.request_id, r.prompt) for r in batch] == [("cmpl-1-0", "a"), ("cmpl-1-1", "b")]
    assert [list(r.prompt_token_ids) for r in _completion(prompt=[[1], [2, 3]])] == [[1], [2, 3]]


def test_negative_seed_wraps_into_uint64() -> None:
    (req,) = _completion(seed=-1)
    assert req.sampling.seed == 2**64 - 1


def test_chat_messages_and_max_tokens() -> None:
    req = chat_request(ChatCompletionRequest(messages=[
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]},
        {"role": "assistant", "content": None},
    ]), "c", None)
    assert [(m.role, m.content) for m in req.messages] == [("system", "Be brief."), ("user", "Hello there"),
                                                         ("assistant", "")]
    # Chat without a limit generates up to the context length (0), as OpenAI's chat API.
    assert req.sampling.HasField("max_tokens") and req.sampling.max_tokens == 0
    assert _chat(max_tokens=5).sampling.max_tokens == 5
    assert _chat(max_tokens=5, max_completion_tokens=9).sampling.max_tokens == 9


def test_chat_logprobs() -> None:
    assert not _chat().sampling.HasField("logprobs")
    assert _chat(logprobs=True).sampling.logprobs == 0
    assert _chat(logprobs=True, top_logprobs=4).sampling.logprobs == 4


@pytest.mark.parametrize(
    ("build", "fields", "param"),
    [
        (_completion, dict(max_tokens=0), "max_tokens"),
        (_completion, dict(n=0), "n"),
        (_completion, dict(logprobs=-1), "logprobs"),
        (_completion, dict(prompt=[]), "prompt"),
        (_completion, dict(prompt=[1, -2]), "prompt"),
        (_completion, dict(prompt_logprobs=-1), "prompt_logprobs"),
        (_completion, dict(echo=True, logprobs=1, prompt_logprobs=2**32), "prompt_logprobs"),
        # The scheduler is first come, first served: vLLM's 400 for a priority it cannot honour.
        (_completion, dict(priority=1), "priority"),
        (_chat, dict(priority=-3), "priority"),
        (_completion, dict(suffix="x"), "suffix"),
        (_completion, dict(logit_bias={"five": 1.0}), "logit_bias"),
        (_completion, dict(logit_bias={"-3": 1.0}), "logit_bias"),
        (_completion, dict(stream_options={"include_usage": True}), "stream_options"),
        (_completion, dict(stop_token_ids=[-1]), "stop_token_ids"),
        (_chat, dict(top_logprobs=2), "top_logprobs"),
        (_chat, dict(max_completion_tokens=0), "max_completion_tokens"),
        (_chat, dict(tools=[_TOOL]), "tool_choice"),  # "auto", the default with tools: no tool-call parser
        (_chat, dict(tools=[_TOOL], tool_choice="auto"), "tool_choice"),
        (_chat, dict(tool_choice="required"), "tool_choice"),
        (_chat, dict(tool_choice={"type": "function", "function": {"name": "get_weather"}}), "tool_choice"),
        (_chat, dict(tools=[_TOOL], tool_choice={"type": "function", "function": {"name": "get_time"}}),
         "tool_choice.function.name"),
        (_chat, dict(tools=[_TOOL], tool_choice="required", response_format={"type": "json_object"}), "tool_choice"),
        (_chat, dict(response_format={"type": "structural_tag"}), "response_format.type"),
        (_chat, dict(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
         "response_format.json_schema"),
        (_completion, dict(guided_regex="a+", guided_choice=["a"]), "guided_choice"),
        (_completion, dict(response_format={"type": "json_object"}, structured_outputs={"regex": "a"}),
         "structured_outputs"),
        (_completion, dict(structured_outputs={"regex": "a", "choice": ["a"]}), "structured_outputs"),
        (_completion, dict(structured_outputs={}), "structured_outputs"),
        (_completion, dict(structured_outputs={"regex": "a", "structural_tag": "{}"}),
         "structured_outputs.structural_tag"),
        (_chat, dict(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), "messages[0].content"),
        (_chat, dict(messages=[]), "messages"),
    ],
)
def test_fields_the_front_rejects_are_400(build, fields: dict, param: str) -> None:
    with pytest.raises(OpenAIError) as info:
        build(**fields)
    assert info.value.status == 400 and info.value.param == param
    assert info.value.body()["error"]["type"] == "invalid_request_error"


def test_template_kwargs_and_documents_reach_the_chat_options() -> None:
    docs = [{"title": "A", "text": "alpha"}]
    msg = _chat(chat_template_kwargs={"enable_thinking": False}, documents=docs)
    assert json.loads(msg.chat_options.template_kwargs) == {"enable_thinking": False, "documents": docs}
    assert _chat().chat_options.template_kwargs == ""
    tokenize = tokenize_request(TokenizeRequest(messages=[{"role": "user", "content": "hi"}],
                                                chat_template_kwargs={"enable_thinking": False}))
    assert json.loads(tokenize.chat_options.template_kwargs) == {"enable_thinking": False}
    for build, fields, param in [
        (_chat, dict(documents=docs, chat_template_kwargs={"documents": docs}), "documents"),
        (lambda **f: tokenize_request(TokenizeRequest(prompt="hi", **f)), dict(chat_template_kwargs={"a": 1}),
         "chat_template_kwargs"),
        (lambda **f: tokenize_request(TokenizeRequest(prompt="hi", **f)), dict(documents=docs), "documents"),
    ]:
        with pytest.raises(OpenAIError) as info:
            build(**fields)
        assert info.value.status == 400 and info.value.param == param


def test_tokenize_refuses_an_empty_message_list_as_chat_does() -> None:
    with pytest.raises(OpenAIError) as info:
        tokenize_request(TokenizeRequest(messages=[]))
    assert info.value.status == 400 and info.value.param == "messages"
    assert "at least one message" in info.value.body()["error"]["message"]


def test_unknown_fields_are_accepted_and_named() -> None:
    req = CompletionRequest(prompt="hi", frobnicate=1, zeta=2)
    assert req.unknown_fields() == ["frobnicate", "zeta"]
    assert len(completion_requests(req, "x")) == 1


def test_logit_bias_and_allowed_token_ids_map_to_the_sampling_params() -> None:
    (request,) = _completion(logit_bias={"5": 2.5, "17": -100}, allowed_token_ids=[5, 9])
    msg = request.sampling
    assert dict(msg.logit_bias) == {5: 2.5, 17: -100.0} and list(msg.allowed_token_ids) == [5, 9]


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        (dict(response_format={"type": "json_object"}), {"json_object": True}),
        (dict(response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "integer"}}}),
         {"json": '{"type": "integer"}'}),
        (dict(response_format={"type": "text"}), None),
        (dict(structured_outputs={"json": {"type": "string"}, "disable_any_whitespace": True}),
         {"json": '{"type": "string"}', "disable_any_whitespace": True}),
        (dict(structured_outputs={"json": '{"type": "string"}'}), {"json": '{"type": "string"}'}),
        (dict(structured_outputs={"json_object": True}), {"json_object": True}),
        (dict(structured_outputs={"regex": "[a-z]+"}), {"regex": "[a-z]+"}),
        (dict(structured_outputs={"choice": ["yes", "no"]}), {"choice": ["yes", "no"]}),
        (dict(structured_outputs={"grammar": 'start: "a"'}), {"grammar": 'start: "a"'}),
        (dict(guided_json={"type": "boolean"}), {"json": '{"type": "boolean"}'}),
        (dict(guided_regex="\\d+"), {"regex": "\\d+"}),
        (dict(guided_choice=["a", "b"]), {"choice": ["a", "b"]}),
        (dict(guided_grammar='root ::= "x"'), {"grammar": 'root ::= "x"'}),
    ],
)
@pytest.mark.parametrize("build", [_completion, _chat])
def test_structured_output_spellings_map_to_one_constraint(build, fields: dict, expected: dict | None) -> None:
    params = sampling_from_proto(build(**fields)[0].sampling if build is _completion else build(**fields).sampling)
    structured = params.structured_outputs
    if expected is None:
        assert structured is None
        return
    assert structured is not None
    got = {k: getattr(structured, k) for k in ("json", "json_object", "regex", "choice", "grammar",
                                               "disable_any_whitespace")}
    assert got == {"json": None, "json_object": False, "regex": None, "choice": None, "grammar": None,
                   "disable_any_whitespace": False, **expected}

"""Tool calling through the OpenAI-compatible front with the official openai client, on the default model and
the services as real processes: tool_choice "required" and a named function give calls whose arguments follow
the tools' schemas, streamed and whole alike (greedy); a conversation that carries a call and its result is
rendered by the scheduler as transformers renders it; with the front's hermes and qwen3 parsers, tool_choice
"auto" reads the thinking and the calls from the model's text; what cannot be served is a 400 that names its
field."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import pytest
from transformers import AutoTokenizer

from llmserve.local_cluster import ClusterSpec, LocalCluster
from tests.e2e.cluster_checks import assert_all_blocks_free

openai = pytest.importorskip("openai")

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["C", "F"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city now",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time in a timezone",
                                           "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "What is the weather like in Paris, in Celsius?"}]


@pytest.fixture(scope="module")
def cluster(default_model_dir: Path) -> Iterator[LocalCluster]:
    # The front reads Hermes-style calls for tool_choice "auto", and Qwen 3's thinking.
    with LocalCluster(ClusterSpec(model=str(default_model_dir), http_port=0, worker_args=["--max-model-len", "1024"],
                                  http_args=["--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                                             "--reasoning-parser", "qwen3"])) as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster: LocalCluster) -> Iterator["openai.OpenAI"]:
    with openai.OpenAI(base_url=f"{cluster.http_url}/v1", api_key="unused", max_retries=0, timeout=300) as c:
        yield c


def _streamed(client: "openai.OpenAI", **fields: object) -> tuple[list[dict], str, str | None, str]:
    """The tool calls a stream assembles (as OpenAI's SDKs do: by index, arguments concatenated), its content, its
    finish and its reasoning."""
    calls: dict[int, dict] = {}
    content, finish, reasoning = "", None, ""
    for chunk in client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, temperature=0.0,
                                                stream=True, **fields):
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": delta.id, "name": delta.function.name, "arguments": ""})
                call["arguments"] += delta.function.arguments or ""
            content += choice.delta.content or ""
            reasoning += (choice.delta.model_extra or {}).get("reasoning") or ""
            finish = choice.finish_reason or finish
    return [calls[i] for i in sorted(calls)], content, finish, reasoning


def _streamed_calls(client: "openai.OpenAI", **fields: object) -> tuple[list[dict], str | None]:
    calls, _, finish, _ = _streamed(client, **fields)
    return calls, finish


def _whole_calls(message) -> list[dict]:
    return [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments} for c in message.tool_calls]


@pytest.mark.parametrize("tool_choice", [
    {"type": "function", "function": {"name": "get_weather"}},
    "required",
])
def test_calls_follow_the_tools_schemas_streamed_and_whole(client: "openai.OpenAI", cluster: LocalCluster,
                                                           tool_choice: object) -> None:
    fields = {"tool_choice": tool_choice, "max_tokens": 200, "parallel_tool_calls": False}
    whole = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, temperature=0.0, **fields)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None and choice.message.role == "assistant"
    calls = _whole_calls(choice.message)
    assert len(calls) == 1  # a named function, or "required" without parallel calls
    for call in calls:
        assert call["id"].startswith("chatcmpl-tool-")
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
    if isinstance(tool_choice, dict):
        assert calls[0]["name"] == "get_weather"
    streamed, finish = _streamed_calls(client, **fields)
    assert finish == "tool_calls"
    # Greedy: the same calls (their ids are each response's own).
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed] == [
        (c["name"], json.loads(c["arguments"])) for c in calls]
    assert all(c["id"].startswith("chatcmpl-tool-") for c in streamed)
    assert_all_blocks_free(cluster)


def test_parallel_calls_under_required(client: "openai.OpenAI") -> None:
    """Without parallel_tool_calls: false the array may hold several calls; each follows its tool's schema, and one
    cut short by max_tokens comes back as content after the complete ones."""
    whole = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, temperature=0.0,
                                           tool_choice="required", max_tokens=120)
    choice = whole.choices[0]
    calls = _whole_calls(choice.message)
    assert calls, choice
    for call in calls:
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
    assert choice.finish_reason in ("tool_calls", "length")
    if choice.finish_reason == "length":
        assert choice.message.content  # the call that was being written
    streamed, finish = _streamed_calls(client, tool_choice="required", max_tokens=120)
    assert finish == choice.finish_reason
    assert [(c["name"], c["arguments"]) for c in streamed] == [(c["name"], c["arguments"]) for c in calls]


def test_auto_reads_the_models_own_call_syntax(client: "openai.OpenAI", cluster: LocalCluster) -> None:
    """tool_choice "auto" with the hermes parser: the model's <tool_call> blocks become calls, the text around them
    content. The model is made to write a call by a regex (a small model rarely calls on its own); the parser
    reads its generated text as it would any model's, token by token when streamed."""
    regex = (r'<think>The user asks about (Paris|Lyon)\.</think>Checking the weather\.<tool_call>\n\{"name": '
             r'"get_weather", "arguments": \{"city": "(Paris|Lyon)", "unit": "(C|F)"\}\}\n</tool_call>')
    fields = {"max_tokens": 100, "extra_body": {"structured_outputs": {"regex": regex}}}
    whole = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, temperature=0.0,
                                           tool_choice="auto", **fields)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking the weather."
    # The thinking (the qwen3 reasoning parser), under vLLM's name and DeepSeek's.
    reasoning = choice.message.model_extra["reasoning"]
    assert reasoning in ("The user asks about Paris.", "The user asks about Lyon.")
    assert choice.message.model_extra["reasoning_content"] == reasoning
    (call,) = _whole_calls(choice.message)
    assert call["name"] == "get_weather"
    jsonschema.validate(json.loads(call["arguments"]), WEATHER)
    calls, content, finish, streamed_reasoning = _streamed(client, tool_choice="auto", **fields)  # also the default
    assert (content, finish, streamed_reasoning) == ("Checking the weather.", "tool_calls", reasoning)
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [(call["name"], json.loads(call["arguments"]))]
    # Free text with no call in it is the answer, streamed as it comes.
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, temperature=0.0,
                                           max_tokens=12)
    assert plain.choices[0].message.content and not plain.choices[0].message.tool_calls
    _, streamed_content, _, _ = _streamed(client, max_tokens=12)
    assert streamed_content == plain.choices[0].message.content
    assert_all_blocks_free(cluster)


def test_a_conversation_with_a_call_and_its_result(client: "openai.OpenAI", cluster: LocalCluster,
                                                   default_model_dir: Path) -> None:
    first = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, temperature=0.0,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                           max_tokens=200)
    call = first.choices[0].message.tool_calls[0]
    messages = [*MESSAGES, first.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": "18 degrees, clear sky"}]
    answer = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="none",
                                            temperature=0.0, max_tokens=16)
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls
    assert answer.choices[0].finish_reason in ("stop", "length")
    # The scheduler rendered the conversation (the tool's result, the call's arguments as an object) as
    # transformers does.
    tokens = httpx.post(f"{cluster.http_url}/tokenize", json={"model": MODEL, "messages": messages, "tools": TOOLS},
                        timeout=60).json()["tokens"]
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    template_messages = [*MESSAGES, {"role": "assistant", "content": "", "tool_calls": [
        {"id": call.id, "type": "function",
         "function": {"name": call.function.name, "arguments": json.loads(call.function.arguments)}}]},
        messages[2]]
    assert tokens == tokenizer.apply_chat_template(template_messages, tools=TOOLS, add_generation_prompt=True,
                                                   tokenize=True, return_dict=True)["input_ids"]
    assert answer.usage.prompt_tokens == len(tokens)
    assert_all_blocks_free(cluster)


@pytest.mark.parametrize("fields, param, fragment", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "book_flight"}}},
     "tool_choice.function.name", "'book_flight', which is not one of the tools"),
    ({"tool_choice": "required"}, "tool_choice", "the request has no tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "set no other constraint"),
    ({"messages": [*MESSAGES, {"role": "tool", "content": "18 C"}], "tools": TOOLS, "tool_choice": "none"}, None,
     "messages[1]: a tool message needs tool_call_id"),
    ({"tools": [TOOLS[0], TOOLS[0]], "tool_choice": "none"}, None, "tools name 'get_weather' more than once"),
    ({"tools": TOOLS, "tool_choice": "any"}, "tool_choice", 'tool_choice must be "none", "auto", "required" or'),
    ({"tools": TOOLS, "tool_choice": "required", "use_beam_search": True, "n": 2, "temperature": 0}, "tool_choice",
     "not supported with beam search. (tool_choice required constrains the output with structured outputs)"),
    # The scheduler compiles the constraint made of the parameters; its refusal names the tool.
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}],
      "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tools",
     "f's parameters are not a JSON schema the output can be held to: Invalid type: objekt"),
])
def test_what_cannot_be_served_is_a_400(cluster: LocalCluster, fields: dict, param: str | None, fragment: str) -> None:
    reply = httpx.post(f"{cluster.http_url}/v1/chat/completions",
                       json={"model": MODEL, "messages": MESSAGES, "max_tokens": 4, **fields}, timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert fragment in error["message"] and error["param"] == param, error

"""Property-based fuzzing of the public APIs against a running tiny-model cluster.

Through gRPC Generate: random prompts (text with any unicode, token ids in and out of the vocabulary, chat
messages with tool calls, tools, template variables), random sampling parameters (valid and invalid values of every
field, n / best_of / beam search combinations, stop strings) and random cancellations. Every call must end with a
clean stream or with INVALID_ARGUMENT / RESOURCE_EXHAUSTED and a message, never UNKNOWN or INTERNAL. Through the
OpenAI front: random chat and completions bodies (tools, tool choices, tool messages, template variables,
reasoning, streams), answered 200 or a 4xx, never a 5xx. The services stay up, and afterwards every KV block is
free and the queue counters are back to zero.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmserve.client import GenerationClient
from llmserve.local_cluster import ClusterSpec, LocalCluster
from protos import common_pb2, generation_pb2
from scheduler_service import keys
from tests.e2e.cluster_checks import assert_all_blocks_free
from tests.hypothesis_profiles import examples

MAX_MODEL_LEN = 256
VOCAB = 49152  # the tiny model shares the default model's tokenizer
ALLOWED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir: Path) -> Iterator[LocalCluster]:
    spec = ClusterSpec(
        model=str(tiny_llama_dir),
        worker_args=["--num-gpu-blocks-override", "128", "--max-model-len", str(MAX_MODEL_LEN), "--num-threads", "1"],
        scheduler_args=["--max-num-seqs", "8", "--max-num-queued-requests", "16"],
        # The HTTP front with every reader of generated text, so their paths are fuzzed too.
        http_port=0, http_args=["--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                                "--reasoning-parser", "deepseek_r1"],
    )
    with LocalCluster(spec) as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster: LocalCluster) -> Iterator[GenerationClient]:
    with GenerationClient(cluster.address) as c:
        yield c


def _floats(*special: float, lo: float = -3.0, hi: float = 3.0) -> st.SearchStrategy[float]:
    return st.one_of(st.sampled_from([*special, math.nan, math.inf, -math.inf]),
                     st.floats(lo, hi, width=32))


def _maybe(strategy: st.SearchStrategy[object]) -> st.SearchStrategy[object]:
    return st.one_of(st.none(), strategy)


_token_id = st.one_of(st.integers(0, VOCAB - 1), st.integers(VOCAB, VOCAB + 100), st.integers(0, 2**32 - 1))

SAMPLING = st.fixed_dictionaries({}, optional={
    "max_tokens": st.one_of(st.integers(1, 8), st.sampled_from([MAX_MODEL_LEN, 10**6, 2**32 - 1])),
    "temperature": _floats(0.0, 0.7, 1.0, -1.0, lo=0.0),
    "top_p": _floats(1.0, 0.0, 0.9, 1.5),
    "top_k": st.sampled_from([-1, 0, 1, 5, 50, -3, 10**6]),
    "seed": st.integers(0, 2**64 - 1),
    "stop": st.lists(st.text(max_size=4), max_size=3),
    "stop_token_ids": st.lists(_token_id, max_size=3),
    "ignore_eos": st.booleans(),
    "n": st.integers(0, 5),
    "best_of": st.integers(0, 10),
    "logprobs": st.integers(0, 25),
    "use_beam_search": st.booleans(),
    "length_penalty": _floats(1.0, 0.0),
    "early_stopping": st.sampled_from([0, 1, 2]),
    "min_p": _floats(0.0, 0.1, 1.5),
    "presence_penalty": _floats(0.0, 2.5),
    "frequency_penalty": _floats(0.0, -2.5),
    "repetition_penalty": _floats(1.0, 0.0, 1.3),
    "min_tokens": st.integers(0, 12),
    "prompt_logprobs": st.integers(0, 25),
    "include_stop_str_in_output": st.booleans(),
    "skip_special_tokens": st.booleans(),
})

# Tool calls, tool results, tools and variables for the chat template: names and ids of any text, arguments,
# parameters and variables that are JSON objects, other JSON, or not JSON at all.
_JSON_TEXT = st.one_of(st.text(max_size=10), st.sampled_from(['{}', '{"city": "Paris"}', '[1]', 'null',
                                                              '{"type": "object"}', '{"type": "objekt"}']))
_TOOL_CALL = st.builds(generation_pb2.ToolCall, id=st.text(max_size=5), name=st.text(max_size=8), arguments=_JSON_TEXT)
_TOOL_MESSAGE = st.builds(generation_pb2.ChatMessage, role=st.sampled_from(["user", "assistant", "tool", "system"]),
                          content=st.text(max_size=20), tool_call_id=st.sampled_from(["", "call-1"]),
                          tool_calls=st.lists(_TOOL_CALL, max_size=2))
_TOOL = st.builds(generation_pb2.Tool, name=st.text(max_size=8), description=st.text(max_size=10),
                  parameters=st.one_of(st.just(""), _JSON_TEXT))

PROMPT = st.one_of(
    st.fixed_dictionaries({"prompt": st.text(max_size=60)}),
    st.fixed_dictionaries({"prompt_token_ids": st.lists(_token_id, max_size=8)}),
    st.fixed_dictionaries({"prompt_token_ids": st.lists(st.integers(0, VOCAB - 1), min_size=200, max_size=300)}),
    st.fixed_dictionaries({"messages": st.lists(
        st.tuples(st.sampled_from(["system", "user", "assistant", "robot", ""]), st.text(max_size=20)), max_size=3)}),
    st.fixed_dictionaries({"messages": st.lists(_TOOL_MESSAGE, max_size=3), "tools": st.lists(_TOOL, max_size=2),
                           "template_kwargs": st.one_of(_JSON_TEXT, st.sampled_from(
                               ['{"tokenize": true}', '{"enable_thinking": false}', '{"documents": [1]}']))}),
    st.fixed_dictionaries({"prompt": st.text(min_size=1, max_size=10),
                           "prompt_token_ids": st.lists(st.integers(0, 100), min_size=1, max_size=3)}),
)

_ids = itertools.count()


def _request(prompt: dict, sampling: dict, request_id: str | None) -> generation_pb2.GenerateRequest:
    # A unique suffix: ids of cancelled requests may still be live when the next example runs.
    rid = "" if request_id is None else f"{request_id}-{next(_ids)}"
    return generation_pb2.GenerateRequest(
        request_id=rid,
        prompt=prompt.get("prompt", ""),
        prompt_token_ids=prompt.get("prompt_token_ids", []),
        messages=[m if isinstance(m, generation_pb2.ChatMessage)
                  else generation_pb2.ChatMessage(role=m[0], content=m[1]) for m in prompt.get("messages", [])],
        chat_options=generation_pb2.ChatOptions(tools=prompt["tools"], template_kwargs=prompt["template_kwargs"])
        if "tools" in prompt else None,
        sampling=common_pb2.SamplingParams(**sampling),
    )


# The same 60 examples on every `make test` (tests/hypothesis_profiles.py); `make fuzz` draws new ones.
@settings(max_examples=examples(60), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(prompt=PROMPT, sampling=SAMPLING, request_id=_maybe(st.text(max_size=300)),
       cancel_after=_maybe(st.integers(0, 3)))
def test_generate_never_crashes(cluster: LocalCluster, client: GenerationClient, prompt: dict, sampling: dict,
                                request_id: str | None, cancel_after: int | None) -> None:
    request = _request(prompt, sampling, request_id)
    stream = client.stream(request, timeout=60)
    received = 0
    try:
        for msg in stream:
            assert msg.error == "", msg.error  # a failure after admission means the engine choked on it
            received += 1
            if cancel_after is not None and received > cancel_after:
                stream.cancel()
                break
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.CANCELLED and cancel_after is not None:
            return
        assert exc.code() in ALLOWED, f"{exc.code()}: {exc.details()} for {request}"
        assert exc.details(), f"{exc.code()} without a message for {request}"
    cluster._check_alive()  # noqa: SLF001 - neither service may die


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (generation_pb2.GenerateRequest(), "the prompt is empty"),
        (generation_pb2.GenerateRequest(prompt_token_ids=[VOCAB]), f"outside the vocabulary (size {VOCAB})"),
        (generation_pb2.GenerateRequest(prompt_token_ids=[2**32 - 1]), "outside the vocabulary"),
        (generation_pb2.GenerateRequest(prompt="hi", sampling=common_pb2.SamplingParams(max_tokens=2**32 - 1)),
         "lower max_tokens or shorten the prompt"),
        (generation_pb2.GenerateRequest(prompt_token_ids=[5] * MAX_MODEL_LEN),
         f"maximum context length is {MAX_MODEL_LEN} tokens; shorten the prompt"),
        (generation_pb2.GenerateRequest(prompt="hi", request_id="x" * 257), "request_id must be at most 256"),
        (generation_pb2.GenerateRequest(prompt="hi", request_id="a\x00b"), "printable characters"),
        (generation_pb2.GenerateRequest(prompt="hi", sampling=common_pb2.SamplingParams(n=9, temperature=1.0)),
         "at most 8 (--max-num-seqs)"),
        (generation_pb2.GenerateRequest(prompt="hi", sampling=common_pb2.SamplingParams(temperature=math.nan)),
         "temperature"),
    ],
    ids=["empty", "id-past-vocab", "id-uint32-max", "huge-max-tokens", "prompt-too-long", "long-request-id",
         "unprintable-request-id", "n-above-max-num-seqs", "nan-temperature"],
)
def test_bad_input_gets_invalid_argument_with_its_message(client: GenerationClient, bad: generation_pb2.GenerateRequest,
                                                         message: str) -> None:
    with pytest.raises(grpc.RpcError) as info:
        list(client.stream(bad, timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value
    assert message in info.value.details(), info.value.details()


def test_malformed_utf8_is_invalid_argument(cluster: LocalCluster) -> None:
    """A Python client cannot even build such a message; raw bytes on the wire are refused at parsing."""
    with pytest.raises(UnicodeEncodeError):
        generation_pb2.GenerateRequest(prompt="\ud800").SerializeToString()
    raw = bytes([0x12, 3, 0xFF, 0xFE, 0x41])  # field 2 (prompt), length 3, not UTF-8
    with grpc.insecure_channel(cluster.address) as channel:
        call = channel.unary_stream("/llmserve.v1.Generation/Generate", request_serializer=lambda b: b,
                                    response_deserializer=generation_pb2.GenerateResponse.FromString)
        with pytest.raises(grpc.RpcError) as info:
            list(call(raw, timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value
    assert "must be valid UTF-8" in info.value.details()


def test_a_message_over_the_size_limit_is_resource_exhausted(client: GenerationClient) -> None:
    with pytest.raises(grpc.RpcError) as info:
        list(client.stream(generation_pb2.GenerateRequest(prompt="a" * (17 * 1024 * 1024)), timeout=30))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value
    assert info.value.details()
    assert client.model_info().max_model_len == MAX_MODEL_LEN  # and the server is fine


# OpenAI chat bodies through the HTTP front: each field absent, valid, or of another type or range.
_ANY_JSON = st.recursive(st.none() | st.booleans() | st.integers(-3, 10**6) | st.text(max_size=8),
                         lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                     max_size=3), max_leaves=6)
_FUNCTION = st.fixed_dictionaries({"name": st.sampled_from(["get_weather", "f", ""])}, optional={
    "description": st.text(max_size=10),
    "parameters": st.one_of(st.just({"type": "object", "properties": {"city": {"type": "string"}}}),
                            st.just({"type": "objekt"}), _ANY_JSON)})
_HTTP_MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "tool", "system", "developer",
                                                                "robot"])}, optional={
    "content": st.one_of(st.text(max_size=20), st.none(), st.just([{"type": "text", "text": "hi"}]),
                         st.just([{"type": "image_url"}])),
    "tool_calls": st.lists(st.fixed_dictionaries({"id": st.text(max_size=4), "type": st.just("function"),
                                                  "function": st.fixed_dictionaries({
                                                      "name": st.text(max_size=6), "arguments": _JSON_TEXT})}),
                           max_size=2),
    "tool_call_id": st.text(max_size=4),
    "reasoning_content": st.text(max_size=10),
})
_WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
# Bodies the front takes, so the outputs' paths (tool calls, reasoning, logprobs, streams) run, not only validation.
_SERVED_CHAT_BODY = st.fixed_dictionaries({
    "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]),
                                                "content": st.text(min_size=1, max_size=20)}), min_size=1, max_size=2),
    "max_tokens": st.integers(1, 12),
}, optional={
    "temperature": st.sampled_from([0.8, 1.0]),  # n > 1 takes sampling
    "n": st.integers(1, 2),
    "stream": st.booleans(),
    "tools": st.just([_WEATHER_TOOL]),
    "tool_choice": st.sampled_from(["none", "auto", "required",
                                    {"type": "function", "function": {"name": "get_weather"}}]),
    "logprobs": st.just(True),
    "include_reasoning": st.booleans(),
    "return_tokens_as_token_ids": st.booleans(),
    "ignore_eos": st.booleans(),
    "chat_template_kwargs": st.just({"enable_thinking": False}),
})
_ANY_CHAT_BODY = st.fixed_dictionaries({"messages": st.lists(_HTTP_MESSAGE, max_size=3)}, optional={
    "max_tokens": st.integers(-1, 12),
    "temperature": st.sampled_from([0.0, 0.8, -1.0, 3.0]),
    "n": st.integers(0, 3),
    "stream": st.booleans(),
    "tools": st.lists(st.fixed_dictionaries({"type": st.sampled_from(["function", "retrieval"]),
                                             "function": _FUNCTION}), max_size=2),
    "tool_choice": st.one_of(st.sampled_from(["none", "auto", "required", "any"]),
                             st.just({"type": "function", "function": {"name": "get_weather"}}), _ANY_JSON),
    "parallel_tool_calls": st.booleans(),
    "response_format": st.sampled_from([{"type": "json_object"}, {"type": "text"}, {"type": "x"}]),
    "logprobs": st.booleans(),
    "top_logprobs": st.integers(-1, 25),
    "echo": st.booleans(),
    "continue_final_message": st.booleans(),
    "add_generation_prompt": st.booleans(),
    "chat_template_kwargs": st.one_of(st.just({"enable_thinking": False}), st.just({"tokenize": True}), _ANY_JSON),
    "documents": st.one_of(st.just([{"title": "A", "text": "alpha"}]), _ANY_JSON),
    "include_reasoning": st.booleans(),
    "return_tokens_as_token_ids": st.booleans(),
    "ignore_eos": st.booleans(),
})
CHAT_BODY = st.one_of(_SERVED_CHAT_BODY, _ANY_CHAT_BODY)


@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=CHAT_BODY)
def test_chat_completions_never_fail_on_the_server(cluster: LocalCluster, body: dict) -> None:
    """Any body is a response or a 4xx with OpenAI's error and a message, never a 5xx; a stream ends with [DONE]
    and carries no server error."""
    _assert_served_or_refused(httpx.post(f"{cluster.http_url}/v1/chat/completions", json=body, timeout=60), body)
    cluster._check_alive()  # noqa: SLF001 - no service may die


COMPLETION_BODY = st.fixed_dictionaries({"prompt": st.one_of(
    st.text(max_size=30), st.lists(_token_id, max_size=6), st.lists(st.text(max_size=8), max_size=3),
    st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=4), max_size=3), _ANY_JSON)}, optional={
    "max_tokens": st.integers(-1, 12),
    "temperature": st.sampled_from([0.0, 0.8, -1.0]),
    "n": st.integers(0, 3),
    "best_of": st.integers(0, 4),
    "stream": st.booleans(),
    "stream_options": st.one_of(st.just({"include_usage": True, "continuous_usage_stats": True}), _ANY_JSON),
    "logprobs": st.integers(-1, 25),
    "echo": st.booleans(),
    "prompt_logprobs": st.integers(-1, 25),
    "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=2)),
    "logit_bias": st.dictionaries(st.sampled_from(["5", "-1", "x", str(VOCAB)]), st.floats(-200, 200), max_size=2),
    "structured_outputs": st.one_of(st.just({"regex": "[ab]{1,4}"}), st.just({"choice": ["yes", "no"]}), _ANY_JSON),
    "return_token_ids": st.booleans(),
    "return_tokens_as_token_ids": st.booleans(),
    "ignore_eos": st.booleans(),
})


@settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=COMPLETION_BODY)
def test_completions_never_fail_on_the_server(cluster: LocalCluster, body: dict) -> None:
    """As chat's: a response or a 4xx with OpenAI's error, never a 5xx; a stream ends with [DONE], no server error."""
    _assert_served_or_refused(httpx.post(f"{cluster.http_url}/v1/completions", json=body, timeout=60), body)
    cluster._check_alive()  # noqa: SLF001 - no service may die


def _assert_served_or_refused(reply: httpx.Response, body: dict) -> None:
    assert reply.status_code < 500, f"{reply.status_code}: {reply.text} for {body}"
    if reply.status_code != 200:
        error = reply.json()["error"]
        assert error["message"] and error["type"] == "invalid_request_error", (error, body)
    elif body.get("stream"):
        events = [line[len("data: "):] for line in reply.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]", (reply.text, body)
        assert not any('"server_error"' in event for event in events), (reply.text, body)
    else:
        assert reply.json()["choices"], (reply.text, body)


def test_afterwards_every_block_is_free_and_the_queue_is_empty(cluster: LocalCluster,
                                                               client: GenerationClient) -> None:
    assert client.model_info().max_model_len == MAX_MODEL_LEN  # still serving
    assert_all_blocks_free(cluster)
    rds = redis.Redis.from_url(cluster.redis_url)
    queue = {k.decode(): int(v) for k, v in rds.hgetall(keys.queue(cluster.worker_address)).items()}
    rds.close()
    assert queue.get("requests", 0) == 0 and queue.get("tokens", 0) == 0, queue

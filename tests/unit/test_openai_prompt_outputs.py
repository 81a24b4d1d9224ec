"""What the HTTP front reports of a prompt, on scripted Generate streams (no engine): vLLM's prompt_logprobs,
OpenAI's echo, vLLM's return_token_ids, in whole responses and in streams."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx

from openai_api.logprobs import TokenNamer
from openai_api.routes import FrontState, build_app
from protos import common_pb2, generation_pb2

PROMPT = [5, 6, 7]


def _entry(logprob: float, rank: int, top: list[tuple[int, float]]) -> common_pb2.TokenLogprobs:
    return common_pb2.TokenLogprobs(logprob=logprob, rank=rank,
                                    top=[common_pb2.TokenLogprob(token_id=t, logprob=lp) for t, lp in top])


def _messages(request: generation_pb2.GenerateRequest) -> list[generation_pb2.GenerateResponse]:
    """Two tokens (20, 21) after PROMPT; the first message carries the prompt's ids and logprobs when asked."""
    first = generation_pb2.GenerateResponse(
        request_id=request.request_id, prompt_token_ids=PROMPT,
        outputs=[generation_pb2.CompletionDelta(index=0, text="a", token_ids=[20],
                                                logprobs=[_entry(-0.125, 0, [(20, -0.125)])])])
    if request.sampling.HasField("prompt_logprobs"):
        first.prompt_logprobs_start = 1
        first.prompt_logprobs.extend([_entry(-1.0, 3, [(9, -0.5), (8, -0.75)]), _entry(-0.25, 0, [(7, -0.25), (9, -2.0)])])
    last = generation_pb2.GenerateResponse(
        request_id=request.request_id,
        outputs=[generation_pb2.CompletionDelta(index=0, text="b", token_ids=[21], finish_reason=common_pb2.FINISH_REASON_LENGTH,
                                                logprobs=[_entry(-0.5, 0, [(21, -0.5)])])],
        usage=generation_pb2.Usage(prompt_tokens=3, completion_tokens=2))
    return [first, last]


class _Stream:
    def __init__(self, request: generation_pb2.GenerateRequest) -> None:
        self._messages = _messages(request)
        self.first = self._messages[0]

    async def __aiter__(self):  # noqa: ANN204
        for msg in self._messages:
            yield msg

    def cancel(self) -> None:
        pass


class _Engine:
    def __init__(self) -> None:
        self.requests: list[generation_pb2.GenerateRequest] = []

    async def open_all(self, requests: list, metadata: tuple = ()) -> list[_Stream]:
        self.requests += requests
        return [_Stream(r) for r in requests]

    async def detokenize(self, token_ids: list[int]) -> str:
        return "".join(f"<{t}>" for t in token_ids)


def _post(path: str, body: dict[str, Any]) -> tuple[Any, _Engine]:
    """The JSON body, or the list of a stream's chunks; and the engine, with the requests it got."""
    engine = _Engine()
    app = build_app(FrontState(engine, TokenNamer(), ["m"]))  # type: ignore[arg-type]

    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            return await client.post(path, json={"model": "m", **body})

    reply = asyncio.run(go())
    assert reply.status_code == 200, reply.text
    if not body.get("stream"):
        return reply.json(), engine
    events = [line.removeprefix("data: ") for line in reply.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]], engine


def _name(token_id: int) -> str:
    return f"token_id:{token_id}"


# vLLM's format: null for the first token, then the prompt token first and the most likely ones by rank.
EXPECTED_PROMPT_LOGPROBS = [
    None,
    {"6": {"logprob": -1.0, "rank": 3, "decoded_token": _name(6)},
     "9": {"logprob": -0.5, "rank": 1, "decoded_token": _name(9)},
     "8": {"logprob": -0.75, "rank": 2, "decoded_token": _name(8)}},
    # The engine sent no rank: the token's place among the top ones is its rank.
    {"7": {"logprob": -0.25, "rank": 1, "decoded_token": _name(7)},
     "9": {"logprob": -2.0, "rank": 2, "decoded_token": _name(9)}},
]


def test_completion_prompt_logprobs_and_token_ids() -> None:
    body, engine = _post("/v1/completions", {"prompt": "hi", "max_tokens": 2, "prompt_logprobs": 2,
                                             "return_token_ids": True})
    assert engine.requests[0].sampling.prompt_logprobs == 2
    (choice,) = body["choices"]
    assert choice["text"] == "ab" and choice["prompt_logprobs"] == EXPECTED_PROMPT_LOGPROBS
    assert (choice["token_ids"], choice["prompt_token_ids"]) == ([20, 21], PROMPT)


def test_completion_echo_puts_the_prompt_first_in_text_and_logprobs() -> None:
    body, engine = _post("/v1/completions", {"prompt": "hi", "max_tokens": 2, "echo": True, "logprobs": 1})
    # Echo with logprobs needs the prompt's: `logprobs` of them, as vLLM asks.
    assert engine.requests[0].sampling.prompt_logprobs == 1
    (choice,) = body["choices"]
    assert choice["text"] == "hiab" and choice["prompt_logprobs"] == EXPECTED_PROMPT_LOGPROBS
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == [_name(t) for t in [*PROMPT, 20, 21]]
    assert logprobs["token_logprobs"] == [None, -1.0, -0.25, -0.125, -0.5]
    # Each dict leads with the position's own token (6 at -1.0 is not among the top two), as OpenAI's and vLLM's.
    assert logprobs["top_logprobs"][0] is None
    assert list(logprobs["top_logprobs"][1].items()) == [(_name(6), -1.0), (_name(9), -0.5), (_name(8), -0.75)]
    assert logprobs["top_logprobs"][2] == {_name(7): -0.25, _name(9): -2.0}
    assert logprobs["text_offset"] == [0, 10, 20, 30, 41]
    assert "token_ids" not in choice and "prompt_token_ids" not in choice


def test_completion_echo_of_token_ids_is_their_text_and_needs_no_logprobs() -> None:
    body, engine = _post("/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "echo": True})
    assert not engine.requests[0].sampling.HasField("prompt_logprobs")
    (choice,) = body["choices"]
    assert choice["text"] == "<5><6><7>ab" and choice["logprobs"] is None and "prompt_logprobs" not in choice


def test_streamed_completion_reports_the_prompt_in_the_first_chunk() -> None:
    chunks, _ = _post("/v1/completions", {"prompt": "hi", "max_tokens": 2, "echo": True, "logprobs": 0,
                                          "prompt_logprobs": 2, "return_token_ids": True, "stream": True})
    first, second = (c["choices"][0] for c in chunks)
    assert first["text"] == "hia" and first["prompt_logprobs"] == EXPECTED_PROMPT_LOGPROBS
    assert (first["token_ids"], first["prompt_token_ids"]) == ([20], PROMPT)
    assert first["logprobs"]["token_logprobs"] == [None, -1.0, -0.25, -0.125]
    assert second["text"] == "b" and second["token_ids"] == [21] and second["logprobs"]["text_offset"] == [3]
    assert "prompt_logprobs" not in second and "prompt_token_ids" not in second


def test_chat_reports_the_prompt_at_the_top_level() -> None:
    request = {"messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 2, "return_token_ids": True}
    body, engine = _post("/v1/chat/completions", request)
    assert engine.requests[0].sampling.prompt_logprobs == 2
    assert body["prompt_logprobs"] == EXPECTED_PROMPT_LOGPROBS and body["prompt_token_ids"] == PROMPT
    assert body["choices"][0]["token_ids"] == [20, 21] and body["choices"][0]["message"]["content"] == "ab"
    role, *rest = _post("/v1/chat/completions", {**request, "stream": True})[0]
    # A stream sends them in its first chunk, the role's, as vLLM sends prompt_token_ids.
    assert role["prompt_logprobs"] == EXPECTED_PROMPT_LOGPROBS and role["prompt_token_ids"] == PROMPT
    assert [c["choices"][0]["token_ids"] for c in rest] == [[20], [21]]
    assert all("prompt_token_ids" not in c and "prompt_logprobs" not in c for c in rest)


def test_without_the_fields_responses_have_none_of_the_keys() -> None:
    body, _ = _post("/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert set(body["choices"][0]) == {"index", "text", "logprobs", "finish_reason", "stop_reason"}
    body, _ = _post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    assert "prompt_logprobs" not in body and "prompt_token_ids" not in body and "token_ids" not in body["choices"][0]


def test_continuous_usage_stats_gives_every_chunk_the_counts_so_far() -> None:
    # vLLM's stream option: the prompt's tokens from the first chunk, the generated ones as they come.
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks, _ = _post("/v1/completions", {"prompt": "hi", "max_tokens": 2, "stream": True, "stream_options": options})
    assert [c["usage"] for c in chunks] == [
        {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
        {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
        {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},  # the last, choices empty: the engine's count
    ]
    chunks, _ = _post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": True,
                                               "stream_options": options})
    assert [c["usage"]["completion_tokens"] for c in chunks] == [0, 1, 2, 2] and chunks[0]["usage"]["prompt_tokens"] == 3
    # Without it only the last chunk counts, as OpenAI's include_usage.
    chunks, _ = _post("/v1/completions", {"prompt": "hi", "max_tokens": 2, "stream": True,
                                          "stream_options": {"include_usage": True}})
    assert [c["usage"] is None for c in chunks] == [True, True, False]

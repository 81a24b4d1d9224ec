"""gRPC status -> HTTP status and OpenAI's error body, and the app's error responses (no engine needed)."""

from __future__ import annotations

import asyncio

import grpc
import httpx
import pytest

from openai_api.errors import from_grpc, model_not_found
from openai_api.logprobs import TokenNamer
from openai_api.routes import FrontState, build_app


@pytest.mark.parametrize(
    ("code", "status", "kind"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request_error"),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "rate_limit_error"),
        (grpc.StatusCode.UNAVAILABLE, 503, "service_unavailable_error"),
        (grpc.StatusCode.NOT_FOUND, 404, "invalid_request_error"),
        (grpc.StatusCode.DEADLINE_EXCEEDED, 504, "timeout_error"),
        (grpc.StatusCode.INTERNAL, 500, "server_error"),
        (grpc.StatusCode.UNKNOWN, 500, "server_error"),
    ],
)
def test_grpc_codes_map_to_http(code: grpc.StatusCode, status: int, kind: str) -> None:
    err = from_grpc(code, "details here")
    assert (err.status, err.type, err.code) == (status, kind, code.name.lower())
    assert err.body() == {"error": {"message": "details here", "type": kind, "param": None, "code": code.name.lower()}}


def test_model_not_found_is_openais_404() -> None:
    err = model_not_found("gpt-9")
    assert err.status == 404 and err.body()["error"]["code"] == "model_not_found" and "gpt-9" in err.message


class _NoEngine:
    """Routes that fail before reaching the engine never call it."""

    async def open_all(self, requests: list) -> list:
        raise AssertionError("the engine must not be called")

    async def healthy(self) -> bool:
        return False


def _post(path: str, body: object) -> httpx.Response:
    app = build_app(FrontState(_NoEngine(), TokenNamer(), ["m"]))  # type: ignore[arg-type]

    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            return await client.post(path, json=body)

    return asyncio.run(go())


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/v1/completions", {"model": "m"}, 400, "prompt"),  # missing field: 400, not FastAPI's 422
        ("/v1/completions", {"model": "m", "prompt": "hi", "n": "two"}, 400, "n"),
        ("/v1/completions", {"model": "m", "prompt": "hi", "suffix": "x"}, 400, "suffix"),
        # Inside stream_options as at the top: refused by name, not ignored.
        ("/v1/completions", {"model": "m", "prompt": "hi", "stream": True, "stream_options": {"include_usge": True}}, 400,
         "stream_options.include_usge"),
        ("/v1/chat/completions", {"model": "m", "messages": "hi"}, 400, "messages"),
        ("/v1/chat/completions", {"model": "other", "messages": []}, 404, "model"),
        # A parameter the front does not serve is refused by name, never ignored.
        ("/v1/completions", {"model": "m", "prompt": "hi", "guided_whitespace_pattern": " *"}, 400,
         "guided_whitespace_pattern"),
        ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}], "priority": 1}, 400,
         "priority"),
        ("/v1/chat/completions", {"model": "m", "messages": []}, 400, "messages"),
        # Integers past their protobuf field: a 400 naming the parameter, never a 500.
        ("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 2**32}, 400, "max_tokens"),
        ("/v1/completions", {"model": "m", "prompt": "hi", "top_k": 2**31}, 400, "top_k"),
        ("/v1/completions", {"model": "m", "prompt": "hi", "n": 2**40}, 400, "n"),
        ("/v1/completions", {"model": "m", "prompt": "hi", "logprobs": 2**32}, 400, "logprobs"),
        ("/v1/completions", {"model": "m", "prompt": [1, 2**32]}, 400, "prompt"),
        ("/v1/completions", {"model": "m", "prompt": "hi", "stop_token_ids": [2**33]}, 400, "stop_token_ids"),
        ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                 "max_completion_tokens": 2**32}, 400,
         "max_completion_tokens"),
    ],
)
def test_app_errors_use_openais_format(path: str, body: dict, status: int, param: str) -> None:
    reply = _post(path, body)
    assert reply.status_code == status
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param


@pytest.mark.parametrize(
    ("path", "body", "param", "message"),
    [
        ("/v1/completions", {"model": "m", "prompt": ["hi", [1, 2]]}, "prompt",
         "prompt must be str or list[str] or list[int] or list[list[int]]"),
        ("/v1/completions", {"model": "m", "prompt": 3}, "prompt",
         "prompt must be str or list[str] or list[int] or list[list[int]]"),
        ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": 5}]}, "messages[0].content",
         "messages[0].content must be str or list[ContentPart]"),
        ("/v1/chat/completions", {"model": "m", "messages": [{"content": "hi"}]}, "messages[0].role",
         "messages[0].role: Field required"),
        ("/v1/completions", [1, 2], None, "the request body must be a JSON object"),
    ],
)
def test_a_malformed_field_is_named_as_the_request_writes_it(path: str, body: object, param: str | None,
                                                             message: str) -> None:
    reply = _post(path, body)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert (error["param"], error["message"]) == (param, message), error


def test_a_body_that_is_not_json_is_a_400_that_says_so() -> None:
    app = build_app(FrontState(_NoEngine(), TokenNamer(), ["m"]))  # type: ignore[arg-type]

    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            return await client.post("/v1/completions", content=b'{"model": "m", prompt}',
                                     headers={"content-type": "application/json"})

    reply = asyncio.run(go())
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] is None, error  # a character offset is no parameter
    assert error["message"].startswith("the request body is not valid JSON: Expecting property name"), error
    assert error["message"].endswith("(at character 15)"), error


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", '{"model": "m", "prompt": "hi \\ud800 there"}', "prompt"),
        ("/v1/completions", '{"model": "m", "prompt": ["ok", "\\udfff"]}', "prompt[1]"),
        ("/v1/completions", '{"model": "m", "prompt": "hi", "stop": ["\\ud800"]}', "stop[0]"),
        ("/v1/completions", '{"model": "m", "prompt": "hi", "logit_bias": {"\\ud800": 1}}', "logit_bias.\\ud800"),
        ("/v1/chat/completions", '{"model": "m", "messages": [{"role": "user", "content": "\\udfff"}]}',
         "messages[0].content"),
        ("/v1/chat/completions",
         '{"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "a\\ud800"}]}]}',
         "messages[0].content[0].text"),
    ],
)
def test_text_that_is_not_valid_unicode_is_a_400_naming_it(path: str, body: str, param: str) -> None:
    # JSON can escape a lone surrogate; no UTF-8 (the tokenizer's, protobuf's) can carry it: it was a 500.
    app = build_app(FrontState(_NoEngine(), TokenNamer(), ["m"]))  # type: ignore[arg-type]

    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            return await client.post(path, content=body.encode(), headers={"content-type": "application/json"})

    reply = asyncio.run(go())
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param, error
    assert error["message"].startswith(f"{param} is not valid Unicode: it holds a lone surrogate (\\u"), error


def test_health_is_503_when_the_scheduler_is_not_serving() -> None:
    app = build_app(FrontState(_NoEngine(), TokenNamer(), ["m"]))  # type: ignore[arg-type]

    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            return await client.get("/health")

    assert asyncio.run(go()).status_code == 503


def test_an_error_mid_stream_is_an_error_event_then_done() -> None:
    from openai_api.errors import OpenAIError
    from openai_api.streaming import DONE, sse_stream

    async def chunks():
        yield {"n": 1}
        raise OpenAIError(503, "scheduler went away", "service_unavailable_error")

    async def go() -> list[str]:
        return [event async for event in sse_stream(chunks())]

    events = asyncio.run(go())
    assert events[0] == 'data: {"n":1}\n\n' and events[-1] == DONE
    assert '"message":"scheduler went away"' in events[1] and events[1].startswith('data: {"error":')


@pytest.mark.parametrize("declared", [True, False])
def test_a_body_over_the_limit_is_413(declared: bool) -> None:
    from shared.grpc_server import PUBLIC_MAX_REQUEST_BYTES

    app = build_app(FrontState(_NoEngine(), TokenNamer(), ["m"]))  # type: ignore[arg-type]
    body = b'{"model": "m", "prompt": "' + b"x" * PUBLIC_MAX_REQUEST_BYTES + b'"}'

    async def chunks():  # no Content-Length: the body is counted as it arrives
        for i in range(0, len(body), 1 << 20):
            yield body[i : i + (1 << 20)]

    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            return await client.post("/v1/completions", content=body if declared else chunks(),
                                     headers={"content-type": "application/json"})

    reply = asyncio.run(go())
    assert reply.status_code == 413
    assert reply.json()["error"]["type"] == "invalid_request_error" and "larger than" in reply.json()["error"]["message"]

"""The HTTP front's request headers: X-Request-Id names the request and comes back, traceparent reaches the
scheduler's Generate call (so the caller's trace continues there)."""

from __future__ import annotations

import asyncio

import httpx

from openai_api.logprobs import TokenNamer
from openai_api.routes import FrontState, build_app
from protos import common_pb2, generation_pb2

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


class _Stream:
    """One finished sequence of a single token."""

    def __init__(self, request_id: str) -> None:
        self._msg = generation_pb2.GenerateResponse(
            request_id=request_id,
            outputs=[generation_pb2.CompletionDelta(index=0, text="x", token_ids=[7],
                                                    finish_reason=common_pb2.FINISH_REASON_LENGTH)],
            usage=generation_pb2.Usage(prompt_tokens=1, completion_tokens=1))
        self.first = self._msg

    async def __aiter__(self):  # noqa: ANN204
        yield self._msg

    def cancel(self) -> None:
        pass


class _RecordingEngine:
    def __init__(self) -> None:
        self.calls: list[tuple[list[str], tuple[tuple[str, str], ...]]] = []

    async def open_all(self, requests: list, metadata: tuple = ()) -> list[_Stream]:
        self.calls.append(([r.request_id for r in requests], metadata))
        return [_Stream(r.request_id) for r in requests]


def _post(path: str, body: dict, headers: dict[str, str]) -> tuple[httpx.Response, _RecordingEngine]:
    engine = _RecordingEngine()
    app = build_app(FrontState(engine, TokenNamer(), ["m"]))  # type: ignore[arg-type]

    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            return await client.post(path, json=body, headers=headers)

    return asyncio.run(go()), engine


def test_x_request_id_names_the_request_and_comes_back() -> None:
    reply, engine = _post("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 1},
                          {"X-Request-Id": "abc-123", "traceparent": TRACEPARENT})
    assert reply.status_code == 200, reply.text
    assert reply.headers["x-request-id"] == "abc-123"
    assert reply.json()["id"] == "cmpl-abc-123"
    ((request_ids, metadata),) = engine.calls
    assert request_ids == ["cmpl-abc-123"]
    assert metadata == (("traceparent", TRACEPARENT),)


def test_a_batch_and_a_chat_carry_the_id_too() -> None:
    reply, engine = _post("/v1/completions", {"model": "m", "prompt": ["a", "b"], "max_tokens": 1},
                          {"X-Request-Id": "batch"})
    assert reply.status_code == 200 and reply.headers["x-request-id"] == "batch"
    assert engine.calls[0] == (["cmpl-batch-0", "cmpl-batch-1"], ())
    reply, engine = _post("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
                          {"X-Request-Id": "chat"})
    assert reply.status_code == 200 and reply.json()["id"] == "chatcmpl-chat"


def test_errors_echo_the_id_and_requests_without_one_get_a_random_id() -> None:
    reply, _ = _post("/v1/completions", {"model": "m"}, {"X-Request-Id": "bad-1"})
    assert reply.status_code == 400 and reply.headers["x-request-id"] == "bad-1"
    reply, engine = _post("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 1}, {})
    assert "x-request-id" not in reply.headers
    ((request_ids, metadata),) = engine.calls
    assert request_ids[0].startswith("cmpl-") and len(request_ids[0]) > len("cmpl-") + 16 and metadata == ()


def test_metrics_count_requests_by_route_and_status_class() -> None:
    from prometheus_client.parser import text_string_to_metric_families

    engine = _RecordingEngine()
    app = build_app(FrontState(engine, TokenNamer(), ["m"]))  # type: ignore[arg-type]

    async def go() -> str:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            await client.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 1})
            await client.post("/v1/completions", json={"model": "m"})
            await client.get("/no/such/path")
            return (await client.get("/metrics")).text

    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(asyncio.run(go())) for s in family.samples}
    completions = (("handler", "/v1/completions"), ("method", "POST"))
    assert samples[("http_requests_total", (*completions, ("status", "2xx")))] == 1
    assert samples[("http_requests_total", (*completions, ("status", "4xx")))] == 1
    assert samples[("http_requests_total", (("handler", "none"), ("method", "GET"), ("status", "4xx")))] == 1
    assert samples[("http_request_duration_seconds_count", completions)] == 2

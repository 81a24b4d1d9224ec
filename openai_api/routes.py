"""The FastAPI application: routes, and every error rendered in OpenAI's format."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.routing import APIRoute
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from openai_api import chat, completions
from openai_api.choice_text import NO_PARSERS, OutputParsers, choice_reader
from openai_api.engine_client import EngineClient, GenerationStream
from openai_api.errors import OpenAIError, invalid_request, model_not_found
from openai_api.logprobs import ID_NAMER, TokenNamer
from openai_api.metrics_relay import relayed_exposition
from llmserve import __version__
from openai_api.protocol import (
    INVALID_UNICODE,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    OpenAIBaseModel,
    SamplingRequest,
    TokenizeRequest,
)
from openai_api.prompts import completion_prompts, prompt_info
from openai_api.request_mapping import (
    chat_request,
    completion_prompt_logprobs,
    completion_requests,
    detokenize_ids,
    tokenize_request,
)
from openai_api.streaming import MEDIA_TYPE, ChunkHeader, sse_stream
from openai_api.tools import constraint_error, tool_call_mode
from shared.grpc_server import PUBLIC_MAX_REQUEST_BYTES
from shared.metrics import FrontMetrics

log = logging.getLogger(__name__)

# How often a non-streaming request checks whether its client is still connected.
DISCONNECT_POLL_S = 0.5
REQUEST_ID_HEADER = "x-request-id"
# W3C trace context: an HTTP caller's trace continues into the scheduler's spans (gRPC metadata).
_TRACE_HEADERS = ("traceparent", "tracestate")


@dataclass
class FrontState:
    """What the routes need; built by the server at startup."""

    engine: EngineClient
    namer: TokenNamer
    model_names: list[str]
    model_root: str | None = None
    created: int = 0
    # The readers of generated text: the model's tool-call syntax for tool_choice "auto" (without one, "auto" is a
    # 400) and its reasoning (choice_text.py).
    parsers: OutputParsers = NO_PARSERS
    # Logprobs name tokens `token_id:<id>` unless a request says otherwise (--return-tokens-as-token-ids).
    tokens_as_ids: bool = False


def _state(request: Request) -> FrontState:
    return request.app.state.front


def _model_name(state: FrontState, req: SamplingRequest | TokenizeRequest | DetokenizeRequest) -> str:
    """The served name a request addresses (the first one when it names none); 404 for another model."""
    if req.model is None or req.model == "":
        return state.model_names[0]
    if req.model not in state.model_names:
        raise model_not_found(req.model)
    return req.model


def _namer(state: FrontState, req: SamplingRequest) -> TokenNamer:
    """How the response names tokens in logprobs: decoded, or `token_id:<id>` where the request asks (vLLM's
    return_tokens_as_token_ids: every token distinct, even those that decode to no whole character)."""
    as_ids = state.tokens_as_ids if req.return_tokens_as_token_ids is None else req.return_tokens_as_token_ids
    return ID_NAMER if as_ids else state.namer


def _reject_unknown(req: OpenAIBaseModel) -> None:
    """A field the front does not serve is a 400 naming it: ignoring it would answer a different request."""
    unknown = req.unknown_fields()
    stream_options = getattr(req, "stream_options", None)
    if stream_options is not None:
        unknown += [f"stream_options.{name}" for name in stream_options.unknown_fields()]
    if unknown:
        raise invalid_request(f"unsupported parameter(s): {', '.join(unknown)}", unknown[0])


async def _unless_disconnected(request: Request, work: Awaitable[dict[str, Any]]) -> dict[str, Any]:
    """Awaits `work`, cancelling it (which aborts its gRPC calls) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait([task], timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                raise OpenAIError(499, "the client disconnected", "invalid_request_error", None, "client_disconnected")
    finally:
        task.cancel()


async def _respond(
    request: Request,
    streams: list[GenerationStream],
    stream: bool,
    chunks: Callable[[], AsyncIterator[dict[str, Any]]],
    body: Callable[[], Awaitable[dict[str, Any]]],
) -> Response:
    def cancel_all() -> None:
        for s in streams:
            s.cancel()

    if stream:
        # The background task runs after the response ends, even when a disconnect cut it short.
        return StreamingResponse(sse_stream(chunks()), media_type=MEDIA_TYPE, background=BackgroundTask(cancel_all))
    try:
        return JSONResponse(await _unless_disconnected(request, body()))
    finally:
        cancel_all()


def _base_request_id(request: Request) -> str:
    """The caller's X-Request-Id (as vLLM's front), else a random id."""
    return request.headers.get(REQUEST_ID_HEADER) or uuid.uuid4().hex


def _trace_metadata(request: Request) -> tuple[tuple[str, str], ...]:
    return tuple((name, request.headers[name]) for name in _TRACE_HEADERS if name in request.headers)


def _header(request_id: str, model: str, obj: str, req: SamplingRequest) -> ChunkHeader:
    include_usage = bool(req.stream and req.stream_options and req.stream_options.include_usage)
    continuous = include_usage and req.stream_options.continuous_usage_stats  # type: ignore[union-attr]
    return ChunkHeader(request_id, int(time.time()), model, obj, include_usage, continuous)


async def create_completion(req: CompletionRequest, request: Request) -> Response:
    """POST /v1/completions."""
    state = _state(request)
    model = _model_name(state, req)
    _reject_unknown(req)
    request_id = f"cmpl-{_base_request_id(request)}"
    requests = completion_requests(req, request_id)
    streams = await state.engine.open_all(requests, _trace_metadata(request))
    try:
        prompts = await completion_prompts(requests, streams, completion_prompt_logprobs(req) is not None, req.echo,
                                           lambda token_ids: state.engine.detokenize(token_ids))
    except BaseException:
        for stream in streams:
            stream.cancel()
        raise
    obj = completions.OBJECT
    header = _header(request_id, model, obj, req)
    return await _respond(
        request, streams, req.stream,
        lambda: completions.completion_chunks(req, streams, prompts, header, _namer(state, req)),
        lambda: completions.completion_body(req, streams, prompts, header, _namer(state, req)),
    )


async def create_chat_completion(req: ChatCompletionRequest, request: Request) -> Response:
    """POST /v1/chat/completions."""
    state = _state(request)
    model = _model_name(state, req)
    _reject_unknown(req)
    request_id = f"chatcmpl-{_base_request_id(request)}"
    mode = tool_call_mode(req, state.parsers.tool_call_parser)
    generate = chat_request(req, request_id, mode)
    try:
        (stream,) = await state.engine.open_all([generate], _trace_metadata(request))
    except OpenAIError as exc:
        raise constraint_error(mode, exc) from None
    new_text = choice_reader(req, mode, generate, state.parsers.reasoning_parser)
    prompt = prompt_info(stream.first, req.prompt_logprobs is not None)
    obj = chat.CHUNK_OBJECT if req.stream else chat.OBJECT
    header = _header(request_id, model, obj, req)
    return await _respond(
        request, [stream], req.stream,
        lambda: chat.chat_chunks(req, stream, prompt, header, _namer(state, req), new_text),
        lambda: chat.chat_body(req, stream, prompt, header, _namer(state, req), new_text),
    )


async def list_models(request: Request) -> ModelList:
    """GET /v1/models: the served model names."""
    state = _state(request)
    max_len = await state.engine.max_model_len()
    return ModelList(data=[ModelCard(id=name, created=state.created, root=state.model_root, max_model_len=max_len)
                           for name in state.model_names])


async def tokenize(req: TokenizeRequest, request: Request) -> dict[str, Any]:
    """POST /tokenize (vLLM's): the tokens Generate would compute for a prompt or messages."""
    state = _state(request)
    _model_name(state, req)
    _reject_unknown(req)
    reply, max_len = await asyncio.gather(state.engine.tokenize(tokenize_request(req)), state.engine.max_model_len())
    return {"count": len(reply.token_ids), "max_model_len": max_len, "tokens": list(reply.token_ids),
            "token_strs": list(reply.tokens) if req.return_token_strs else None}


async def detokenize(req: DetokenizeRequest, request: Request) -> dict[str, Any]:
    """POST /detokenize (vLLM's): the text of token ids."""
    state = _state(request)
    _model_name(state, req)
    _reject_unknown(req)
    return {"prompt": await state.engine.detokenize(detokenize_ids(req))}


async def metrics(request: Request) -> Response:
    """GET /metrics: the front's Prometheus series, then the engine's from the --engine-metrics endpoints."""
    registry = request.app.state.front_metrics.registry
    sources: list[str] = getattr(request.app.state, "engine_metrics", [])
    body = await relayed_exposition(registry, sources) if sources else generate_latest(registry)
    return Response(body, media_type=CONTENT_TYPE_LATEST)


async def version() -> dict[str, str]:
    """GET /version."""
    return {"version": __version__}


async def health(request: Request) -> Response:
    """GET /health: 200 when the scheduler behind the front is SERVING, else 503."""
    if await _state(request).engine.healthy():
        return Response(status_code=200)
    return JSONResponse(OpenAIError(503, "the scheduler is not serving", "service_unavailable_error").body(), 503)


def _error_response(exc: OpenAIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


async def _openai_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, OpenAIError)
    return _error_response(exc)


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    """Malformed bodies are 400s, as OpenAI's (FastAPI's default would be a 422)."""
    assert isinstance(exc, RequestValidationError)
    first = exc.errors()[0] if exc.errors() else {}
    if first.get("type") == "json_invalid":  # its loc is ("body", character offset), not a parameter
        position = first.get("loc", ("body", "?"))[-1]
        detail = (first.get("ctx") or {}).get("error", first.get("msg", ""))
        return _error_response(invalid_request(f"the request body is not valid JSON: {detail} (at character {position})",
                                               None))
    if first.get("type") == INVALID_UNICODE:  # found by the top model: its loc is the body, ctx names the field
        return _error_response(invalid_request(str(first.get("msg")), (first.get("ctx") or {}).get("param")))
    loc = [p for p in first.get("loc", ()) if p != "body"]
    union = _union_branch(loc)
    if union is not None:  # each of the union's forms failed: say which forms it takes, not the first one's complaint
        forms = _union_forms(exc.errors(), loc[:union])
        param = _param_path(loc[:union])
        return _error_response(invalid_request(f"{param} must be {' or '.join(forms)}", param))
    param = _param_path(loc) or None
    message = f"{param}: {first.get('msg', 'invalid request')}" if param else str(first.get("msg", "invalid request"))
    if not loc and first.get("type") == "model_attributes_type":
        message = "the request body must be a JSON object"
    return _error_response(invalid_request(message, param))


def _param_path(loc: list) -> str:
    """A location as the request writes it: messages[0].content."""
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")


def _is_type_tag(part: object) -> bool:
    # Pydantic names a union's branch in the location by its type (str, list[int], ContentPart); the request
    # models' own fields are snake_case.
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool", "dict", "list")
                                      or part[:1].isupper())


def _union_branch(loc: list) -> int | None:
    return next((i for i, part in enumerate(loc) if i and _is_type_tag(part)), None)


def _union_forms(errors: list, prefix: list) -> list[str]:
    forms: list[str] = []
    for error in errors:
        loc = [p for p in error.get("loc", ()) if p != "body"]
        if loc[:len(prefix)] == prefix and len(loc) > len(prefix) and _is_type_tag(loc[len(prefix)]):
            if loc[len(prefix)] not in forms:
                forms.append(loc[len(prefix)])
    return forms


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
    return _error_response(OpenAIError(exc.status_code, str(exc.detail), kind))


async def _unexpected_error(request: Request, exc: Exception) -> JSONResponse:
    log.exception("internal error", exc_info=exc)
    return _error_response(OpenAIError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error"))


class BodyLimit:
    """ASGI middleware: a request body over `limit` bytes is a 413, declared (Content-Length) or streamed."""

    def __init__(self, app: Any, limit: int) -> None:
        self._app = app
        self._limit = limit

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self._app(scope, receive, send)
        message = f"the request body is larger than {self._limit} bytes"
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self._limit:
            return await _error_response(OpenAIError(413, message))(scope, receive, send)
        seen = 0

        async def limited() -> dict[str, Any]:
            nonlocal seen
            received = await receive()
            seen += len(received.get("body", b""))
            if seen > self._limit:
                # Raised where the route reads its body: rendered by _http_error like any HTTP error.
                raise StarletteHTTPException(413, message)
            return received

        await self._app(scope, limited, send)


class HttpMetrics:
    """ASGI middleware: counts each request and times it to its last byte (FrontMetrics), by route; paths that are
    no route count as `none`, so that probing clients cannot grow the series."""

    def __init__(self, app: Any, metrics: FrontMetrics, routes: frozenset[str]) -> None:
        self._app = app
        self._metrics = metrics
        self._routes = routes

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self._app(scope, receive, send)
        handler = scope["path"] if scope["path"] in self._routes else "none"
        method, started, status = scope["method"], time.perf_counter(), 500

        async def observing(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self._app(scope, receive, observing)
        finally:
            self._metrics.requests.labels(handler, method, f"{status // 100}xx").inc()
            self._metrics.duration.labels(handler, method).observe(time.perf_counter() - started)


class EchoRequestId:
    """ASGI middleware: every response carries the caller's X-Request-Id back (errors and streams included)."""

    def __init__(self, app: Any) -> None:
        self._app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        request_id = dict(scope.get("headers", ())).get(REQUEST_ID_HEADER.encode()) if scope["type"] == "http" else None
        if not request_id:
            return await self._app(scope, receive, send)

        async def echoing(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), (REQUEST_ID_HEADER.encode(), request_id)]}
            await send(message)

        await self._app(scope, receive, echoing)


def build_app(state: FrontState | None = None, lifespan: Any = None) -> FastAPI:
    """The application; `state` is set here or by the lifespan (app.state.front)."""
    app = FastAPI(title="llmserve OpenAI-compatible API", lifespan=lifespan)
    # The same limit as the public gRPC API's: what the front accepts, the scheduler takes.
    app.add_middleware(BodyLimit, limit=PUBLIC_MAX_REQUEST_BYTES)
    app.add_middleware(EchoRequestId)
    if state is not None:
        app.state.front = state
    app.add_api_route("/v1/completions", create_completion, methods=["POST"], response_model=None)
    app.add_api_route("/v1/chat/completions", create_chat_completion, methods=["POST"], response_model=None)
    app.add_api_route("/v1/models", list_models, methods=["GET"])
    app.add_api_route("/health", health, methods=["GET"], response_model=None)
    app.add_api_route("/tokenize", tokenize, methods=["POST"])
    app.add_api_route("/detokenize", detokenize, methods=["POST"])
    app.add_api_route("/version", version, methods=["GET"])
    app.add_api_route("/metrics", metrics, methods=["GET"], response_model=None)
    app.state.front_metrics = FrontMetrics()
    routes = frozenset(route.path for route in app.routes if isinstance(route, APIRoute))
    app.add_middleware(HttpMetrics, metrics=app.state.front_metrics, routes=routes)
    app.add_exception_handler(OpenAIError, _openai_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected_error)
    return app

"""Runs the OpenAI-compatible front with uvicorn (`llmserve openai`)."""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import uvicorn
from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from openai_api.auth import require_api_key
from openai_api.engine_client import EngineClient
from openai_api.logprobs import TokenNamer
from openai_api.routes import REQUEST_ID_HEADER, FrontState, build_app
from openai_api.choice_text import OutputParsers
from openai_api.reasoning import REASONING_PARSERS
from openai_api.tool_parsers import TOOL_CALL_PARSERS
from shared.tls import ClientTLS, ServerTLS, listen_socket
from shared.tokenizer_loading import load_tokenizer

log = logging.getLogger(__name__)


@dataclass
class FrontConfig:
    """scheduler: host:port of the public gRPC API (a replica or a load balancer in front of them).
    served_model_names: names clients put in `model`; the first is the default. Empty: the
        tokenizer directory's name, else "llmserve".
    tokenizer: checkpoint whose tokenizer names tokens in logprobs; empty: `token_id:<id>` names.
    scheduler_tls: verify the scheduler's certificate (TLS) instead of a plaintext channel.
    auth_token: bearer token the front sends to the scheduler (its --auth-token-file).
    api_key: when set, every /v1 request must carry `Authorization: Bearer <api_key>` (vLLM's --api-key).
    engine_metrics: Prometheus endpoints of the engine (the scheduler's and worker's --metrics-port) whose
        series /metrics serves after the front's own (openai_api/metrics_relay.py).
    drain_timeout_s: on SIGTERM the front stops accepting connections and lets the responses in flight finish
        for up to this long, then cuts them (their requests are aborted): a rolling update of the front ends no
        stream shorter than this.
    access_log: a line per HTTP request (uvicorn's access log), as vLLM's API server logs them.
    tool_call_parser: how the model writes tool calls (openai_api/tool_parsers.py), for tool_choice "auto";
        empty: "auto" with tools is a 400 (vLLM's --enable-auto-tool-choice --tool-call-parser).
    reasoning_parser: how a reasoning model marks its thinking (openai_api/reasoning.py): chat responses carry it
        apart from the content, as `reasoning` (vLLM's --reasoning-parser); empty: none is split off.
    return_tokens_as_token_ids: logprobs name tokens `token_id:<id>` unless a request's own
        return_tokens_as_token_ids says otherwise (vLLM's flag); without a tokenizer they always do.
    tls: serve HTTPS with this certificate (and, with its client CA, only to clients holding a certificate it
        signed); None: plain HTTP (TLS ended in front of it, or localhost).
    allowed_origins: origins whose browser pages may call the API (CORS; "*" for any); empty: no CORS headers,
        so browsers keep other origins' pages from reading the answers.
    """

    scheduler: str
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_names: list[str] = field(default_factory=list)
    tokenizer: str = ""
    scheduler_tls: ClientTLS | None = None
    auth_token: str = field(default="", repr=False)
    api_key: str = field(default="", repr=False)
    engine_metrics: list[str] = field(default_factory=list)
    drain_timeout_s: float = 30.0
    access_log: bool = True
    tool_call_parser: str = ""
    reasoning_parser: str = ""
    return_tokens_as_token_ids: bool = False
    tls: ServerTLS | None = None
    allowed_origins: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        for name, value, known in (("tool_call_parser", self.tool_call_parser, TOOL_CALL_PARSERS),
                                   ("reasoning_parser", self.reasoning_parser, REASONING_PARSERS)):
            if value and value not in known:
                raise ValueError(f"{name} must be one of {', '.join(known)}, got {value!r}")
        if not self.scheduler:
            raise ValueError("scheduler must be a host:port address, got ''")
        if not self.drain_timeout_s >= 0:
            raise ValueError(f"drain_timeout_s must be non-negative, got {self.drain_timeout_s}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        for url in self.engine_metrics:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"engine_metrics must be http(s) URLs, got {url!r}")
        if not self.served_model_names:
            name = Path(self.tokenizer.rstrip("/")).name.removesuffix(".gguf") if self.tokenizer else ""
            self.served_model_names = [name or "llmserve"]


def make_app(config: FrontConfig) -> FastAPI:
    """The app with a lifespan that connects to the scheduler (and loads the tokenizer) at startup."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        tokenizer = await asyncio.to_thread(load_tokenizer, config.tokenizer) if config.tokenizer else None
        engine = EngineClient(config.scheduler, config.scheduler_tls, config.auth_token)
        parsers = OutputParsers(config.tool_call_parser or None, config.reasoning_parser or None)
        app.state.front = FrontState(engine, TokenNamer(tokenizer), config.served_model_names,
                                     model_root=config.tokenizer or None, created=int(time.time()), parsers=parsers,
                                     tokens_as_ids=config.return_tokens_as_token_ids)
        log.info("OpenAI-compatible API for %s, backed by the scheduler at %s%s",
                 ", ".join(config.served_model_names), config.scheduler, _features(config))
        try:
            yield
        finally:
            await engine.close()

    app = build_app(lifespan=lifespan)
    app.state.engine_metrics = list(config.engine_metrics)
    if config.api_key:
        require_api_key(app, config.api_key)
    if config.allowed_origins:
        # Added last, so outermost: a browser's preflight (OPTIONS, no Authorization header) is answered here,
        # before the API key check would refuse it. Bearer keys, not cookies: no credentials mode.
        app.add_middleware(CORSMiddleware, allow_origins=config.allowed_origins, allow_methods=["GET", "POST"],
                           allow_headers=["*"], expose_headers=[REQUEST_ID_HEADER])
    return app


def _features(config: FrontConfig) -> str:
    """What the start-up line tells operators beyond the defaults: how generated text is read, HTTPS, CORS."""
    parts = [f"tool calls read as {config.tool_call_parser}" if config.tool_call_parser else "",
             f"reasoning read as {config.reasoning_parser}" if config.reasoning_parser else "",
             ("HTTPS with client certificates" if config.tls.mutual else "HTTPS") if config.tls else "",
             f"browser origins {', '.join(config.allowed_origins)}" if config.allowed_origins else ""]
    return "".join(f"; {part}" for part in parts if part)


def serve(config: FrontConfig, log_level: str = "info") -> None:
    """Serves until SIGINT / SIGTERM (uvicorn handles both); BindError when the port cannot be listened on."""
    sock = listen_socket(config.host, config.port, "OpenAI front", "--port (`llmserve up`: --http-port)")
    # log_config=None: uvicorn's loggers go to the root handler in the format every llmserve process logs in
    # (shared/logging_setup.py), not to handlers of uvicorn's own format.
    tls = config.tls
    server = uvicorn.Server(uvicorn.Config(make_app(config), host=config.host, port=config.port,
                                           log_level=log_level.lower(), log_config=None, access_log=config.access_log,
                                           timeout_graceful_shutdown=config.drain_timeout_s,
                                           ssl_certfile=tls.cert_file if tls else None,
                                           ssl_keyfile=tls.key_file if tls else None,
                                           ssl_ca_certs=tls.client_ca_file if tls and tls.mutual else None,
                                           ssl_cert_reqs=ssl.CERT_REQUIRED if tls and tls.mutual else ssl.CERT_NONE))
    server.run(sockets=[sock])

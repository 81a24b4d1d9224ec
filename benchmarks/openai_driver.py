"""Drives any OpenAI-compatible server through streaming `/v1/completions`, as a crowd of clients.

The same client measures llama.cpp's `llama-server` and llmserve's own HTTP front, so that neither
gets a better client than the other. Every request sends its prompt as token ids (no server-side
tokenization), greedy, `ignore_eos`, `max_tokens` = the request's output length, and streams;
arrivals as in benchmarks.arrivals.

A streamed chunk is not a token: llama-server sends nothing for a token that ends inside a UTF-8
character (its bytes go out with the next one), and a server may put several tokens in one chunk.
So every chunk's token count is read from what the server reports with it, and the totals are
checked when the stream ends:

    llama-server (`timings_per_token`)     chunk["timings"]["predicted_n"]: tokens generated so far
    vLLM-style servers (`logprobs: 0`)     chunk["choices"][i]["logprobs"]["tokens"]: this chunk's tokens

A request whose counted tokens differ from the usage the server reports, from `max_tokens`, or whose
reported prompt length differs from the ids sent, is recorded as failed with the reason.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from benchmarks.arrivals import send_all
from benchmarks.dataset import BenchRequest
from benchmarks.metrics import RequestTiming


@dataclass(frozen=True)
class OpenAITarget:
    """A server's base URL (http://host:port) and the request fields that make it report token counts."""

    base_url: str
    extra_body: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def llama_server(cls, base_url: str) -> OpenAITarget:
        return cls(base_url, {"timings_per_token": True})

    @classmethod
    def vllm_style(cls, base_url: str) -> OpenAITarget:
        """vLLM and llmserve's front: logprobs 0 lists each chunk's sampled tokens (no alternatives)."""
        return cls(base_url, {"logprobs": 0})


def completion_body(req: BenchRequest, target: OpenAITarget) -> dict[str, Any]:
    return {"prompt": req.prompt_token_ids, "max_tokens": req.output_len, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, **target.extra_body}


@dataclass
class StreamTally:
    """Tokens of one streamed completion, chunk by chunk, and what the server said they add up to."""

    tokens: int = 0
    # llama-server's running count as of the last chunk that carried one.
    predicted_n: int = 0
    usage_completion_tokens: int | None = None
    usage_prompt_tokens: int | None = None

    def add(self, chunk: dict[str, Any]) -> int:
        """The number of tokens this chunk brings; raises ValueError when it cannot be told."""
        if "error" in chunk:
            raise ValueError(f"server error in stream: {chunk['error']}")
        usage = chunk.get("usage")
        if usage:
            self.usage_completion_tokens = usage.get("completion_tokens")
            self.usage_prompt_tokens = usage.get("prompt_tokens")
        choices = chunk.get("choices") or []
        timings = chunk.get("timings")
        if timings and "predicted_n" in timings:
            new = int(timings["predicted_n"]) - self.predicted_n
            self.predicted_n = int(timings["predicted_n"])
        elif any(c.get("logprobs") for c in choices):
            new = sum(len(c["logprobs"].get("tokens") or []) for c in choices if c.get("logprobs"))
        elif any(c.get("text") for c in choices):
            raise ValueError("a chunk with text but no token count: ask the server for logprobs or timings")
        else:
            new = 0  # a usage-only or finish-only chunk
        if new < 0:
            raise ValueError(f"the server's token count went back ({timings})")
        self.tokens += new
        return new

    def check(self, req: BenchRequest) -> str:
        """Why this stream does not match the request ('' when it does)."""
        if self.usage_completion_tokens is None:
            return "the stream reported no usage"
        if self.tokens != self.usage_completion_tokens:
            return f"counted {self.tokens} streamed tokens, the server's usage says {self.usage_completion_tokens}"
        if self.tokens != req.output_len:
            return f"{self.tokens} tokens generated, {req.output_len} asked with ignore_eos"
        if self.usage_prompt_tokens is not None and self.usage_prompt_tokens != len(req.prompt_token_ids):
            return (f"the server counted {self.usage_prompt_tokens} prompt tokens for {len(req.prompt_token_ids)} "
                    "token ids sent (the prompt was not taken as ids)")
        return ""


def sse_data(line: str) -> str | None:
    """The payload of a server-sent-events `data:` line; None for other lines (blank, comments, event names)."""
    if not line.startswith("data:"):
        return None
    return line[len("data:"):].strip()


async def _one(client: httpx.AsyncClient, target: OpenAITarget, req: BenchRequest) -> RequestTiming:
    timing = RequestTiming(prompt_len=len(req.prompt_token_ids), sent=time.perf_counter())
    tally = StreamTally()
    try:
        async with client.stream("POST", f"{target.base_url}/v1/completions",
                                 json=completion_body(req, target)) as reply:
            if reply.status_code != 200:
                body = (await reply.aread()).decode(errors="replace")
                raise ValueError(f"HTTP {reply.status_code}: {body[:500]}")
            async for line in reply.aiter_lines():
                now = time.perf_counter()
                data = sse_data(line)
                if data is None:
                    continue
                if data == "[DONE]":
                    break
                timing.token_times.extend([now] * tally.add(json.loads(data)))
        timing.error = tally.check(req)
    except (ValueError, httpx.HTTPError) as exc:
        timing.error = f"{type(exc).__name__}: {exc}"
    timing.done = time.perf_counter()
    return timing


async def _run(target: OpenAITarget, requests: list[BenchRequest], rate: float, max_concurrency: int | None,
               seed: int, label: str) -> tuple[list[RequestTiming], float]:
    # One connection per request in flight, as many clients would open; no timeout on a long stream.
    pool = httpx.Limits(max_connections=len(requests), max_keepalive_connections=len(requests))
    async with httpx.AsyncClient(limits=pool, timeout=httpx.Timeout(3600.0)) as client:
        return await send_all(requests, lambda req: _one(client, target, req), rate, max_concurrency, seed, label)


def run_openai(target: OpenAITarget, requests: list[BenchRequest], rate: float = float("inf"),
               max_concurrency: int | None = None, seed: int = 0, label: str = "openai"
               ) -> tuple[list[RequestTiming], float]:
    """Per-request timings and the wall time from the first request sent to the last finished."""
    return asyncio.run(_run(target, requests, rate, max_concurrency, seed, label))

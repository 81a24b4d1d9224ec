"""/v1/completions: chunks of a streamed completion and the body of a whole one."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import AsyncIterator
from typing import Any

from openai_api.engine_client import GenerationStream
from openai_api.errors import failed_after_admission
from openai_api.logprobs import TokenNamer, completion_logprobs
from openai_api.outputs import collect, finish_reason, merge, stop_reason
from openai_api.protocol import CompletionRequest, Usage
from openai_api.streaming import ChunkHeader

OBJECT = "text_completion"


async def completion_chunks(
    req: CompletionRequest, streams: list[GenerationStream], header: ChunkHeader, namer: TokenNamer
) -> AsyncIterator[dict[str, Any]]:
    """One chunk per engine response with progress; a usage chunk last when include_usage is set."""
    usage = Usage()
    # Per choice: characters of text sent so far (logprobs' text_offset).
    offsets: dict[int, int] = defaultdict(int)
    async for prompt_index, msg in merge(streams):
        choices = []
        for delta in msg.outputs:
            index = prompt_index * req.n + delta.index
            reason = finish_reason(delta)
            if not (delta.text or delta.token_ids or reason):
                continue
            logprobs = None
            if req.logprobs is not None:
                logprobs = completion_logprobs(namer, list(delta.token_ids), list(delta.logprobs), offsets[index])
            offsets[index] += len(delta.text)
            choices.append({"index": index, "text": delta.text, "logprobs": logprobs, "finish_reason": reason,
                            "stop_reason": stop_reason(delta)})
        if choices:
            yield header.chunk(choices)
        if msg.error:
            raise failed_after_admission(msg.error)
        if msg.HasField("usage"):
            usage.add(msg.usage.prompt_tokens, msg.usage.completion_tokens)
    if header.include_usage:
        yield header.chunk([], usage.model_dump())


async def completion_body(
    req: CompletionRequest, streams: list[GenerationStream], header: ChunkHeader, namer: TokenNamer
) -> dict[str, Any]:
    """The whole response, once every sequence has finished."""
    out = await collect(streams, req.n)
    choices = []
    for index in sorted(out.choices):
        seq = out.choices[index]
        logprobs = completion_logprobs(namer, seq.token_ids, seq.logprobs, 0) if req.logprobs is not None else None
        choices.append({"index": index, "text": seq.text, "logprobs": logprobs, "finish_reason": seq.finish_reason,
                        "stop_reason": seq.stop_reason})
    return {"id": header.request_id, "object": OBJECT, "created": header.created, "model": header.model,
            "choices": choices, "usage": out.usage.model_dump()}

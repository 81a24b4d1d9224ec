"""/v1/chat/completions: chunks of a streamed chat completion and the body of a whole one."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from openai_api.engine_client import GenerationStream
from openai_api.errors import failed_after_admission
from openai_api.logprobs import TokenNamer, chat_logprobs
from openai_api.outputs import collect, finish_reason, merge, stop_reason
from openai_api.protocol import ChatCompletionRequest, Usage
from openai_api.streaming import ChunkHeader

OBJECT = "chat.completion"
CHUNK_OBJECT = "chat.completion.chunk"


async def chat_chunks(
    req: ChatCompletionRequest, stream: GenerationStream, header: ChunkHeader, namer: TokenNamer
) -> AsyncIterator[dict[str, Any]]:
    """A role chunk per choice, then one chunk per engine response with progress, then usage if asked."""
    yield header.chunk([
        {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        for i in range(req.n)
    ])
    usage = Usage()
    async for _, msg in merge([stream]):
        choices = []
        for delta in msg.outputs:
            reason = finish_reason(delta)
            if not (delta.text or delta.token_ids or reason):
                continue
            logprobs = chat_logprobs(namer, list(delta.token_ids), list(delta.logprobs)) if req.logprobs else None
            choices.append({"index": delta.index, "delta": {"content": delta.text} if delta.text else {},
                            "logprobs": logprobs, "finish_reason": reason, "stop_reason": stop_reason(delta)})
        if choices:
            yield header.chunk(choices)
        if msg.error:
            raise failed_after_admission(msg.error)
        if msg.HasField("usage"):
            usage.add(msg.usage.prompt_tokens, msg.usage.completion_tokens)
    if header.include_usage:
        yield header.chunk([], usage.model_dump())


async def chat_body(
    req: ChatCompletionRequest, stream: GenerationStream, header: ChunkHeader, namer: TokenNamer
) -> dict[str, Any]:
    """The whole response, once every sequence has finished."""
    out = await collect([stream], req.n)
    choices = []
    for index in sorted(out.choices):
        seq = out.choices[index]
        choices.append({
            "index": index,
            "message": {"role": "assistant", "content": seq.text},
            "logprobs": chat_logprobs(namer, seq.token_ids, seq.logprobs) if req.logprobs else None,
            "finish_reason": seq.finish_reason,
            "stop_reason": seq.stop_reason,
        })
    return {"id": header.request_id, "object": OBJECT, "created": header.created, "model": header.model,
            "choices": choices, "usage": out.usage.model_dump()}

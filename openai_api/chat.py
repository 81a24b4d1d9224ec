"""/v1/chat/completions: chunks of a streamed chat completion and the body of a whole one.

Each choice's text is read by choice_text.py: its reasoning split off (the front's reasoning parser) and its tool
calls read (a tool_choice that calls tools). Besides OpenAI's fields, vLLM's: the response carries
`prompt_logprobs` (when asked for) and `prompt_token_ids` (return_token_ids), a stream in its first chunk; each
choice (or chunk) carries its `token_ids` (return_token_ids); with `echo`, a final assistant message's text comes
first (a stream's second chunk).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

from openai_api.engine_client import GenerationStream
from openai_api.errors import failed_after_admission
from openai_api.logprobs import TokenNamer, chat_logprobs, prompt_logprobs
from llmserve.client import stop_reason_of
from openai_api.outputs import collect, finish_reason, merge
from openai_api.prompts import PromptInfo
from openai_api.protocol import ChatCompletionRequest, Usage
from openai_api.request_mapping import message_text
from openai_api.streaming import ChunkHeader
from openai_api.choice_text import ChoiceText

OBJECT = "chat.completion"
CHUNK_OBJECT = "chat.completion.chunk"


async def chat_chunks(
    req: ChatCompletionRequest, stream: GenerationStream, prompt: PromptInfo, header: ChunkHeader, namer: TokenNamer,
    new_text: Callable[[], ChoiceText],
) -> AsyncIterator[dict[str, Any]]:
    """A role chunk per choice, then one chunk per engine response with progress, then usage if asked."""
    header.count(len(prompt.token_ids), 0)
    yield header.chunk([
        {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        for i in range(req.n)
    ], extra=_prompt_fields(req, prompt, namer))
    if echoed := _echo(req):
        yield header.chunk([{"index": i, "delta": {"content": echoed}, "logprobs": None, "finish_reason": None}
                            for i in range(req.n)])
    usage = Usage()
    texts: dict[int, ChoiceText] = {}
    async for _, msg in merge([stream]):
        choices = []
        for delta in msg.outputs:
            reason = finish_reason(delta)
            if not (delta.text or delta.token_ids or reason):
                continue
            header.count(0, len(delta.token_ids))
            logprobs = chat_logprobs(namer, list(delta.token_ids), list(delta.logprobs)) if req.logprobs else None
            if (text := texts.get(delta.index)) is None:
                text = texts[delta.index] = new_text()
            message = text.delta(delta.text, final=reason is not None)
            reason = text.finish_reason(reason)
            if not (text.plain or message or reason or req.logprobs or req.return_token_ids):
                continue  # text held back (a call, a tag not yet whole): its tokens count in the next chunk
            choice = {"index": delta.index, "delta": message,
                      "logprobs": logprobs, "finish_reason": reason, "stop_reason": stop_reason_of(delta)}
            if req.return_token_ids:
                choice["token_ids"] = list(delta.token_ids)
            choices.append(choice)
        if choices:
            yield header.chunk(choices)
        if msg.error:
            raise failed_after_admission(msg.error)
        if msg.HasField("usage"):
            usage.add(msg.usage.prompt_tokens, msg.usage.completion_tokens)
    if header.include_usage:
        yield header.chunk([], usage.model_dump())


async def chat_body(
    req: ChatCompletionRequest, stream: GenerationStream, prompt: PromptInfo, header: ChunkHeader, namer: TokenNamer,
    new_text: Callable[[], ChoiceText],
) -> dict[str, Any]:
    """The whole response, once every sequence has finished."""
    out = await collect([stream], req.n)
    choices = []
    for index in sorted(out.choices):
        seq = out.choices[index]
        text = new_text()
        message = {"role": "assistant", **text.message(seq.text)}
        reason = text.finish_reason(seq.finish_reason)
        if echoed := _echo(req):
            message["content"] = echoed + (message["content"] or "")
        choice = {
            "index": index,
            "message": message,
            "logprobs": chat_logprobs(namer, seq.token_ids, seq.logprobs) if req.logprobs else None,
            "finish_reason": reason,
            "stop_reason": seq.stop_reason,
        }
        if req.return_token_ids:
            choice["token_ids"] = seq.token_ids
        choices.append(choice)
    return {"id": header.request_id, "object": OBJECT, "created": header.created, "model": header.model,
            "choices": choices, "usage": out.usage.model_dump(), **_prompt_fields(req, prompt, namer)}


def _echo(req: ChatCompletionRequest) -> str:
    """vLLM's chat echo: the last message's text, when it is the assistant's (the answer the model continues)."""
    if not req.echo or req.messages[-1].role != "assistant":
        return ""
    return message_text(req.messages[-1], len(req.messages) - 1)


def _prompt_fields(req: ChatCompletionRequest, prompt: PromptInfo, namer: TokenNamer) -> dict[str, Any]:
    """What the response (or the stream's first chunk) reports of the rendered prompt, at its top level."""
    fields: dict[str, Any] = {}
    if prompt.logprobs is not None:
        fields["prompt_logprobs"] = prompt_logprobs(namer, prompt.token_ids, prompt.logprobs)
    if req.return_token_ids:
        fields["prompt_token_ids"] = prompt.token_ids
    return fields

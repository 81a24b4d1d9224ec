"""/v1/completions: chunks of a streamed completion and the body of a whole one.

Besides OpenAI's fields a choice carries vLLM's: `prompt_logprobs` (when asked for), `token_ids` and
`prompt_token_ids` (return_token_ids); with `echo` its text (and its logprobs) start with the prompt's.
A stream sends what a choice reports of its prompt in the choice's first chunk.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import AsyncIterator
from typing import Any

from openai_api.engine_client import GenerationStream
from openai_api.errors import failed_after_admission
from openai_api.logprobs import TokenNamer, completion_logprobs, prompt_logprobs
from llmserve.client import stop_reason_of
from openai_api.outputs import collect, finish_reason, merge
from openai_api.prompts import PromptInfo
from openai_api.protocol import CompletionRequest, Usage
from openai_api.streaming import ChunkHeader
from protos import common_pb2

OBJECT = "text_completion"


async def completion_chunks(
    req: CompletionRequest, streams: list[GenerationStream], prompts: list[PromptInfo], header: ChunkHeader,
    namer: TokenNamer,
) -> AsyncIterator[dict[str, Any]]:
    """One chunk per engine response with progress; a usage chunk last when include_usage is set."""
    usage = Usage()
    header.count(sum(len(prompt.token_ids) for prompt in prompts), 0)
    # Per choice: characters of text sent so far (logprobs' text_offset); a choice in it has had its first chunk.
    offsets: dict[int, int] = defaultdict(int)
    async for prompt_index, msg in merge(streams):
        choices = []
        for delta in msg.outputs:
            index = prompt_index * req.n + delta.index
            reason = finish_reason(delta)
            if not (delta.text or delta.token_ids or reason):
                continue
            header.count(0, len(delta.token_ids))
            prompt = None if index in offsets else prompts[prompt_index]
            choice = _choice(req, namer, index, prompt, delta.text, list(delta.token_ids), list(delta.logprobs),
                             offsets[index])
            offsets[index] += len(choice["text"])
            choices.append({**choice, "finish_reason": reason, "stop_reason": stop_reason_of(delta)})
        if choices:
            yield header.chunk(choices)
        if msg.error:
            raise failed_after_admission(msg.error)
        if msg.HasField("usage"):
            usage.add(msg.usage.prompt_tokens, msg.usage.completion_tokens)
    if header.include_usage:
        yield header.chunk([], usage.model_dump())


async def completion_body(
    req: CompletionRequest, streams: list[GenerationStream], prompts: list[PromptInfo], header: ChunkHeader,
    namer: TokenNamer,
) -> dict[str, Any]:
    """The whole response, once every sequence has finished."""
    out = await collect(streams, req.n)
    choices = []
    for index in sorted(out.choices):
        seq = out.choices[index]
        choice = _choice(req, namer, index, prompts[index // req.n], seq.text, seq.token_ids, seq.logprobs, 0)
        choices.append({**choice, "finish_reason": seq.finish_reason, "stop_reason": seq.stop_reason})
    return {"id": header.request_id, "object": OBJECT, "created": header.created, "model": header.model,
            "choices": choices, "usage": out.usage.model_dump()}


def _choice(
    req: CompletionRequest, namer: TokenNamer, index: int, prompt: PromptInfo | None, text: str,
    token_ids: list[int], entries: list[common_pb2.TokenLogprobs], text_offset: int,
) -> dict[str, Any]:
    """A choice's text, logprobs and vLLM's extras for generated `token_ids`; `prompt` is set for the first chunk
    of a choice (or a whole one) and brings what the choice reports of its prompt."""
    ids: list[int] = token_ids
    logprob_entries: list[common_pb2.TokenLogprobs | None] = list(entries)
    if prompt is not None and req.echo:
        # OpenAI's echo: the prompt's text and tokens come first, its first token with null logprobs.
        text = prompt.text + text
        ids = prompt.token_ids + token_ids
        logprob_entries = prompt.echoed_logprobs() + logprob_entries
    choice: dict[str, Any] = {"index": index, "text": text, "logprobs": None}
    if req.logprobs is not None:
        choice["logprobs"] = completion_logprobs(namer, ids, logprob_entries, text_offset)
    if prompt is not None and prompt.logprobs is not None:
        choice["prompt_logprobs"] = prompt_logprobs(namer, prompt.token_ids, prompt.logprobs)
    if req.return_token_ids:
        # The generated ids only, echo or not, as vLLM's.
        choice["token_ids"] = token_ids
        if prompt is not None:
            choice["prompt_token_ids"] = prompt.token_ids
    return choice

"""What a response reports of its prompt: token ids, prompt logprobs, and the text `echo` prepends.

The scheduler sends a prompt's token ids and its prompt logprobs in the first message of its Generate stream
(protos/generation.proto), which the front has read before it answers: both are known before any output.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from openai_api.engine_client import GenerationStream
from protos import common_pb2, generation_pb2


@dataclass
class PromptInfo:
    """One prompt of a request, as the model read it."""

    token_ids: list[int]
    # Per prompt token: its logprobs; None for the first token (nothing predicts it) and for leading tokens
    # the prefix cache served without computing them. None when the request asked for no prompt logprobs.
    logprobs: list[common_pb2.TokenLogprobs | None] | None = None
    # What `echo` prepends to a completion's text: the text prompt as given, or a token-id prompt decoded.
    text: str = ""

    def echoed_logprobs(self) -> list[common_pb2.TokenLogprobs | None]:
        """One entry per prompt token for echo's logprobs (all None where none were computed)."""
        return self.logprobs if self.logprobs is not None else [None] * len(self.token_ids)


def prompt_info(first: generation_pb2.GenerateResponse, with_logprobs: bool, text: str = "") -> PromptInfo:
    """The prompt of the stream whose first message is `first`; with_logprobs: the request asked for them."""
    token_ids = list(first.prompt_token_ids)
    if not with_logprobs:
        return PromptInfo(token_ids, None, text)
    logprobs: list[common_pb2.TokenLogprobs | None] = [None] * len(token_ids)
    for position, entry in enumerate(first.prompt_logprobs, first.prompt_logprobs_start):
        if position < len(token_ids):
            logprobs[position] = entry
    return PromptInfo(token_ids, logprobs, text)


async def completion_prompts(
    requests: list[generation_pb2.GenerateRequest], streams: list[GenerationStream], with_logprobs: bool,
    echo: bool, detokenize: Callable[[list[int]], Awaitable[str]],
) -> list[PromptInfo]:
    """The prompts of a completion batch, in order; echo's text of a token-id prompt is the scheduler's decoding
    of the ids the model read (the front may have no tokenizer)."""

    async def echo_text(request: generation_pb2.GenerateRequest, stream: GenerationStream) -> str:
        if not echo:
            return ""
        return request.prompt or await detokenize(list(stream.first.prompt_token_ids))

    texts = await asyncio.gather(*(echo_text(r, s) for r, s in zip(requests, streams)))
    return [prompt_info(s.first, with_logprobs, text) for s, text in zip(streams, texts)]

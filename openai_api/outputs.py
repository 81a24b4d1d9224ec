"""Generate streams -> OpenAI choices: merging a batch's streams and collecting whole outputs.

Choice indices follow vLLM: prompt i of a batch, sequence j of its n -> choice i * n + j.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from llmserve.client import stop_reason_of
from openai_api.engine_client import GenerationStream
from openai_api.errors import failed_after_admission
from openai_api.protocol import Usage
from protos import common_pb2, generation_pb2

_FINISH_REASONS = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",
    common_pb2.FINISH_REASON_ERROR: "error",
}


def finish_reason(delta: generation_pb2.CompletionDelta) -> str | None:
    """OpenAI's finish_reason of a delta; None while the sequence runs."""
    return _FINISH_REASONS.get(delta.finish_reason)


async def merge(streams: list[GenerationStream]) -> AsyncIterator[tuple[int, generation_pb2.GenerateResponse]]:
    """(prompt index, response) from all streams as they arrive; closing it cancels every stream."""
    if len(streams) == 1:
        async for msg in streams[0]:
            yield 0, msg
        return
    queue: asyncio.Queue[tuple[int, generation_pb2.GenerateResponse | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: GenerationStream) -> None:
        try:
            async for msg in stream:
                await queue.put((index, msg))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            await queue.put((index, exc))
        else:
            await queue.put((index, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            index, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        for stream in streams:
            stream.cancel()


@dataclass
class SequenceOutput:
    """One choice, assembled from its deltas."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[common_pb2.TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class CollectedOutputs:
    """Every choice of a request, by choice index, and the summed usage."""

    choices: dict[int, SequenceOutput] = field(default_factory=dict)
    usage: Usage = field(default_factory=Usage)


async def collect(streams: list[GenerationStream], n: int) -> CollectedOutputs:
    """Reads every stream to its end; a request that failed after admission raises a 500."""
    out = CollectedOutputs()
    async for prompt_index, msg in merge(streams):
        if msg.error:
            raise failed_after_admission(msg.error)
        for delta in msg.outputs:
            seq = out.choices.setdefault(prompt_index * n + delta.index, SequenceOutput())
            seq.text += delta.text
            seq.token_ids.extend(delta.token_ids)
            seq.logprobs.extend(delta.logprobs)
            seq.finish_reason = finish_reason(delta) or seq.finish_reason
            if (reason := stop_reason_of(delta)) is not None:  # token id 0 is a stop reason too
                seq.stop_reason = reason
        if msg.HasField("usage"):
            out.usage.add(msg.usage.prompt_tokens, msg.usage.completion_tokens)
    return out

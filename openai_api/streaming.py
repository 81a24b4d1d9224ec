"""Server-sent events in OpenAI's shape: `data: {chunk}` per event, `data: [DONE]` at the end.

The HTTP status (200) is already sent when a stream breaks, so an error in the middle of it is
reported as OpenAI does: one `data: {"error": {...}}` event, then `data: [DONE]`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from openai_api.errors import OpenAIError
from openai_api.protocol import Usage

log = logging.getLogger(__name__)

MEDIA_TYPE = "text/event-stream"
DONE = "data: [DONE]\n\n"


def sse_event(payload: dict[str, Any]) -> str:
    """One event carrying a JSON object."""
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def sse_stream(chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    """Encodes chunks as events; errors become an error event; always ends with [DONE] unless cancelled.

    Cancellation (the client disconnected) propagates into `chunks`, whose streams then cancel
    their gRPC calls, and the scheduler aborts the requests.
    """
    try:
        async for chunk in chunks:
            yield sse_event(chunk)
    except OpenAIError as exc:
        yield sse_event(exc.body())
    except Exception as exc:  # noqa: BLE001 - the stream must still end well-formed
        log.exception("error while streaming a response")
        yield sse_event(OpenAIError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error").body())
    finally:
        await chunks.aclose()  # type: ignore[attr-defined]
    yield DONE


class ChunkHeader:
    """The fields every chunk (and the full response) of one request repeats, and the token counts so far that
    continuous_usage puts in each chunk."""

    def __init__(self, request_id: str, created: int, model: str, obj: str, include_usage: bool,
                 continuous_usage: bool = False) -> None:
        self.request_id = request_id
        self.created = created
        self.model = model
        self.object = obj
        self.include_usage = include_usage
        self.continuous_usage = continuous_usage
        self._so_far = Usage()

    def count(self, prompt_tokens: int, completion_tokens: int) -> None:
        """Adds tokens to the counts continuous_usage reports (the prompts once, then each chunk's tokens)."""
        self._so_far.add(prompt_tokens, completion_tokens)

    def chunk(self, choices: list[dict[str, Any]], usage: dict[str, int] | None = None,
              extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """A chunk; with include_usage every chunk has a `usage` key, null but in the last one (and where
        continuous_usage gives the counts so far). `extra`: more top-level fields (vLLM's prompt_token_ids in a
        chat stream's first chunk)."""
        out: dict[str, Any] = {
            "id": self.request_id, "object": self.object, "created": self.created, "model": self.model,
            "choices": choices, **(extra or {}),
        }
        if self.include_usage:
            out["usage"] = self._so_far.model_dump() if usage is None and self.continuous_usage else usage
        return out

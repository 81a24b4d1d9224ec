"""Token log-probabilities in OpenAI's two formats.

The engine reports token ids; OpenAI reports token strings. With a tokenizer the front decodes
each id alone (as vLLM does); without one it names tokens `token_id:<id>` (vLLM's
--return-tokens-as-token-ids), so logprobs work without any model files.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from protos import common_pb2


class TokenNamer:
    """Token id -> the text OpenAI's `token` fields carry."""

    def __init__(self, tokenizer: Any | None = None) -> None:
        self._tokenizer = tokenizer
        self.name = lru_cache(maxsize=65536)(self._name)

    def _name(self, token_id: int) -> str:
        if self._tokenizer is None:
            return f"token_id:{token_id}"
        return self._tokenizer.decode([token_id])


def completion_logprobs(
    namer: TokenNamer, token_ids: list[int], entries: list[common_pb2.TokenLogprobs], text_offset: int
) -> dict[str, list[Any]]:
    """/v1/completions' `logprobs` object for a run of tokens whose text starts at `text_offset`.

    {"tokens": [...], "token_logprobs": [...], "top_logprobs": [{token: logprob}], "text_offset": [...]}
    """
    out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token_id, entry in zip(token_ids, entries):
        token = namer.name(token_id)
        out["tokens"].append(token)
        out["token_logprobs"].append(entry.logprob)
        out["top_logprobs"].append({namer.name(t.token_id): t.logprob for t in entry.top})
        out["text_offset"].append(text_offset)
        text_offset += len(token)
    return out


def chat_logprobs(
    namer: TokenNamer, token_ids: list[int], entries: list[common_pb2.TokenLogprobs]
) -> dict[str, list[dict[str, Any]]]:
    """/v1/chat/completions' `logprobs` object: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    content = []
    for token_id, entry in zip(token_ids, entries):
        token = namer.name(token_id)
        content.append({
            "token": token,
            "logprob": entry.logprob,
            "bytes": list(token.encode()),
            "top_logprobs": [
                {"token": (name := namer.name(t.token_id)), "logprob": t.logprob, "bytes": list(name.encode())}
                for t in entry.top
            ],
        })
    return {"content": content}

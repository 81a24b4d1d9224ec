"""Token log-probabilities in OpenAI's two formats, and vLLM's `prompt_logprobs`.

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


# Names every token `token_id:<id>` (a front without a tokenizer, or a request's return_tokens_as_token_ids).
ID_NAMER = TokenNamer()

# What JSON can carry for a log-probability of -inf (vLLM's and OpenAI's floor).
_MIN_LOGPROB = -9999.0


def completion_logprobs(
    namer: TokenNamer, token_ids: list[int], entries: list[common_pb2.TokenLogprobs | None], text_offset: int
) -> dict[str, list[Any]]:
    """/v1/completions' `logprobs` object for a run of tokens whose text starts at `text_offset`.

    {"tokens": [...], "token_logprobs": [...], "top_logprobs": [{token: logprob}], "text_offset": [...]}
    A None entry (an echoed prompt's first token, which nothing predicts) has null logprobs, as in OpenAI's.
    Each `top_logprobs` dict holds the token itself first, then the most likely ones: "the API will always
    return the logprob of the sampled token, so there may be up to logprobs+1 elements" (OpenAI's reference;
    vLLM's dicts are the same).
    """
    out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token_id, entry in zip(token_ids, entries):
        token = namer.name(token_id)
        out["tokens"].append(token)
        out["token_logprobs"].append(None if entry is None else entry.logprob)
        out["top_logprobs"].append(None if entry is None else _with_token_first(namer, token, entry))
        out["text_offset"].append(text_offset)
        text_offset += len(token)
    return out


def _with_token_first(namer: TokenNamer, token: str, entry: common_pb2.TokenLogprobs) -> dict[str, float]:
    top = {token: entry.logprob}
    for t in entry.top:
        top.setdefault(namer.name(t.token_id), t.logprob)
    return top


def prompt_logprobs(
    namer: TokenNamer, token_ids: list[int], entries: list[common_pb2.TokenLogprobs | None]
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs`: per prompt token, null where none was computed (the first token), else
    {token id: {"logprob", "rank", "decoded_token"}} for the prompt token first, then the most likely ones."""
    out: list[dict[str, dict[str, Any]] | None] = []
    for token_id, entry in zip(token_ids, entries):
        if entry is None:
            out.append(None)
            continue
        # The top tokens' ranks are their places; the prompt token's comes from the engine (0: not computed,
        # then its place among the top ones if it is there).
        places = {top.token_id: rank for rank, top in enumerate(entry.top, 1)}
        rank = entry.rank or places.get(token_id)
        position = {str(token_id): _vllm_logprob(namer, token_id, entry.logprob, rank)}
        for rank, top in enumerate(entry.top, 1):
            position.setdefault(str(top.token_id), _vllm_logprob(namer, top.token_id, top.logprob, rank))
        out.append(position)
    return out


def _vllm_logprob(namer: TokenNamer, token_id: int, logprob: float, rank: int | None) -> dict[str, Any]:
    return {"logprob": max(logprob, _MIN_LOGPROB), "rank": rank, "decoded_token": namer.name(token_id)}


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

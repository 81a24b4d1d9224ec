"""Conversion between SamplingParams and its protobuf message (both services use it)."""

from __future__ import annotations

from protos import common_pb2
from shared.sampling_params import SamplingParams


def sampling_from_proto(msg: common_pb2.SamplingParams) -> SamplingParams:
    """Builds validated SamplingParams from the wire message (unset fields take defaults)."""
    defaults = SamplingParams()
    max_tokens: int | None = defaults.max_tokens
    if msg.HasField("max_tokens"):
        max_tokens = msg.max_tokens or None
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=msg.temperature if msg.HasField("temperature") else defaults.temperature,
        top_p=msg.top_p if msg.HasField("top_p") else defaults.top_p,
        top_k=msg.top_k,
        seed=msg.seed if msg.HasField("seed") else None,
        stop=list(msg.stop),
        stop_token_ids=list(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        n=msg.n or 1,
        best_of=msg.best_of or None,
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
    )


def sampling_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    """The inverse of sampling_from_proto."""
    msg = common_pb2.SamplingParams(
        max_tokens=params.max_tokens or 0,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        stop=params.stop,
        stop_token_ids=params.stop_token_ids,
        ignore_eos=params.ignore_eos,
        n=params.n,
        best_of=params.best_of or 0,
    )
    if params.logprobs is not None:
        msg.logprobs = params.logprobs
    if params.seed is not None:
        msg.seed = params.seed
    return msg

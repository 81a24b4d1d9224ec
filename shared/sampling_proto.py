"""Conversion between SamplingParams and its protobuf message (both services use it)."""

from __future__ import annotations

from protos import common_pb2
from shared.sampling_params import SamplingParams
from shared.structured_outputs import StructuredOutputsParams

_EARLY_STOPPING_FROM_PROTO: dict[int, bool | str] = {
    common_pb2.EARLY_STOPPING_HEURISTIC: False,
    common_pb2.EARLY_STOPPING_TRUE: True,
    common_pb2.EARLY_STOPPING_NEVER: "never",
}


def _early_stopping_to_proto(value: bool | str) -> int:
    for enum_value, early_stopping in _EARLY_STOPPING_FROM_PROTO.items():
        if early_stopping == value and type(early_stopping) is type(value):
            return enum_value
    raise ValueError(f"early_stopping must be True, False, or 'never', got {value!r}.")


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
        use_beam_search=msg.use_beam_search,
        length_penalty=msg.length_penalty if msg.HasField("length_penalty") else defaults.length_penalty,
        early_stopping=_early_stopping_from_proto(msg.early_stopping),
        min_p=msg.min_p,
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        repetition_penalty=(
            msg.repetition_penalty if msg.HasField("repetition_penalty") else defaults.repetition_penalty
        ),
        min_tokens=msg.min_tokens,
        prompt_logprobs=msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None,
        include_stop_str_in_output=msg.include_stop_str_in_output,
        skip_special_tokens=(
            msg.skip_special_tokens if msg.HasField("skip_special_tokens") else defaults.skip_special_tokens
        ),
        logit_bias=dict(msg.logit_bias),
        allowed_token_ids=list(msg.allowed_token_ids),
        bad_words=list(msg.bad_words),
        bad_words_token_ids=[list(t.ids) for t in msg.bad_words_token_ids],
        structured_outputs=(
            _structured_from_proto(msg.structured_outputs) if msg.HasField("structured_outputs") else None
        ),
        spaces_between_special_tokens=(
            msg.spaces_between_special_tokens if msg.HasField("spaces_between_special_tokens")
            else defaults.spaces_between_special_tokens
        ),
    )


def _structured_from_proto(msg: common_pb2.StructuredOutputs) -> StructuredOutputsParams:
    kind = msg.WhichOneof("kind")
    return StructuredOutputsParams(
        json=msg.json if kind == "json" else None,
        json_object=msg.json_object,
        regex=msg.regex if kind == "regex" else None,
        choice=list(msg.choice.choices) if kind == "choice" else None,
        grammar=msg.grammar if kind == "grammar" else None,
        disable_any_whitespace=msg.disable_any_whitespace,
        compiled=msg.compiled,
    )


def _structured_to_proto(params: StructuredOutputsParams) -> common_pb2.StructuredOutputs:
    msg = common_pb2.StructuredOutputs(
        disable_any_whitespace=params.disable_any_whitespace, compiled=params.compiled
    )
    if params.choice is not None:
        msg.choice.choices.extend(params.choice)
    elif params.json_object:
        msg.json_object = True
    else:
        setattr(msg, params.kind, getattr(params, params.kind))
    return msg


def _early_stopping_from_proto(value: int) -> bool | str:
    if value not in _EARLY_STOPPING_FROM_PROTO:
        raise ValueError(f"early_stopping must be one of {sorted(_EARLY_STOPPING_FROM_PROTO)}, got {value}.")
    return _EARLY_STOPPING_FROM_PROTO[value]


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
        use_beam_search=params.use_beam_search,
        early_stopping=_early_stopping_to_proto(params.early_stopping),
        min_p=params.min_p,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        min_tokens=params.min_tokens,
        include_stop_str_in_output=params.include_stop_str_in_output,
        logit_bias=params.logit_bias,
        allowed_token_ids=params.allowed_token_ids,
        bad_words=params.bad_words,
        bad_words_token_ids=[common_pb2.TokenIds(ids=ids) for ids in params.bad_words_token_ids],
    )
    if params.repetition_penalty != 1.0:
        msg.repetition_penalty = params.repetition_penalty
    if params.prompt_logprobs is not None:
        msg.prompt_logprobs = params.prompt_logprobs
    if not params.skip_special_tokens:
        msg.skip_special_tokens = False
    if not params.spaces_between_special_tokens:
        msg.spaces_between_special_tokens = False
    if params.length_penalty != 1.0:
        msg.length_penalty = params.length_penalty
    if params.logprobs is not None:
        msg.logprobs = params.logprobs
    if params.seed is not None:
        msg.seed = params.seed
    if params.structured_outputs is not None:
        msg.structured_outputs.CopyFrom(_structured_to_proto(params.structured_outputs))
    return msg

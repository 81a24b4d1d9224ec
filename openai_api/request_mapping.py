"""OpenAI request fields -> GenerateRequest / SamplingParams of the public gRPC API.

Only what the wire types force is checked here (integers within their protobuf field's range, field
combinations only OpenAI's API has); ranges and the rest are the scheduler's admission's job, so gRPC
and HTTP clients get the same validation and the same messages (a 400 here, INVALID_ARGUMENT there).
"""

from __future__ import annotations

from llmserve.client import chat_message, chat_options
from protos import common_pb2, generation_pb2
from openai_api.errors import invalid_request
from openai_api.structured_outputs import structured_outputs
from openai_api.tools import ToolCallMode, tool_constraint
from openai_api.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    SamplingRequest,
    TokenizeRequest,
)

_UINT64 = 1 << 64
_UINT32_MAX = (1 << 32) - 1
_INT32 = 1 << 31
# OpenAI's "developer" role is the system prompt of newer models; chat templates know "system".
_ROLE_ALIASES = {"developer": "system"}


def _non_negative(value: int | None, param: str, minimum: int = 0) -> int | None:
    """value, checked against `minimum` and the uint32 field that carries it (a larger one is a 400, not a 500)."""
    if value is not None and value < minimum:
        raise invalid_request(f"{param} must be at least {minimum}, got {value}", param)
    if value is not None and value > _UINT32_MAX:
        raise invalid_request(f"{param} must be at most {_UINT32_MAX}, got {value}", param)
    return value


def _reject_unsupported(req: SamplingRequest) -> None:
    if req.stream_options is not None and not req.stream:
        raise invalid_request("stream_options can only be set when stream is true", "stream_options")
    if req.priority != 0:
        # vLLM's answer when its scheduling policy is first come, first served, as the scheduler's is.
        raise invalid_request(f"Got priority {req.priority} but Priority scheduling is not enabled.", "priority")


def sampling_params(req: SamplingRequest, max_tokens: int | None, logprobs: int | None,
                    prompt_logprobs: int | None = None) -> common_pb2.SamplingParams:
    """The SamplingParams message for the shared fields; None leaves a field at the scheduler's default.

    max_tokens: None = the scheduler's default (16); 0 = up to the model's context length.
    """
    _reject_unsupported(req)
    msg = common_pb2.SamplingParams(
        n=_non_negative(req.n, "n", 1) or 1,
        best_of=_non_negative(req.best_of, "best_of", 1) or 0,
        top_k=_top_k(req.top_k),
        min_p=req.min_p or 0.0,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        min_tokens=_non_negative(req.min_tokens, "min_tokens") or 0,
        ignore_eos=req.ignore_eos,
        include_stop_str_in_output=req.include_stop_str_in_output,
        use_beam_search=req.use_beam_search,
        stop=[req.stop] if isinstance(req.stop, str) else list(req.stop or []),
    )
    for token_id in req.stop_token_ids or []:
        _non_negative(token_id, "stop_token_ids")
    msg.stop_token_ids.extend(req.stop_token_ids or [])
    for key, bias in (req.logit_bias or {}).items():
        # OpenAI's keys are token ids written as strings.
        if not key.isdigit():
            raise invalid_request(f"logit_bias keys must be token ids, got {key!r}", "logit_bias")
        msg.logit_bias[_non_negative(int(key), "logit_bias")] = bias  # type: ignore[index]
    for token_id in req.allowed_token_ids or []:
        _non_negative(token_id, "allowed_token_ids")
    msg.allowed_token_ids.extend(req.allowed_token_ids or [])
    msg.bad_words.extend(req.bad_words or [])
    structured = structured_outputs(req)
    if structured is not None:
        msg.structured_outputs.CopyFrom(structured)
    if max_tokens is not None:
        msg.max_tokens = max_tokens
    if req.temperature is not None:
        msg.temperature = req.temperature
    if req.top_p is not None:
        msg.top_p = req.top_p
    if req.seed is not None:
        # OpenAI seeds are any integer; the engine's are uint64. Wrapping keeps each seed reproducible.
        msg.seed = req.seed % _UINT64
    if req.repetition_penalty is not None:
        msg.repetition_penalty = req.repetition_penalty
    if req.length_penalty is not None:
        msg.length_penalty = req.length_penalty
    if not req.skip_special_tokens:
        msg.skip_special_tokens = False
    if not req.spaces_between_special_tokens:
        msg.spaces_between_special_tokens = False
    if logprobs is not None:
        msg.logprobs = logprobs
    if prompt_logprobs is not None:
        msg.prompt_logprobs = _non_negative(prompt_logprobs, "prompt_logprobs")  # type: ignore[assignment]
    return msg


def _top_k(value: int | None) -> int:
    if value is not None and not -_INT32 <= value < _INT32:
        raise invalid_request(f"top_k must be in [{-_INT32}, {_INT32 - 1}], got {value}", "top_k")
    return value or 0


def _prompt_options(req: SamplingRequest, msg: generation_pb2.GenerateRequest) -> generation_pb2.GenerateRequest:
    """add_special_tokens and truncate_prompt_tokens, as set (the scheduler applies and checks them)."""
    if req.add_special_tokens is not None:
        msg.add_special_tokens = req.add_special_tokens
    if req.truncate_prompt_tokens is not None:
        if not -_INT32 <= req.truncate_prompt_tokens < _INT32:
            raise invalid_request(f"truncate_prompt_tokens is out of range, got {req.truncate_prompt_tokens}",
                                  "truncate_prompt_tokens")
        msg.truncate_prompt_tokens = req.truncate_prompt_tokens
    return msg


def completion_prompt_logprobs(req: CompletionRequest) -> int | None:
    """How many top tokens per prompt position the engine reports (None: no prompt logprobs). Echo with logprobs
    needs the prompt's: `logprobs` applies to them unless prompt_logprobs is set, as in vLLM."""
    if req.prompt_logprobs is None and req.echo:
        return req.logprobs
    return req.prompt_logprobs


def completion_requests(req: CompletionRequest, request_id: str) -> list[generation_pb2.GenerateRequest]:
    """One GenerateRequest per prompt of the batch, with ids `request_id-<i>` when there are several."""
    if req.suffix:
        raise invalid_request("suffix is not supported", "suffix")
    max_tokens = _non_negative(req.max_tokens, "max_tokens", 1)
    sampling = sampling_params(req, max_tokens, _non_negative(req.logprobs, "logprobs"), completion_prompt_logprobs(req))
    prompts = _prompt_batch(req.prompt)
    out = []
    for i, prompt in enumerate(prompts):
        rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
        if isinstance(prompt, str):
            msg = generation_pb2.GenerateRequest(request_id=rid, prompt=prompt, sampling=sampling)
        else:
            for token_id in prompt:
                _non_negative(token_id, "prompt")
            msg = generation_pb2.GenerateRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling)
        out.append(_prompt_options(req, msg))
    return out


def _prompt_batch(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """A single prompt (text or token ids) or a batch of them, as a list of prompts."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise invalid_request("prompt must not be empty", "prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]  # type: ignore[arg-type]
    return list(prompt)  # type: ignore[arg-type]


def chat_request(req: ChatCompletionRequest, request_id: str, mode: ToolCallMode | None
                 ) -> generation_pb2.GenerateRequest:
    """The GenerateRequest of a chat completion; the scheduler renders the chat template (and the tools).
    mode: the request's tool calling (tools.tool_call_mode), which the caller also reads the output by."""
    # max_completion_tokens replaced max_tokens in OpenAI's chat API; unset = up to the context length.
    max_tokens = _non_negative(req.max_completion_tokens, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _non_negative(req.max_tokens, "max_tokens", 1) or 0
    if req.top_logprobs is not None and not req.logprobs:
        raise invalid_request("top_logprobs needs logprobs to be true", "top_logprobs")
    logprobs = (_non_negative(req.top_logprobs, "top_logprobs") or 0) if req.logprobs else None
    msg = _prompt_options(req, generation_pb2.GenerateRequest(
        request_id=request_id,
        messages=_chat_messages(req.messages),
        sampling=sampling_params(req, max_tokens, logprobs, req.prompt_logprobs),
    ))
    # The scheduler checks that the pair makes sense.
    msg.chat_options.CopyFrom(_chat_options(req))
    if mode is not None and not mode.constrained:
        # The call syntax may be special tokens (Hermes' <tool_call>): the parser must see them, as vLLM's does.
        msg.sampling.skip_special_tokens = False
    elif mode is not None:
        if msg.sampling.HasField("structured_outputs"):
            raise invalid_request("tool_choice constrains the output to tool calls: set no other constraint "
                                  "(response_format, structured_outputs, guided_*) with it", "tool_choice")
        msg.sampling.structured_outputs.CopyFrom(tool_constraint(req, mode))
    return msg


def _chat_messages(messages: list[ChatMessage]) -> list[generation_pb2.ChatMessage]:
    # Checked here: an empty list would reach the scheduler as no prompt at all, whose message names
    # Generate's fields (prompt, prompt_token_ids), not the HTTP request's.
    if not messages:
        raise invalid_request("messages must hold at least one message", "messages")
    return [_chat_message(m, i) for i, m in enumerate(messages)]


def message_text(message: ChatMessage, index: int) -> str:
    """A message's content as text: its text parts joined (other parts are a 400)."""
    content = message.content
    if not isinstance(content, list):
        return content or ""
    texts = []
    for part in content:
        if part.type != "text" or part.text is None:
            raise invalid_request(f"messages[{index}].content: only text parts are supported, got {part.type!r}",
                                  f"messages[{index}].content")
        texts.append(part.text)
    return "".join(texts)


def _chat_message(message: ChatMessage, index: int) -> generation_pb2.ChatMessage:
    role = _ROLE_ALIASES.get(message.role, message.role)
    return chat_message({"role": role, "content": message_text(message, index), "tool_call_id": message.tool_call_id,
                         "tool_calls": [call.model_dump() for call in message.tool_calls or []],
                         "reasoning": message.reasoning, "reasoning_content": message.reasoning_content})


def _chat_options(req: ChatCompletionRequest | TokenizeRequest) -> generation_pb2.ChatOptions:
    """How the scheduler renders the messages: vLLM's rendering fields, the tools, the template's variables."""
    kwargs = dict(req.chat_template_kwargs or {})
    if req.documents is not None:
        if "documents" in kwargs:
            raise invalid_request("set documents once: as its own field or in chat_template_kwargs", "documents")
        kwargs["documents"] = req.documents
    return chat_options(req.add_generation_prompt, req.continue_final_message,
                        [tool.model_dump() for tool in req.tools or []], kwargs)


def tokenize_request(req: TokenizeRequest) -> generation_pb2.TokenizeRequest:
    """The Tokenize call for /tokenize; only what Generate does is served (the tokens it would compute)."""
    if (req.prompt is None) == (req.messages is None):
        raise invalid_request("set exactly one of prompt or messages", "prompt")
    if req.messages is not None:
        msg = generation_pb2.TokenizeRequest(messages=_chat_messages(req.messages))
        msg.chat_options.CopyFrom(_chat_options(req))
    elif field := next((name for name, unset in (("add_generation_prompt", True), ("continue_final_message", False),
                                                  ("tools", None), ("chat_template_kwargs", None), ("documents", None))
                        if getattr(req, name) != unset), None):
        raise invalid_request(f"{field} applies to messages, not a prompt", field)
    else:
        msg = generation_pb2.TokenizeRequest(prompt=req.prompt)
    if req.add_special_tokens is not None:
        msg.add_special_tokens = req.add_special_tokens
    return msg


def detokenize_ids(req: DetokenizeRequest) -> list[int]:
    """The token ids of /detokenize, each within its uint32 field."""
    return [_non_negative(token_id, "tokens") for token_id in req.tokens]  # type: ignore[misc]

"""Request and response models of the OpenAI API subset the front serves.

Served: the fields defined here. OpenAI's sampling fields, completions' `echo` (the prompt's text, and with
`logprobs` its tokens' logprobs, before each choice's), vLLM's extra sampling parameters (`top_k`, `min_p`,
`repetition_penalty`, `min_tokens`, `stop_token_ids`, `ignore_eos`, `use_beam_search`,
`spaces_between_special_tokens`, ...), its prompt options (`add_special_tokens`, `truncate_prompt_tokens`)
and its extra outputs (`prompt_logprobs`, `return_token_ids`), and its chat rendering fields
(`add_generation_prompt`, `continue_final_message`, `chat_template_kwargs`, `documents`); vLLM's with `extra_body=`
in the openai client.
Structured outputs in all three spellings: OpenAI's `response_format`, vLLM's `structured_outputs` and its older
`guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`.
`priority` is served as vLLM serves it under first-come-first-served scheduling, the scheduler's only policy:
0 is accepted, any other value is a 400 naming it. Accepted without effect: `user` (as in vLLM) and a message's
`name`. Tools: `tools`, `tool_choice` and `parallel_tool_calls`, and messages' `tool_calls` / `tool_call_id`
(tools.py says what each tool_choice does).

A string that holds a lone surrogate (JSON can escape one, "\\ud800"; no UTF-8 carries it) is a 400 naming where.
Rejected with a 400 naming them (never ignored: the answer would be to another request): every field not
defined here, and the defined ones the front cannot honour: `suffix`, and
`tool_choice` "auto" with tools when the front has no --tool-call-parser. The README's table lists every OpenAI and
vLLM request field.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

# The validation error type of a string that is not valid Unicode (routes.py names its parameter).
INVALID_UNICODE = "invalid_unicode"
# What JSON decodes to that can hold text.
_TEXT_HOLDERS = frozenset({str, dict, list})


def _lone_surrogate(value: object, path: str) -> tuple[str, str] | None:
    """Where the first lone surrogate of a decoded JSON value is, and which: JSON can escape one ("\\ud800"), but no
    UTF-8 carries it, so the text could reach neither the tokenizer nor the scheduler (protobuf strings are UTF-8)."""
    if isinstance(value, str):
        try:
            value.encode()
        except UnicodeEncodeError as exc:
            return path, value[exc.start]
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            name = str(key).encode(errors="backslashreplace").decode()
            where = f"{path}.{name}" if path else name
            # A key is checked too (logit_bias's are token ids as text).
            if (found := _lone_surrogate(key, where) or _lone_surrogate(item, where)) is not None:
                return found
    elif isinstance(value, list) and not _TEXT_HOLDERS.isdisjoint(map(type, value)):  # token ids: skipped at C speed
        for i, item in enumerate(value):
            if type(item) in _TEXT_HOLDERS and (found := _lone_surrogate(item, f"{path}[{i}]")) is not None:
                return found
    return None


class OpenAIBaseModel(BaseModel):
    """Unknown fields are kept (not an error) so `unknown_fields` can name them."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _unicode_only(cls, data: Any) -> Any:
        found = _lone_surrogate(data, "")
        if found is not None:
            where, char = found
            raise PydanticCustomError(INVALID_UNICODE, "{param} is not valid Unicode: it holds a lone surrogate ({char})",
                                      {"param": where, "char": ascii(char)[1:-1]})
        return data

    def unknown_fields(self) -> list[str]:
        """Names of the request fields this model does not define."""
        return sorted(self.model_extra or {})


class StreamOptions(OpenAIBaseModel):
    """`stream_options`: include_usage adds a last chunk with usage and no choices; with it, vLLM's
    continuous_usage_stats also gives every other chunk the counts so far."""

    include_usage: bool = False
    continuous_usage_stats: bool = False


class StructuredOutputsRequest(OpenAIBaseModel):
    """vLLM's `structured_outputs`: exactly one of json, json_object, regex, choice, grammar."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False
    # The one grammar backend never falls back to another: either value is what happens.
    disable_fallback: bool = False


class SamplingRequest(OpenAIBaseModel):
    """Fields completions and chat completions share."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extra sampling parameters.
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    best_of: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    use_beam_search: bool = False
    length_penalty: float | None = None
    # vLLM's prompt options: the tokenizer's special tokens, and keeping only the prompt's last tokens.
    add_special_tokens: bool | None = None
    truncate_prompt_tokens: int | None = None
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs or its older guided_* fields.
    response_format: dict[str, Any] | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM's: each prompt token's logprob and the most likely tokens there (how many); the prompt's and the
    # generated token ids in the response; the scheduling priority (only 0: scheduling is first come, first served).
    prompt_logprobs: int | None = None
    return_token_ids: bool | None = None
    priority: int = 0
    # vLLM's: logprobs name tokens `token_id:<id>` rather than their text (None: as the front is started).
    return_tokens_as_token_ids: bool | None = None


class CompletionRequest(SamplingRequest):
    """POST /v1/completions. A list prompt is a batch: one choice group of n per prompt."""

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None


class ContentPart(OpenAIBaseModel):
    """One part of a message's content; only text parts are served."""

    type: str
    text: str | None = None


class FunctionCall(OpenAIBaseModel):
    """The function an assistant message called: its name and its arguments as JSON text."""

    name: str
    arguments: str


class ToolCall(OpenAIBaseModel):
    """One of an assistant message's `tool_calls`."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(OpenAIBaseModel):
    """One message of `messages`: an assistant's may carry `tool_calls`, a tool's answers one by `tool_call_id`."""

    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    # An assistant message's thinking, as responses carry it (vLLM's name, and DeepSeek's).
    reasoning: str | None = None
    reasoning_content: str | None = None


class FunctionDefinition(OpenAIBaseModel):
    """A function tool: its arguments' JSON schema is `parameters`. `strict` asks that calls follow the schema,
    which tool_choice "required" or a named function guarantees (their outputs are constrained to it)."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(OpenAIBaseModel):
    """One of `tools`."""

    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(OpenAIBaseModel):
    name: str


class NamedToolChoice(OpenAIBaseModel):
    """`tool_choice` naming the function to call."""

    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(SamplingRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ToolDefinition] | None = None
    # "none", "auto", "required" or a NamedToolChoice, checked by tools.py (a union's error would name types).
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    # vLLM's: the last message's text before each choice's when it is the assistant's (an answer continued).
    echo: bool = False
    # vLLM's: false leaves the reasoning out of the response (with the front's reasoning parser).
    include_reasoning: bool = True
    # vLLM's: how the messages are rendered (the template's generation prompt; a final message left open; more
    # template variables, and documents for templates that take them).
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None


class TokenizeRequest(OpenAIBaseModel):
    """POST /tokenize (vLLM's): a prompt, or chat messages (and tools) rendered as Generate renders them."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ToolDefinition] | None = None
    # As Generate's: unset adds the tokenizer's special tokens to a prompt, none to messages.
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(OpenAIBaseModel):
    """POST /detokenize (vLLM's)."""

    model: str | None = None
    tokens: list[int]


class Usage(BaseModel):
    """Token counts of a request (summed over its prompts and sequences)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0

    def add(self, prompt_tokens: int, completion_tokens: int) -> None:
        """Adds one gRPC request's counts."""
        self.prompt_tokens += prompt_tokens
        self.completion_tokens += completion_tokens
        self.total_tokens = self.prompt_tokens + self.completion_tokens


class ModelCard(BaseModel):
    """One entry of GET /v1/models."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "llmserve"
    root: str | None = None
    # Longest prompt + completion, in tokens (vLLM's extension of the model card).
    max_model_len: int | None = None


class ModelList(BaseModel):
    """GET /v1/models."""

    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)

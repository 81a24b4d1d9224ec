"""A small synchronous client for the public Generation API."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from llmserve.resume import RECONNECT_OPTIONS, ResumePolicy, ResumingStream
from protos import common_pb2, generation_pb2, generation_pb2_grpc
from shared.auth import token_interceptors
from shared.grpc_server import CHANNEL_OPTIONS
from shared.tls import ClientTLS, open_channel

# Streams re-attach after UNAVAILABLE unless a client is made with resume=None.
DEFAULT_RESUME = ResumePolicy()


@dataclass
class Completion:
    """A finished sequence, assembled from its stream of deltas."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    stop_reason: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str = ""
    # Per generated token, when the request asked for logprobs.
    logprobs: list[common_pb2.TokenLogprobs] = field(default_factory=list)
    # Per prompt token from index prompt_logprobs_start on, when the request asked for prompt_logprobs
    # (the same for every sequence of the request).
    prompt_logprobs: list[common_pb2.TokenLogprobs] = field(default_factory=list)
    prompt_logprobs_start: int = 0
    # The prompt as the model read it (from the stream's first message).
    prompt_token_ids: list[int] = field(default_factory=list)


class GenerationClient:
    """Streams completions from a scheduler replica.

    tls: verify the scheduler's certificate (and present a client certificate) instead of plaintext.
    token: bearer token sent with every call, for a scheduler started with --auth-token-file.
    fallback_addresses: other replicas a broken stream may re-attach to (any replica serves any request).
    resume: how `stream` re-attaches after UNAVAILABLE (see llmserve.resume); None: plain calls that fail.
    """

    def __init__(self, address: str, tls: ClientTLS | None = None, token: str = "",
                 fallback_addresses: Sequence[str] = (), resume: ResumePolicy | None = DEFAULT_RESUME) -> None:
        interceptors = token_interceptors(token, aio=False)
        self._channels = [open_channel(a, tls, interceptors=interceptors, options=[*CHANNEL_OPTIONS, *RECONNECT_OPTIONS])
                          for a in (address, *fallback_addresses)]
        self._stubs = [generation_pb2_grpc.GenerationStub(c) for c in self._channels]
        self._channel, self._stub = self._channels[0], self._stubs[0]
        self._address = address
        self._resume = resume

    def wait_for_server(self, timeout: float) -> None:
        """Returns once the first address accepts a connection; ConnectionError naming it after `timeout` s.

        Calls wait for a scheduler that is not up yet (gRPC's wait_for_ready), up to their own deadline: a
        caller that would rather fail fast on a wrong address, a server that is down or a TLS mismatch asks
        this first.
        """
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise ConnectionError(f"no scheduler accepted a connection at {self._address} within {timeout:g} s") from None

    def close(self) -> None:
        for channel in self._channels:
            channel.close()

    def __enter__(self) -> "GenerationClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stream(self, request: generation_pb2.GenerateRequest, timeout: float | None = None) -> Iterator[generation_pb2.GenerateResponse]:
        """The response stream; `cancel()` ends it. It re-attaches after UNAVAILABLE (a dropped connection, a
        lost replica) within `timeout`, so no message is lost or repeated; a request without an id gets one
        here for that. Without a resume policy it is the plain gRPC call."""
        if self._resume is None:
            return self._stub.Generate(request, timeout=timeout, wait_for_ready=True)
        return ResumingStream(self._stubs, request, timeout, self._resume)

    def resume(self, request_id: str, from_index: int = 0,
               timeout: float | None = None) -> Iterator[generation_pb2.GenerateResponse]:
        """The plain Resume call: request `request_id`'s messages from index `from_index` on."""
        request = generation_pb2.ResumeRequest(request_id=request_id, from_index=from_index)
        return self._stub.Resume(request, timeout=timeout, wait_for_ready=True)

    def model_info(self, timeout: float = 30) -> generation_pb2.ModelInfoResponse:
        """The served model and its limits."""
        return self._stub.ModelInfo(generation_pb2.ModelInfoRequest(), timeout=timeout, wait_for_ready=True)

    def tokenize(self, prompt: str = "", messages: list[tuple[str, str]] | None = None,
                 timeout: float = 30) -> generation_pb2.TokenizeResponse:
        """The tokens Generate would compute for a prompt or chat messages."""
        request = generation_pb2.TokenizeRequest(
            prompt=prompt, messages=[generation_pb2.ChatMessage(role=r, content=c) for r, c in messages or []]
        )
        return self._stub.Tokenize(request, timeout=timeout, wait_for_ready=True)

    def abort(self, request_id: str, timeout: float = 30) -> None:
        """Aborts a live request; its stream ends with FINISH_REASON_ABORT."""
        self._stub.Abort(generation_pb2.AbortRequest(request_id=request_id), timeout=timeout)

    def generate(self, request: generation_pb2.GenerateRequest, timeout: float | None = None) -> Completion:
        """Collects the whole stream into one Completion (the first sequence's, when n > 1)."""
        return self.generate_n(request, timeout)[0]

    def generate_n(self, request: generation_pb2.GenerateRequest, timeout: float | None = None) -> list[Completion]:
        """Collects the whole stream into one Completion per sequence, in index order."""
        return collect_completions(self.stream(request, timeout))


def stop_reason_of(delta: generation_pb2.CompletionDelta) -> int | str | None:
    """vLLM's `stop_reason` of a delta: the stop token id as an int, the stop string as text; None otherwise."""
    return delta.stop_token_id if delta.HasField("stop_token_id") else (delta.stop_reason or None)


def collect_completions(messages: Iterable[generation_pb2.GenerateResponse]) -> list[Completion]:
    """One Completion per sequence, in index order, from a request's messages (its whole stream)."""
    outs: dict[int, Completion] = {}
    error, usage, prompt = "", None, None
    prompt_token_ids: list[int] = []
    for msg in messages:
        if msg.prompt_logprobs or msg.prompt_logprobs_start:
            prompt = msg
        prompt_token_ids = prompt_token_ids or list(msg.prompt_token_ids)
        for delta in msg.outputs:
            out = outs.setdefault(delta.index, Completion())
            out.text += delta.text
            out.token_ids.extend(delta.token_ids)
            out.logprobs.extend(delta.logprobs)
            if delta.finish_reason:
                out.finish_reason = common_pb2.FinishReason.Name(delta.finish_reason)
                out.stop_reason = delta.stop_reason
        error = msg.error or error
        if msg.HasField("usage"):
            usage = msg.usage
    completions = [outs[i] for i in sorted(outs)] or [Completion()]
    for out in completions:
        out.error = error
        out.prompt_token_ids = prompt_token_ids
        if usage is not None:
            out.prompt_tokens, out.completion_tokens = usage.prompt_tokens, usage.completion_tokens
        if prompt is not None:
            out.prompt_logprobs = list(prompt.prompt_logprobs)
            out.prompt_logprobs_start = prompt.prompt_logprobs_start
    return completions


def chat_options(add_generation_prompt: bool = True, continue_final_message: bool = False,
                 tools: Sequence[Mapping[str, Any]] | None = None,
                 template_kwargs: Mapping[str, Any] | None = None) -> generation_pb2.ChatOptions:
    """vLLM's chat rendering parameters as GenerateRequest.chat_options: a new assistant turn after the messages
    (the default), or the final message left open for the model to continue (an answer the caller began);
    OpenAI-shaped function tools (`{"type": "function", "function": {"name", "description", "parameters"}}`) for
    the template to describe; and more template variables (vLLM's chat_template_kwargs)."""
    options = generation_pb2.ChatOptions(continue_final_message=continue_final_message,
                                         template_kwargs=json.dumps(dict(template_kwargs)) if template_kwargs else "")
    if not add_generation_prompt:
        options.add_generation_prompt = False
    for i, tool in enumerate(tools or []):
        function = tool.get("function")
        if tool.get("type", "function") != "function" or not isinstance(function, Mapping):
            raise ValueError(f'tools[{i}] must be {{"type": "function", "function": {{"name": ...}}}}')
        parameters = function.get("parameters")
        options.tools.add(name=function.get("name") or "", description=function.get("description") or "",
                          parameters="" if parameters is None else json.dumps(parameters))
    return options


def chat_message(message: Mapping[str, Any]) -> generation_pb2.ChatMessage:
    """An OpenAI-shaped message with text content (an assistant's `tool_calls` and `reasoning` (or DeepSeek's
    `reasoning_content`), a tool's `tool_call_id`) as Generate's ChatMessage."""
    out = generation_pb2.ChatMessage(role=message["role"], content=message.get("content") or "",
                                     tool_call_id=message.get("tool_call_id") or "",
                                     reasoning=message.get("reasoning") or message.get("reasoning_content") or "")
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        out.tool_calls.add(id=call.get("id") or "", name=function.get("name") or "",
                           arguments=function.get("arguments") or "")
    return out


def make_request(
    prompt: str = "",
    prompt_token_ids: list[int] | None = None,
    messages: list[tuple[str, str]] | None = None,
    request_id: str = "",
    **sampling: object,
) -> generation_pb2.GenerateRequest:
    """Builds a GenerateRequest; `sampling` takes SamplingParams field names."""
    return generation_pb2.GenerateRequest(
        request_id=request_id,
        prompt=prompt,
        prompt_token_ids=prompt_token_ids or [],
        messages=[generation_pb2.ChatMessage(role=r, content=c) for r, c in messages or []],
        sampling=common_pb2.SamplingParams(**sampling),  # type: ignore[arg-type]
    )

"""Admission: tokenize and validate a GenerateRequest before it touches any state.

Everything a client can get wrong is caught here and reported as
INVALID_ARGUMENT with a message that says what to change.
"""

from __future__ import annotations

import hashlib
import math
import uuid
from dataclasses import dataclass

from jinja2 import TemplateError

from protos import generation_pb2, state_pb2
from scheduler_service.chat_conversation import conversation, template_kwargs, template_tools
from shared.errors import InvalidRequestError
from shared.sampling_params import SamplingParams
from shared.sampling_proto import sampling_from_proto, sampling_to_proto
from shared.structured_outputs import compile_grammar

_MAX_REQUEST_ID_LEN = 256
# Float sampling fields: NaN and infinities pass some range checks (NaN compares false); they are refused after them.
_FLOAT_FIELDS = ("temperature", "top_p", "length_penalty", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty")


@dataclass
class ModelLimits:
    """What admission checks requests against (from the workers' Describe)."""

    max_model_len: int
    vocab_size: int
    # Most sequences in one step (--max-num-seqs): a request with more (n, best_of) could never run. 0 = no check.
    max_num_seqs: int = 0


@dataclass
class AdmittedPrompt:
    """A validated request, ready to be queued."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    # Identity of the request for idempotent re-sends (see request_digest); "" when the server chose the id.
    digest: str = ""


class Admission:
    """Turns public requests into validated, tokenized ones."""

    def __init__(self, tokenizer: object, limits: ModelLimits) -> None:
        self._tok = tokenizer
        # What requests are checked against; ModelInfo reports it too.
        self.limits = limits

    def admit(self, req: generation_pb2.GenerateRequest) -> AdmittedPrompt:
        """Validates and tokenizes; raises InvalidRequestError with a clear message."""
        request_id = req.request_id or uuid.uuid4().hex
        if len(request_id) > _MAX_REQUEST_ID_LEN or not request_id.isprintable():
            raise InvalidRequestError(f"request_id must be at most {_MAX_REQUEST_ID_LEN} printable characters")
        token_ids = self._truncated(req, self._prompt_tokens(req))
        sampling = self._sampling(req, len(token_ids))
        digest = request_digest(token_ids, sampling) if req.request_id else ""
        return AdmittedPrompt(request_id, token_ids, sampling, digest)

    def tokenize(self, req: generation_pb2.TokenizeRequest) -> tuple[list[int], list[str]]:
        """Token ids and their strings for a prompt or chat messages, as Generate would compute them."""
        as_generate = generation_pb2.GenerateRequest(prompt=req.prompt, messages=req.messages)
        if req.HasField("chat_options"):
            as_generate.chat_options.CopyFrom(req.chat_options)
        if req.HasField("add_special_tokens"):
            as_generate.add_special_tokens = req.add_special_tokens
        ids = self._prompt_tokens(as_generate)
        return ids, list(self._tok.convert_ids_to_tokens(ids))  # type: ignore[attr-defined]

    def detokenize(self, token_ids: list[int]) -> str:
        """The text of token ids (special tokens included)."""
        self._check_in_vocabulary("token_ids", token_ids)
        return self._tok.decode(token_ids)  # type: ignore[attr-defined]

    @property
    def eos_token_id(self) -> int | None:
        return getattr(self._tok, "eos_token_id", None)

    @property
    def has_chat_template(self) -> bool:
        return getattr(self._tok, "chat_template", None) is not None

    def _prompt_tokens(self, req: generation_pb2.GenerateRequest) -> list[int]:
        given = [name for name in ("prompt", "prompt_token_ids", "messages") if getattr(req, name)]
        if len(given) != 1:
            if not given:
                raise InvalidRequestError("the prompt is empty: set one of prompt, prompt_token_ids or messages")
            raise InvalidRequestError(f"set exactly one of prompt, prompt_token_ids or messages, got {', '.join(given)}")
        special = req.add_special_tokens if req.HasField("add_special_tokens") else None
        if req.HasField("chat_options") and not req.messages:
            raise InvalidRequestError("chat_options (add_generation_prompt, continue_final_message, tools, "
                                      "template_kwargs) apply to messages")
        if req.prompt_token_ids:
            if special is not None:
                raise InvalidRequestError("add_special_tokens applies to a text prompt or messages, not prompt_token_ids")
            ids = list(req.prompt_token_ids)
            self._check_in_vocabulary("prompt_token_ids", ids)
            return ids
        if req.messages:
            return self._chat_tokens(req.messages, req.chat_options, special is True)
        ids = list(self._tok(req.prompt, add_special_tokens=special is not False).input_ids)  # type: ignore[operator]
        if not ids:
            raise InvalidRequestError("the prompt tokenizes to zero tokens")
        return ids

    def _truncated(self, req: generation_pb2.GenerateRequest, ids: list[int]) -> list[int]:
        if not req.HasField("truncate_prompt_tokens"):
            return ids
        keep = req.truncate_prompt_tokens
        if keep == -1:
            keep = self.limits.max_model_len
        if keep < 1:
            raise InvalidRequestError(f"truncate_prompt_tokens must be at least 1 (or -1), got {keep}")
        return ids[-keep:]

    def _chat_tokens(self, messages: object, options: generation_pb2.ChatOptions,
                     add_special_tokens: bool = False) -> list[int]:
        generation_prompt = options.add_generation_prompt if options.HasField("add_generation_prompt") else True
        if generation_prompt and options.continue_final_message:
            raise InvalidRequestError("continue_final_message needs add_generation_prompt false: the final message is "
                                      "continued, no new turn opened")
        conv = conversation(messages)  # type: ignore[arg-type]
        tools = template_tools(options.tools)
        if not self.has_chat_template:
            raise InvalidRequestError("this model has no chat template; send a plain prompt instead")
        extra = template_kwargs(options.template_kwargs, self._tok.apply_chat_template)  # type: ignore[attr-defined]
        try:
            text = self._tok.apply_chat_template(  # type: ignore[attr-defined]
                conv, tools=tools, tokenize=False, add_generation_prompt=generation_prompt,
                continue_final_message=options.continue_final_message, **extra)
        # ValueError: e.g. a final message the template leaves out, which cannot be continued. TemplateError: the
        # template refused the conversation (its raise_exception: roles out of order, more tool calls than it
        # takes, ...) or read a field the messages lack. TypeError: a value of the wrong type for the template or
        # for transformers (documents that are not title/text objects). The inputs are all the request's.
        except (ValueError, TypeError, TemplateError) as exc:
            raise InvalidRequestError(f"messages cannot be rendered with the chat template: {exc}") from exc
        # The template already contains the special tokens the model expects (unless asked for more).
        return list(self._tok(text, add_special_tokens=add_special_tokens).input_ids)  # type: ignore[operator]

    def _sampling(self, req: generation_pb2.GenerateRequest, prompt_len: int) -> SamplingParams:
        try:
            params = sampling_from_proto(req.sampling)
        except ValueError as exc:
            raise InvalidRequestError(str(exc)) from exc
        for name in _FLOAT_FIELDS:
            value = getattr(req.sampling, name)
            if not math.isfinite(value):
                raise InvalidRequestError(f"{name} must be a finite number, got {value}")
        if params.bad_words_token_ids:
            raise InvalidRequestError("bad_words_token_ids is set by the scheduler: send bad_words")
        params.bad_words_token_ids = self._bad_words_token_ids(params.bad_words)
        if params.allowed_token_ids and {ids[0] for ids in params.bad_words_token_ids if len(ids) == 1}.issuperset(
                params.allowed_token_ids):
            # One-token bad words are masked at every position: the worker would have nothing to sample.
            raise InvalidRequestError("every id in allowed_token_ids is a bad word (one token of bad_words): "
                                      "nothing is left to generate")
        structured = params.structured_outputs
        if structured is not None:
            if structured.compiled:
                raise InvalidRequestError("structured_outputs.compiled is set by the scheduler: leave it empty")
            if not getattr(self._tok, "is_fast", False):
                # The worker's matchers read the model's tokenizer in its Rust (tokenizers) form.
                raise InvalidRequestError("structured outputs need a fast tokenizer; this model's is not")
            try:
                structured.compiled = compile_grammar(structured)
            except ValueError as exc:
                raise InvalidRequestError(str(exc)) from exc
        max_seqs = self.limits.max_num_seqs
        width = params.best_of or params.n  # beam search runs best_of beams at once
        if max_seqs and width > max_seqs:
            raise InvalidRequestError(
                f"the request runs {width} sequences at once (n / best_of), but a step runs at most "
                f"{max_seqs} (--max-num-seqs); lower n or best_of"
            )
        max_len = self.limits.max_model_len
        if prompt_len >= max_len:
            raise InvalidRequestError(
                f"the prompt has {prompt_len} tokens, but this model's maximum context length is {max_len} tokens; "
                "shorten the prompt"
            )
        room = max_len - prompt_len
        if params.max_tokens is None:
            params.max_tokens = room
        elif params.max_tokens > room:
            raise InvalidRequestError(
                f"this model's maximum context length is {max_len} tokens, but {prompt_len + params.max_tokens} "
                f"were requested ({prompt_len} in the prompt, {params.max_tokens} for the completion); "
                "lower max_tokens or shorten the prompt"
            )
        try:
            params.check_min_tokens()
        except ValueError as exc:
            raise InvalidRequestError(str(exc)) from exc
        # The worker masks stop tokens (min_tokens), biases and allows tokens by id: an id past the logits
        # would fail the step.
        self._check_in_vocabulary("stop_token_ids", params.stop_token_ids)
        self._check_in_vocabulary("logit_bias", list(params.logit_bias))
        self._check_in_vocabulary("allowed_token_ids", params.allowed_token_ids)
        return params

    def _bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """Each bad word's tokens as the model would generate them: without and with a leading space. (vLLM keeps
        the spaced spelling only when it has as many tokens as the bare one, so a word that is one token after a
        space and two without could still be generated there; here every spelling is masked.)"""
        sequences: list[list[int]] = []
        for word in words:
            bare = list(self._tok(word.lstrip(), add_special_tokens=False).input_ids)  # type: ignore[operator]
            spaced = list(self._tok(" " + word.lstrip(), add_special_tokens=False).input_ids)  # type: ignore[operator]
            # A word the tokenizer spells with no token cannot be generated (and the worker masks a last token).
            sequences.extend(s for s in (bare, [] if spaced == bare else spaced) if s)
        return sequences

    def _check_in_vocabulary(self, field: str, token_ids: list[int]) -> None:
        bad = [t for t in token_ids if t >= self.limits.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"{field} contains ids outside the vocabulary (size {self.limits.vocab_size}): {bad[:5]}"
            )


def request_digest(prompt_token_ids: list[int], sampling: SamplingParams) -> str:
    """SHA-256 of what decides a request's output: its prompt tokens and validated sampling parameters.

    Taken after tokenization and validation, so a text prompt and its token ids, or an unset field and
    its default, are the same request; `resumable` and tracing context are not part of it.
    """
    identity = state_pb2.AdmittedRequest(prompt_token_ids=prompt_token_ids, sampling=sampling_to_proto(sampling))
    return hashlib.sha256(identity.SerializeToString(deterministic=True)).hexdigest()


def to_record(
    admitted: AdmittedPrompt, seq_ids: list[int], worker_id: str, arrival_time: float
) -> state_pb2.AdmittedRequest:
    """The protobuf record stored in Redis and read by the engine loop."""
    return state_pb2.AdmittedRequest(
        request_id=admitted.request_id,
        prompt_token_ids=admitted.prompt_token_ids,
        sampling=sampling_to_proto(admitted.sampling),
        arrival_time=arrival_time,
        seq_ids=seq_ids,
        worker_id=worker_id,
    )

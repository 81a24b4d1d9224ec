"""Incremental detokenization (vLLM's prefix/read offsets); the stop rules are in core/stop_checker.py.

Turns a growing list of token ids into text deltas without re-decoding the whole sequence every step,
and without ever emitting half a UTF-8 character (byte-level BPE splits emoji and CJK characters
across several tokens).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

# Prompt tokens kept as decoding context, as in vLLM: enough for the tokenizer to see word boundaries
# (e.g. SentencePiece's leading space) at the start of the output without re-decoding the whole prompt.
_INITIAL_PREFIX_TOKENS = 5

# What decoding yields for an incomplete UTF-8 sequence.
_REPLACEMENT_CHAR = "\ufffd"


class _Tokenizer(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    """Detokenizes one sequence's output as tokens arrive.

    Tokens before read_offset have been turned into text; decoding starts at prefix_offset so the text
    of the pending tokens is computed in context (new text = decode(tokens[prefix:]) minus
    decode(tokens[prefix:read])). Text is held back while it ends with U+FFFD, i.e. mid-character.

    spaces_between_special_tokens: vLLM's rule (detokenize_incrementally). A slow (Python) tokenizer with
    added tokens decodes the runs of ordinary tokens and the added tokens between them separately and
    joins the pieces with a space (or nothing when False); a fast tokenizer, or one without added tokens,
    decodes as the tokenizer does whatever the flag says.
    """

    def __init__(self, tokenizer: _Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._pieces = _AddedTokenSplitter.of(tokenizer, skip_special_tokens, spaces_between_special_tokens)
        self._backend_decode = _backend_decode(tokenizer)
        self._token_ids: list[int] = list(prompt_token_ids)
        self.read_offset = len(self._token_ids)
        self.prefix_offset = max(self.read_offset - _INITIAL_PREFIX_TOKENS, 0)
        self.output_text = ""

    def step(self, new_token_ids: list[int]) -> str:
        """Add generated tokens; return the newly decodable text (may be "")."""
        pieces = []
        # One token at a time, so a multi-token step emits exactly the text of the same tokens over several steps.
        for token_id in new_token_ids:
            self._token_ids.append(token_id)
            pieces.append(self._decode_newest())
        new_text = "".join(pieces)
        self.output_text += new_text
        return new_text

    def truncate(self, length: int) -> None:
        """Cut output_text to length characters (after a stop; the sequence is done)."""
        if not 0 <= length <= len(self.output_text):
            raise ValueError(f"length must be in [0, {len(self.output_text)}], got {length}.")
        self.output_text = self.output_text[:length]

    def _decode(self, token_ids: list[int]) -> str:
        if self._pieces is not None:
            return self._pieces.decode(token_ids)
        if self._backend_decode is not None:
            return self._backend_decode(token_ids, self._skip_special_tokens)
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)

    def _decode_newest(self) -> str:
        prefix_text = self._decode(self._token_ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self._token_ids[self.prefix_offset :])
        # Shorter or equal: a skipped special token. Trailing U+FFFD: the newest bytes do not complete a
        # character yet; retry with more tokens.
        if len(full_text) <= len(prefix_text) or full_text.endswith(_REPLACEMENT_CHAR):
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self._token_ids)
        return full_text[len(prefix_text) :]


def _backend_decode(tokenizer: object) -> Callable[[list[int], bool], str] | None:
    """The Rust tokenizer's own decode where transformers' decode of `tokenizer` is only that call: a fast
    tokenizer whose class keeps transformers' decode methods and does not clean up spaces afterwards; None
    otherwise (the tokenizer's decode is used). Every token is decoded twice (above); transformers' wrapper took
    ~1.5 us a call around the ~0.8 us decode, a fifth of a 64-sequence step's output processing."""
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        return None
    cls = type(tokenizer)
    if not isinstance(tokenizer, PreTrainedTokenizerFast) or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return None
    if cls.decode is not PreTrainedTokenizerFast.decode or cls._decode is not PreTrainedTokenizerFast._decode:
        return None
    return tokenizer.backend_tokenizer.decode


class _AddedTokenSplitter:
    """Decodes as vLLM does for slow tokenizers with added tokens: each added token stands alone, the runs of
    ordinary tokens between them are decoded together, and the pieces are joined with `separator`."""

    def __init__(self, tokenizer: object, added: set[str], skipped: set[str], separator: str) -> None:
        self._tokenizer = tokenizer
        self._added = added
        self._skipped = skipped
        self._separator = separator

    @classmethod
    def of(cls, tokenizer: object, skip_special_tokens: bool, spaces_between_special_tokens: bool
           ) -> _AddedTokenSplitter | None:
        """The splitter for a slow tokenizer with added tokens; None where the tokenizer's decode is used."""
        if getattr(tokenizer, "is_fast", True):
            return None
        added = set(tokenizer.get_added_vocab())  # type: ignore[attr-defined]
        if not added:
            return None
        skipped = set(tokenizer.all_special_tokens) if skip_special_tokens else set()  # type: ignore[attr-defined]
        return cls(tokenizer, added, skipped, " " if spaces_between_special_tokens else "")

    def decode(self, token_ids: list[int]) -> str:
        tok = self._tokenizer
        # An id outside the vocabulary has no token (None): it decodes to nothing, as in vLLM.
        tokens = [t or "" for t in tok.convert_ids_to_tokens(token_ids)]  # type: ignore[attr-defined]
        pieces: list[str] = []
        run: list[str] = []
        for token in tokens:
            if token in self._skipped:
                continue
            if token in self._added:
                if run:
                    pieces.append(tok.convert_tokens_to_string(run))  # type: ignore[attr-defined]
                    run = []
                pieces.append(token)
            else:
                run.append(token)
        if run:
            pieces.append(tok.convert_tokens_to_string(run))  # type: ignore[attr-defined]
        return self._separator.join(pieces)

"""Token masks of structured outputs: one llguidance matcher per constrained sequence.

A matcher's state is a function of the sequence's output tokens and nothing else: before each mask
it consumes the outputs it has not seen (`_sync`). So nothing is saved or sent when a sequence is
preempted, swapped, recomputed or taken over by a new scheduler: the worker entry that holds the
matcher is rebuilt from the plan's tokens and the matcher catches up from them. The sampled token
itself is consumed at the next step, where the sequence's tokens say it was kept.

A matcher that finished its grammar (or met a token it refuses, which the mask makes impossible but
a bug would not) allows only EOS, so the sequence ends there with finish reason "stop".
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from shared.sampling_params import SamplingParams
from shared.tokenizer_loading import load_tokenizer

log = logging.getLogger(__name__)


class ConstrainedSequence(Protocol):
    """What the masks read of a worker's sequence (CachedSequence)."""

    seq_id: int
    token_ids: list[int]
    num_prompt_tokens: int
    sampling: SamplingParams
    grammar: Any


@dataclass
class GrammarState:
    """A sequence's matcher and how many of its outputs it consumed."""

    matcher: Any
    num_consumed: int = 0
    failed: bool = False


@dataclass
class TokenMasks:
    """Allowed tokens of some rows of a step's logits: rows[i]'s mask is bitmask[i] (bit t of word t // 32)."""

    rows: list[int]
    bitmask: torch.Tensor


class GrammarMasks:
    """Builds each step's masks for the rows whose sequences have a structured output.

    The llguidance tokenizer (the model's tokenizer, ~0.5 s to build) is made on the first constrained
    sequence: a worker that never serves one never pays for it.
    """

    def __init__(self, model_path: str, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self._model_path = model_path
        self._vocab_size = vocab_size
        self._eos_token_ids = list(eos_token_ids)
        self._tokenizer: Any = None
        self._executor: Any = None
        self._lock = threading.Lock()

    def masks(self, seqs: Sequence[ConstrainedSequence]) -> TokenMasks | None:
        """Masks for the rows of `seqs` (a step's sampled sequences, in row order) that are constrained."""
        rows = [i for i, s in enumerate(seqs) if s.sampling.structured_outputs is not None]
        if not rows:
            return None
        states = [self._sync(seqs[i]) for i in rows]
        words = -(-self._vocab_size // 32)
        bitmask = torch.full((len(rows), words), -1, dtype=torch.int32)
        matchers = [(state.matcher, j) for j, state in enumerate(states) if state.matcher is not None]
        if matchers:
            # One call for every row: llguidance computes the masks on its own threads, without the GIL, straight
            # into the tensor (what llguidance.torch's fill_next_token_bitmask_par does; importing that module
            # sets up torch.compile, ~3.6 s).
            self._executor.unsafe_compute_mask_ptr(matchers, bitmask.data_ptr(), words * 4, len(rows))
        for j, state in enumerate(states):
            if state.matcher is None:
                bitmask[j] = self._eos_only()
        return TokenMasks(rows, bitmask)

    def _eos_only(self) -> torch.Tensor:
        words = [0] * -(-self._vocab_size // 32)
        for eos in self._eos_token_ids:
            words[eos // 32] |= 1 << (eos % 32)
        # As signed 32-bit words, llguidance's layout: bit 31 is the sign bit.
        return torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32)

    def _sync(self, seq: ConstrainedSequence) -> GrammarState:
        """The sequence's matcher, made if needed, having consumed every output token."""
        state: GrammarState | None = seq.grammar
        if state is None:
            compiled = seq.sampling.structured_outputs.compiled  # type: ignore[union-attr] # constrained rows only
            state = seq.grammar = self._new_state(seq.seq_id, compiled)
        matcher, tokens = state.matcher, seq.token_ids
        if matcher is None:
            return state
        # Indexing, not slicing: a decode step consumes one token, whatever the length of the output.
        for at in range(seq.num_prompt_tokens + state.num_consumed, len(tokens)):
            if matcher.is_stopped():
                break  # EOS sampled under ignore_eos: the grammar is complete, only EOS stays allowed
            if not matcher.consume_token(tokens[at]) and not state.failed:
                state.failed = True
                log.error("sequence %d: its grammar refused token %d (%s); only EOS is allowed from here",
                          seq.seq_id, tokens[at], matcher.get_error())
        state.num_consumed = len(tokens) - seq.num_prompt_tokens
        return state

    def _new_state(self, seq_id: int, compiled: str) -> GrammarState:
        """A fresh matcher; where none can be made, a state that allows only EOS (the request ends, the step runs).

        Admission validated the grammar with the same library, so a failure here is the worker's own (a
        tokenizer it cannot load): the sequence stops at once and the log says why, instead of a step that
        fails for every sequence of the batch, again and again.
        """
        import llguidance  # noqa: PLC0415

        try:
            matcher = llguidance.LLMatcher(self._llg_tokenizer(), compiled)
        except Exception:  # noqa: BLE001 - logged with its traceback, and the sequence ends
            log.exception("sequence %d: no grammar matcher could be made; only EOS is allowed", seq_id)
            return GrammarState(None, failed=True)
        if matcher.is_error():  # a matcher in error allows only EOS
            log.error("sequence %d: its grammar does not compile (%s); only EOS is allowed", seq_id, matcher.get_error())
        return GrammarState(matcher, failed=matcher.is_error())

    def _llg_tokenizer(self) -> Any:
        with self._lock:
            if self._tokenizer is None:
                import llguidance  # noqa: PLC0415
                import llguidance.hf  # noqa: PLC0415

                start = time.perf_counter()
                hf = load_tokenizer(self._model_path)
                eos = self._eos_token_ids or None
                self._tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=self._vocab_size, eos_token=eos)
                self._executor = llguidance.LLExecutor()
                log.info("structured outputs: the grammar tokenizer took %.2f s to build", time.perf_counter() - start)
            return self._tokenizer

"""Pure stop rules: when a sequence finishes after a token, and what text may stream.

Works on token ids and already-detokenized text, so it needs no tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler_service.core.sequence import Sequence, SequenceStatus
from shared.sampling_params import SamplingParams
from shared.text_tails import prefix_tail_length


@dataclass(frozen=True)
class StopDecision:
    """Outcome of check_stop.

    status: FINISHED_STOPPED or FINISHED_LENGTH when finished, else None.
    reason: the stop string or stop token id that matched (as vLLM's stop_reason); None for EOS, length limits
        and when not finished.
    truncate_text_to: cut output_text to this many characters (stop string or stop token text must not be
        returned); None keeps it as is.
    """

    finished: bool
    status: SequenceStatus | None = None
    reason: str | int | None = None
    truncate_text_to: int | None = None

    def __post_init__(self) -> None:
        if self.finished != (self.status is not None):
            raise ValueError(f"status must be set exactly when finished, got {self.status!r}.")
        if self.status is not None and not self.status.is_finished:
            raise ValueError(f"status must be a FINISHED_* status, got {self.status.name}.")


CONTINUE = StopDecision(finished=False)


def check_stop(
    seq: Sequence,
    params: SamplingParams,
    *,
    output_text: str,
    num_new_chars: int,
    eos_token_id: int | None,
    max_model_len: int,
) -> StopDecision:
    """Decide whether seq finishes now that its newest token was appended.

    output_text is the detokenized output so far, including the num_new_chars characters the newest token
    produced. Rules in priority order: EOS (unless ignore_eos) and stop_token_ids, whose text is dropped; stop
    strings, cutting the text just before the match; max_tokens and max_model_len, as FINISHED_LENGTH. With
    include_stop_str_in_output the stop token's text stays and a stop string is cut after its end instead.
    Before min_tokens outputs only the length limits apply (as vLLM), except for a request with a hard constraint
    (structured outputs, allowed_token_ids): the worker masks EOS and stop_token_ids until min_tokens, so a stop
    token it sampled earlier is all the constraint left (a finished grammar, allowed ids that are all stop tokens);
    min_tokens cannot be met, and every further token would be that one again, so it ends the output.
    """
    if not seq.output_token_ids:
        raise ValueError(f"seq {seq.seq_id} has no output token to check.")
    if not 0 <= num_new_chars <= len(output_text):
        raise ValueError(f"num_new_chars must be in [0, {len(output_text)}], got {num_new_chars}.")
    num_outputs = len(seq.output_token_ids)
    # Only the constraints can override the worker's min_tokens mask; elsewhere an early EOS would be one the worker
    # does not mask (a tokenizer's EOS missing from the generation config's), and the output goes on.
    if num_outputs >= params.min_tokens or params.structured_outputs is not None or params.allowed_token_ids:
        decision = _check_stop_tokens_and_strings(seq.last_token_id, params, output_text, num_new_chars,
                                                  eos_token_id, strings=num_outputs >= params.min_tokens)
        if decision is not None:
            return decision
    if (params.max_tokens is not None and num_outputs >= params.max_tokens) or seq.num_tokens >= max_model_len:
        return StopDecision(True, SequenceStatus.FINISHED_LENGTH)
    return CONTINUE


def _check_stop_tokens_and_strings(
    token_id: int, params: SamplingParams, output_text: str, num_new_chars: int, eos_token_id: int | None,
    strings: bool = True,
) -> StopDecision | None:
    keep = params.include_stop_str_in_output
    # The text this token produced (if any) is not part of the answer, unless asked for.
    drop_new_text = len(output_text) - num_new_chars if num_new_chars and not keep else None
    if not params.ignore_eos and eos_token_id is not None and token_id == eos_token_id:
        return StopDecision(True, SequenceStatus.FINISHED_STOPPED, None, drop_new_text)
    if token_id in params.stop_token_ids:
        return StopDecision(True, SequenceStatus.FINISHED_STOPPED, token_id, drop_new_text)
    match = find_stop_string(output_text, num_new_chars, params.stop) if strings else None
    if match is None:
        return None
    stop_str, index = match
    # Text after the stop string (in the same token) is dropped either way.
    end = index + len(stop_str) if keep else index
    return StopDecision(True, SequenceStatus.FINISHED_STOPPED, stop_str, end if end < len(output_text) else None)


def find_stop_string(output_text: str, num_new_chars: int, stop: list[str]) -> tuple[str, int] | None:
    """Earliest stop string that ends inside the newest num_new_chars characters.

    Older text was searched on earlier tokens, so a new match must overlap the new text: each string is only
    searched from len(stop_str) - 1 characters before it. Returns (stop_str, start index) or None; ties go to
    the string listed first.
    """
    if not num_new_chars or not stop:
        return None
    best: tuple[str, int] | None = None
    for stop_str in stop:
        start = max(0, len(output_text) - num_new_chars - len(stop_str) + 1)
        index = output_text.find(stop_str, start)
        if index != -1 and (best is None or index < best[1]):
            best = (stop_str, index)
    return best


def held_back_stop_strings(params: SamplingParams) -> list[str]:
    """Stop strings whose possible beginnings are held back while streaming: none when a matched stop string is
    part of the output anyway (include_stop_str_in_output), as vLLM."""
    return [] if params.include_stop_str_in_output else params.stop


def streamable_text_length(output_text: str, stop: list[str], finished: bool) -> int:
    """How many leading characters of output_text may be sent to the client.

    While running, a tail that could be the beginning of a stop string is held back until later tokens show it
    is not one. This holds back only the longest tail that is a proper prefix of some stop string (never more
    than len(longest stop) - 1 characters, vLLM's fixed hold-back), so the result never decreases and never
    exceeds where a later stop match would cut.
    """
    if finished or not stop:
        return len(output_text)
    return len(output_text) - prefix_tail_length(output_text, stop)

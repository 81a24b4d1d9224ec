"""One step of beam search: which beams continue, which finish, when the search stops.

Pure and id-based; the output processor applies the result to the scheduler (frees beams without a surviving
child, forks parents with several, adds the finished hypotheses). The rules are those of transformers'
``generate(num_beams=width, do_sample=False)``, so outputs match it token for token:

- every running beam offers its most likely next tokens; a candidate's score is the beam's cumulative logprob
  plus the token's, summed in float32 as transformers does (ties then break the same way);
- of the best ``num_candidates`` candidates overall, those ranked below ``width`` that end the beam (a stop
  token, or the length limit) become finished hypotheses scored ``cumulative / generated_len ** length_penalty``;
  only the ``width`` best hypotheses are kept;
- the ``width`` best candidates that do not end continue as the running beams;
- the search stops when every candidate ends, when ``width`` hypotheses exist and ``early_stopping`` is True,
  or when the best running beam can no longer beat the worst kept hypothesis (scored at its current length;
  with ``early_stopping="never"`` and a positive length penalty, at the longest length it could reach).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class BeamParams:
    """What a request asks of its beam search."""

    width: int
    length_penalty: float
    early_stopping: bool | str
    # Tokens that end a beam (EOS, unless ignored, and the request's stop_token_ids).
    stop_token_ids: frozenset[int]
    # Generated tokens at which a beam ends (max_tokens, or what max_model_len leaves).
    max_generated: int
    # Candidates ranked per step, as transformers: (1 + number of stop tokens) * width, at least 2 * width.
    num_candidates: int


@dataclass(frozen=True)
class RunningBeam:
    """A beam that computed its last token this step, with the worker's best next tokens for it."""

    seq_id: int
    cumulative_logprob: float
    # (token id, logprob), most likely first.
    candidates: list[tuple[int, float]]


@dataclass(frozen=True)
class Hypothesis:
    """A finished beam."""

    seq_id: int
    cumulative_logprob: float
    num_generated: int


@dataclass(frozen=True)
class BeamChild:
    """A running beam's continuation: parent + token."""

    parent_id: int
    token_id: int
    cumulative_logprob: float


@dataclass(frozen=True)
class BeamStep:
    """The outcome of one step."""

    # The next running beams, best first (empty when done).
    running: list[BeamChild]
    # New finished hypotheses (parent + stop token or last token), best first.
    finished: list[BeamChild]
    # Earlier hypotheses pushed out of the best `width`.
    dropped_hypotheses: list[int]
    done: bool


def hypothesis_score(cumulative_logprob: float, num_generated: int, length_penalty: float) -> float:
    """Length-penalized score of a finished beam (float32, as transformers computes it)."""
    return float(np.float32(cumulative_logprob) / np.float32(float(num_generated) ** length_penalty))


def beam_step(
    params: BeamParams, beams: list[RunningBeam], hypotheses: list[Hypothesis], num_generated: int
) -> BeamStep:
    """Advance a beam search by one token.

    beams: the running beams, best cumulative logprob first (a single one, the prompt, at the first step); all
    have generated num_generated tokens.
    """
    if not beams:
        raise ValueError("beam_step needs at least one running beam.")
    width, penalty = params.width, params.length_penalty
    # Every candidate of every beam, ranked; the beam index breaks ties like a flattened top-k would.
    pool = [
        (np.float32(np.float32(beam.cumulative_logprob) + np.float32(logprob)), index, token, beam.seq_id)
        for index, beam in enumerate(beams)
        for token, logprob in beam.candidates
    ]
    pool.sort(key=lambda c: (-c[0], c[1], c[2]))
    top = pool[: params.num_candidates]
    new_len = num_generated + 1
    at_limit = new_len >= params.max_generated

    def ends(token: int) -> bool:
        return at_limit or token in params.stop_token_ids

    running = [BeamChild(parent, token, float(total)) for total, _, token, parent in top if not ends(token)][:width]

    kept = sorted(((hypothesis_score(h.cumulative_logprob, h.num_generated, penalty), True, h) for h in hypotheses),
                  key=lambda item: -item[0])
    new_finished: list[BeamChild] = []
    dropped: list[int] = []
    if not (len(kept) >= width and params.early_stopping is True):
        candidates = [
            (hypothesis_score(float(total), new_len, penalty), False, BeamChild(parent, token, float(total)))
            for rank, (total, _, token, parent) in enumerate(top)
            if rank < width and ends(token)
        ]
        # Earlier hypotheses first: on equal scores the one already kept stays.
        merged = sorted(kept + candidates, key=lambda item: -item[0])[:width]
        kept_ids = {id(item) for item in merged}
        new_finished = [item[2] for item in merged if not item[1]]
        dropped = [item[2].seq_id for item in kept if id(item) not in kept_ids]
        kept = merged

    full = len(kept) >= width
    done = not running or all(ends(token) for _, _, token, _ in top) or (full and params.early_stopping is True)
    if not done and full:
        best_len = params.max_generated if params.early_stopping == "never" and penalty > 0.0 else new_len
        best_possible = hypothesis_score(running[0].cumulative_logprob, best_len, penalty)
        done = not best_possible > min(score for score, _, _ in kept)
    return BeamStep([] if done else running, new_finished, dropped, done)

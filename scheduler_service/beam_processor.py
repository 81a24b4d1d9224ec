"""Applies beam-search steps to the scheduler and the step's Redis commit.

vLLM's original mechanism: the worker returns, for each beam, its most likely next tokens (top_logprobs);
core.beam_search picks the next beams; here the beams without a surviving child leave the group (blocks
freed), a parent with several children continues as the first and is forked for the others (its blocks
shared, the last one copied on write when it grows), and finished hypotheses join the group as finished
sequences without blocks.

A request owns 2 * best_of sequence ids (SamplingParams.num_sequences): at most best_of running beams and
best_of hypotheses exist at once, so the ids of dropped beams are reused. A reused id is wiped in Redis and
forgotten by the worker in the same commit and plan that introduce its new sequence.

Everything a new owner needs to continue is in Redis: each live beam's and hypothesis's tokens, status and
cumulative logprob. A sequence id with no tokens and no status is unused (restore_beam_ids).
"""

from __future__ import annotations

from dataclasses import dataclass

from protos import generation_pb2
from scheduler_service.core.beam_search import BeamParams, Hypothesis, RunningBeam, beam_step, hypothesis_score
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.core.scheduler_output import ScheduledSequence
from scheduler_service.core.sequence import Sequence, SequenceGroup, SequenceStatus
from scheduler_service.detokenizer import IncrementalDetokenizer
from scheduler_service.request_state import FINISH_REASONS, RequestState, stop_fields
from scheduler_service.store import StepCommit
from shared.sampling_params import SamplingParams


@dataclass
class PendingFork:
    """A child to fork from its parent once the step's tokens are appended."""

    group: SequenceGroup
    parent: Sequence
    child: Sequence


def restore_beam_ids(seq_ids: list[int], outputs: dict[int, list[int]], finished: dict[int, str]) -> list[int]:
    """The ids of a beam search's live sequences: those with tokens or a status; the first alone at the start."""
    live = [seq_id for seq_id in seq_ids if outputs.get(seq_id) or seq_id in finished]
    return live or seq_ids[:1]


def beam_params(params: SamplingParams, prompt_len: int, max_seq_len: int, eos_token_id: int | None) -> BeamParams:
    stop = set(params.stop_token_ids)
    if eos_token_id is not None and not params.ignore_eos:
        stop.add(eos_token_id)
    width = params.best_of or params.n
    max_generated = max_seq_len - prompt_len
    if params.max_tokens is not None:
        max_generated = min(max_generated, params.max_tokens)
    return BeamParams(
        width=width,
        length_penalty=params.length_penalty,
        early_stopping=params.early_stopping,
        stop_token_ids=frozenset(stop),
        max_generated=max(max_generated, 1),
        num_candidates=max(2, 1 + len(stop)) * width,
    )


class BeamProcessor:
    """Runs the beam step of every beam-search group that sampled in a step."""

    def __init__(self, scheduler: Scheduler, eos_token_id: int | None) -> None:
        self._scheduler = scheduler
        self._eos_token_id = eos_token_id

    def step(self, state: RequestState, items: list[ScheduledSequence], candidates: dict[int, list[tuple[int, float]]],
             sampled: dict[int, int], commit: StepCommit) -> list[PendingFork]:
        """One beam step for the request, whose beams in `items` just computed their last token.

        Edits `sampled` (the token each continuing beam appends; dropped beams removed) for
        update_after_step, and returns the forks to make after it.
        """
        group, cumulative = state.group, state.cumulative
        prompt = group.seqs[0].prompt_token_ids
        params = beam_params(group.sampling_params, len(prompt), self._scheduler.max_seq_len, self._eos_token_id)
        by_id = {s.seq_id: s for s in group.seqs}
        # Best first; ties keep the group's order (a stable sort).
        beams = sorted((item.seq for item in items), key=lambda s: -cumulative.get(s.seq_id, 0.0))
        running = [RunningBeam(s.seq_id, cumulative.get(s.seq_id, 0.0), candidates[s.seq_id]) for s in beams]
        hypotheses = [Hypothesis(s.seq_id, cumulative.get(s.seq_id, 0.0), len(s.output_token_ids))
                      for s in group.seqs if s.is_finished]
        result = beam_step(params, running, hypotheses, len(beams[0].output_token_ids))

        continuing: dict[int, int] = {}
        extra = []
        for child in result.running:
            if child.parent_id in continuing:
                extra.append(child)
            else:
                continuing[child.parent_id] = child.token_id
                cumulative[child.parent_id] = child.cumulative_logprob
        drop = [s for s in beams if s.seq_id not in continuing]
        drop += [by_id[seq_id] for seq_id in result.dropped_hypotheses]
        for seq in drop:
            sampled.pop(seq.seq_id, None)
            cumulative.pop(seq.seq_id, None)
        kept = {s.seq_id for s in group.seqs} - {s.seq_id for s in drop}
        free_ids = iter(seq_id for seq_id in state.record.seq_ids if seq_id not in kept)
        request_id = group.request_id

        new_hypotheses = []
        for child in result.finished:
            outputs = by_id[child.parent_id].output_token_ids + [child.token_id]
            stopped = child.token_id in params.stop_token_ids
            status = SequenceStatus.FINISHED_STOPPED if stopped else SequenceStatus.FINISHED_LENGTH
            seq = Sequence(next(free_ids), prompt, outputs, status=status)
            new_hypotheses.append(seq)
            cumulative[seq.seq_id] = child.cumulative_logprob
            commit.new_tokens[seq.seq_id] = outputs
            commit.finished_seqs.setdefault(request_id, {})[seq.seq_id] = status.name
        forks = []
        for child in extra:
            parent = by_id[child.parent_id]
            seq = Sequence(next(free_ids), prompt, parent.output_token_ids + [child.token_id])
            forks.append(PendingFork(group, parent, seq))
            cumulative[seq.seq_id] = child.cumulative_logprob
            commit.new_tokens[seq.seq_id] = seq.output_token_ids

        # Wiped before this commit's writes: a reused id's new tokens land in an empty list.
        commit.reset_seqs.setdefault(request_id, []).extend(s.seq_id for s in drop)
        for seq_id, token in continuing.items():
            sampled[seq_id] = token
            commit.new_tokens[seq_id] = [token]
        self._scheduler.replace_beams(group, drop, new_hypotheses)
        commit.cumulative_logprobs[request_id] = dict(cumulative)
        return forks

    def final_outputs(
        self, state: RequestState, tokenizer: object, msg: generation_pb2.GenerateResponse
    ) -> list[Sequence]:
        """The n best hypotheses, best first, as the request's outputs."""
        group = state.group
        params = group.sampling_params
        prompt = group.seqs[0].prompt_token_ids
        best = sorted(
            (s for s in group.seqs if s.is_finished and s.status is not SequenceStatus.FINISHED_ABORTED),
            key=lambda s: -hypothesis_score(state.cumulative.get(s.seq_id, 0.0), len(s.output_token_ids),
                                            params.length_penalty),
        )[: params.n]
        for index, seq in enumerate(best):
            detokenizer = IncrementalDetokenizer(tokenizer, prompt, params.skip_special_tokens,  # type: ignore[arg-type]
                                                 params.spaces_between_special_tokens)
            detokenizer.step(seq.output_token_ids)
            last = seq.output_token_ids[-1] if seq.output_token_ids else None
            msg.outputs.add(
                index=index, text=detokenizer.output_text, token_ids=seq.output_token_ids,
                finish_reason=FINISH_REASONS[seq.status],
                **stop_fields(last if last in params.stop_token_ids else None),
            )
        return best

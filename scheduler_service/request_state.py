"""What the output processor keeps per live request: streaming state, prompt logprobs, final ranking."""

from __future__ import annotations

from dataclasses import dataclass, field

from protos import common_pb2, generation_pb2, state_pb2, worker_pb2
from scheduler_service.core.sequence import Sequence, SequenceGroup, SequenceStatus
from scheduler_service.detokenizer import IncrementalDetokenizer

FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: common_pb2.FINISH_REASON_STOP,
    SequenceStatus.FINISHED_LENGTH: common_pb2.FINISH_REASON_LENGTH,
    SequenceStatus.FINISHED_ABORTED: common_pb2.FINISH_REASON_ABORT,
    SequenceStatus.FINISHED_IGNORED: common_pb2.FINISH_REASON_ERROR,
}
# vLLM's finished_reason label values.
REASON_LABELS = {
    SequenceStatus.FINISHED_STOPPED: "stop", SequenceStatus.FINISHED_LENGTH: "length",
    SequenceStatus.FINISHED_ABORTED: "abort", SequenceStatus.FINISHED_IGNORED: "error",
}


def stop_fields(reason: str | int | None) -> dict[str, object]:
    """A CompletionDelta's fields for what stopped its sequence: a stop string, or a stop token id (also as text)."""
    if reason is None:
        return {}
    if isinstance(reason, int):
        return {"stop_reason": str(reason), "stop_token_id": reason}
    return {"stop_reason": reason}


@dataclass
class SeqOutput:
    """Per-sequence streaming state."""

    index: int
    detokenizer: IncrementalDetokenizer
    sent_chars: int = 0
    # The stop string or stop token id that ended the sequence (StopDecision.reason).
    stop_reason: str | int | None = None


@dataclass
class RequestState:
    """One live request of an engine loop."""

    record: state_pb2.AdmittedRequest
    group: SequenceGroup
    # seq id -> sum of its sampled tokens' logprobs: ranks the sequences when best_of > n, and the beams
    # and hypotheses of a beam search (only its live sequences have one).
    cumulative: dict[int, float]
    # Per-sequence streaming state; none for beam search, which streams nothing before the end.
    seqs: dict[int, SeqOutput] = field(default_factory=dict)
    # Steps of this request that a worker failed; past MAX_WORKER_FAILURES it ends with an error.
    worker_failures: int = 0
    # prompt_logprobs requests: prompt index -> entry, gathered over the prefill's chunks until the
    # first response takes them (after which `prompt_logprobs_sent`).
    prompt_logprobs: dict[int, common_pb2.TokenLogprobs] = field(default_factory=dict)
    prompt_logprobs_sent: bool = False
    # Whether the request's stream has a message already: its first one carries the prompt's token ids.
    first_sent: bool = False

    def mark_first(self, msg: generation_pb2.GenerateResponse) -> None:
        """Gives msg the prompt's token ids when it is the first message of the request's stream."""
        if not self.first_sent:
            msg.prompt_token_ids.extend(self.record.prompt_token_ids)
            self.first_sent = True

    def gather_prompt_logprobs(self, piece: worker_pb2.PromptLogprobs) -> None:
        """Keeps prompt logprobs a step computed, by prompt index, until the first response takes them.

        A prefill recomputed after a preemption sends some again: same values, overwritten.
        """
        if not self.prompt_logprobs_sent:
            self.prompt_logprobs.update(enumerate(piece.positions, piece.start))

    def attach_prompt_logprobs(self, msg: generation_pb2.GenerateResponse) -> None:
        """The request's first response with outputs carries its prompt logprobs."""
        if self.group.sampling_params.prompt_logprobs is None or self.prompt_logprobs_sent:
            return
        gathered = self.prompt_logprobs
        # Indices form one run ending at the last prompt token: prefills advance in order, and only
        # a leading run of prefix-cached tokens is never computed.
        msg.prompt_logprobs_start = min(gathered, default=len(self.record.prompt_token_ids))
        msg.prompt_logprobs.extend(gathered[i] for i in sorted(gathered))
        self.prompt_logprobs_sent = True
        self.prompt_logprobs = {}

    def best(self, msg: generation_pb2.GenerateResponse) -> list[Sequence]:
        """best_of > n: the n most likely sequences, whole, added to msg as the request's only outputs."""
        group = self.group
        best = sorted(group.seqs, key=lambda s: self.cumulative[s.seq_id], reverse=True)[: group.sampling_params.n]
        for index, seq in enumerate(best):
            out = self.seqs[seq.seq_id]
            msg.outputs.add(
                index=index, text=out.detokenizer.output_text, token_ids=seq.output_token_ids,
                finish_reason=FINISH_REASONS[seq.status], **stop_fields(out.stop_reason),
            )
        return best

"""Sequences (one token stream each) and sequence groups (one request each)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from shared.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    """Lifecycle of a sequence: WAITING covers new sequences and ones preempted by recompute; SWAPPED ones were
    preempted by swapping their KV blocks out to CPU memory (not finished)."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    SWAPPED = enum.auto()
    FINISHED_STOPPED = enum.auto()  # EOS, stop token or stop string
    FINISHED_LENGTH = enum.auto()  # max_tokens or max_model_len reached
    FINISHED_ABORTED = enum.auto()  # client cancelled
    FINISHED_IGNORED = enum.auto()  # could never be scheduled (too long)

    @property
    def is_finished(self) -> bool:
        """True for every FINISHED_* status."""
        return self not in (SequenceStatus.WAITING, SequenceStatus.RUNNING, SequenceStatus.SWAPPED)


def _validate_token_ids(name: str, token_ids: list[int]) -> None:
    for token_id in token_ids:
        if not isinstance(token_id, int) or isinstance(token_id, bool) or token_id < 0:
            raise ValueError(f"{name} must hold non-negative ints, got {token_id!r}.")


# eq=False: sequences and groups are mutable entities compared by identity
# (queue membership tests must never match a different request by value).
@dataclass(eq=False)
class Sequence:
    """One stream of tokens: the prompt followed by what has been generated.

    num_computed_tokens counts leading tokens whose KV is in the cache; the next step that schedules this
    sequence computes the rest.

    num_inflight_tokens counts tokens sampled by a step whose result has not come back yet (the engine plans
    the next step while the worker runs this one, see Scheduler.advance): they count in num_tokens, so the next
    step is planned as if they were known, but not in the token lists, which hold known tokens only.
    """

    seq_id: int
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    num_inflight_tokens: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.seq_id, int) or isinstance(self.seq_id, bool) or self.seq_id < 0:
            raise ValueError(f"seq_id must be a non-negative int, got {self.seq_id!r}.")
        if not self.prompt_token_ids:
            raise ValueError(f"prompt_token_ids must not be empty (seq_id={self.seq_id}).")
        # Copies: callers often reuse the lists they built the request from.
        self.prompt_token_ids = list(self.prompt_token_ids)
        self.output_token_ids = list(self.output_token_ids)
        _validate_token_ids("prompt_token_ids", self.prompt_token_ids)
        _validate_token_ids("output_token_ids", self.output_token_ids)
        if not isinstance(self.num_inflight_tokens, int) or self.num_inflight_tokens < 0:
            raise ValueError(f"num_inflight_tokens must be a non-negative int, got {self.num_inflight_tokens!r}.")
        # In-flight tokens count: a step decoding one of them has computed the ones before it.
        if not 0 <= self.num_computed_tokens <= self.num_tokens:
            raise ValueError(
                f"num_computed_tokens must be in [0, {self.num_tokens}], "
                f"got {self.num_computed_tokens} (seq_id={self.seq_id})."
            )
        if not isinstance(self.status, SequenceStatus):
            raise ValueError(f"status must be a SequenceStatus, got {self.status!r}.")

    @property
    def num_tokens(self) -> int:
        """Prompt plus output length, in-flight tokens included."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_inflight_tokens

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt followed by the known output tokens (a new list)."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens whose KV is not in the cache yet."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def last_token_id(self) -> int:
        """The newest token: last output token, or last prompt token before any output."""
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def is_finished(self) -> bool:
        """True once the sequence reached any FINISHED_* status."""
        return self.status.is_finished

    def append_token(self, token_id: int) -> None:
        """Append one generated token (its KV is computed by the next step)."""
        _validate_token_ids("token_id", [token_id])
        self.output_token_ids.append(token_id)

    def resolve_inflight_token(self, token_id: int | None) -> None:
        """The step in flight came back: its token becomes known (appended), or is dropped (None)."""
        if self.num_inflight_tokens < 1:
            raise ValueError(f"seq {self.seq_id} has no token in flight.")
        if token_id is not None:
            self.append_token(token_id)
        self.num_inflight_tokens -= 1

    def reset_for_recompute(self) -> None:
        """Forget the KV cache after preemption by recompute. Output tokens are kept: the next prefill
        recomputes prompt + outputs, so generation resumes exactly where it stopped."""
        self.num_computed_tokens = 0
        self.status = SequenceStatus.WAITING


@dataclass(eq=False)
class SequenceGroup:
    """One request: its sequences share the prompt and the sampling params.

    Parallel sampling (n > 1) puts n sequences in one group, whose prompt the scheduler computes once before
    forking them (group_fork.py). arrival_time is carried for metrics only: priority is the order in which
    groups were added to the scheduler.
    """

    request_id: str
    seqs: list[Sequence]
    sampling_params: SamplingParams
    arrival_time: float

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError(f"request_id must be a non-empty str, got {self.request_id!r}.")
        if not self.seqs:
            raise ValueError(f"seqs must not be empty (request_id={self.request_id!r}).")
        seq_ids = [seq.seq_id for seq in self.seqs]
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"seqs must have distinct seq_ids, got {seq_ids}.")
        if any(seq.prompt_token_ids != self.seqs[0].prompt_token_ids for seq in self.seqs):
            raise ValueError(f"seqs of request {self.request_id!r} must share one prompt.")

    def get_seqs(self, status: SequenceStatus) -> list[Sequence]:
        """Sequences with the given status."""
        return [seq for seq in self.seqs if seq.status is status]

    def unfinished_seqs(self) -> list[Sequence]:
        """Sequences that are still WAITING, RUNNING or SWAPPED."""
        return [seq for seq in self.seqs if not seq.is_finished]

    def is_finished(self) -> bool:
        """True when every sequence has finished."""
        return all(seq.is_finished for seq in self.seqs)

    def pending_fork_seqs(self) -> list[Sequence]:
        """Sequences waiting to be forked from the group's prefilling parent; empty for any other group.

        A group is RUNNING and WAITING at once only in that state: its parent (the one RUNNING sequence)
        computes the prompt for everyone, the WAITING ones hold no KV blocks until they fork.
        """
        if len(self.seqs) == 1 or not any(seq.status is SequenceStatus.RUNNING for seq in self.seqs):
            return []
        return self.get_seqs(SequenceStatus.WAITING)

    def forks_on_admission(self) -> bool:
        """True when admission prefills one parent and forks the other sequences from it.

        That is when several sequences are unfinished and none has output yet (they all hold just the prompt).
        Once outputs exist (a group preempted after its fork) the sequences differ: each is prefilled on its own.
        """
        unfinished = self.unfinished_seqs()
        return len(unfinished) > 1 and not any(seq.output_token_ids for seq in unfinished)

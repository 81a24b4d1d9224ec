"""The typed records the state store takes and returns: step commits, pickups, queue and stream state."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from protos import generation_pb2, state_pb2
from shared.errors import AlreadyExistsError, ResourceExhaustedError, UnavailableError


@dataclass(frozen=True)
class QueueLimits:
    """Bounds of one worker's queue of admitted, not yet scheduled requests (0 = unbounded)."""

    max_requests: int = 0
    max_tokens: int = 0


class DuplicateRequestError(AlreadyExistsError):
    """A live request already uses this request id."""


class AdmitOutcome(enum.Enum):
    """What admission did with a request."""

    # Recorded and queued: a new generation starts.
    ADMITTED = "admitted"
    # The same request (same id and digest) is live, or finished with its stream kept: nothing was
    # queued; the caller streams the existing output from index 0.
    ATTACHED = "attached"


class StreamState(enum.Enum):
    """Where a request's output stream stands."""

    # Admitted and not finished: more messages will come.
    LIVE = "live"
    # Finished; its stream is still kept (--output-retention) and complete.
    FINISHED = "finished"
    # No such request, or its stream expired.
    GONE = "gone"


@dataclass(frozen=True)
class StreamInfo:
    """A request's output stream as one atomic read saw it."""

    state: StreamState
    # Messages committed so far (indexes 0 .. length - 1).
    length: int


class QueueFullError(ResourceExhaustedError):
    """The worker's queue is at its bound: the client should retry later."""


class WorkerGoneError(UnavailableError):
    """The worker chosen for a request is no longer alive (its heartbeat expired or it deregistered)."""


@dataclass(frozen=True)
class CacheStats:
    """The KV cache as the engine loop last saw it."""

    free_blocks: int
    total_blocks: int
    # Prefix-cache lookups, counted in blocks (cumulative).
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0

    def as_hash(self) -> dict[str, int]:
        return {
            "free": self.free_blocks, "total": self.total_blocks,
            "prefix_cache_queries": self.prefix_cache_queries, "prefix_cache_hits": self.prefix_cache_hits,
        }


@dataclass
class StepCommit:
    """Everything one engine-loop step changes in Redis."""

    worker_id: str
    # Fencing epoch of the engine loop that writes it (0: unfenced).
    epoch: int = 0
    # Whether the commit also takes the next admitted requests and aborts off the worker's queues. A loop
    # that stops writes its last commit without: what is queued stays for the worker's next owner.
    pick_up: bool = True
    # seq_id -> output tokens appended this step.
    new_tokens: dict[int, list[int]] = field(default_factory=dict)
    # The scheduler's state (scheduler_service/state_journal.py): seq id -> SequenceState rewritten, seq id ->
    # "computed:inflight" counts rewritten (keys.seq_progress), seq ids whose state and counts go; block id ->
    # CachedBlock rewritten, block ids no longer cached; fields of the engine hash set and deleted. With
    # `reset_engine_state` those four keys are dropped first (a new owner's first commit).
    seq_states: dict[int, bytes] = field(default_factory=dict)
    seq_progress: dict[int, bytes] = field(default_factory=dict)
    dropped_seq_states: list[int] = field(default_factory=list)
    cached_blocks: dict[int, bytes] = field(default_factory=dict)
    uncached_blocks: list[int] = field(default_factory=list)
    engine_fields: dict[str, bytes] = field(default_factory=dict)
    dropped_engine_fields: list[str] = field(default_factory=list)
    reset_engine_state: bool = False
    # Sequences whose token list is dropped (their request finished).
    dropped_seqs: list[int] = field(default_factory=list)
    # request id -> seq_ids whose stored tokens, status and logprob are wiped before this step's writes
    # (beam search drops beams and reuses their ids).
    reset_seqs: dict[str, list[int]] = field(default_factory=dict)
    # (request id, message) to publish to the request's output stream. The message leaves its request_id unset:
    # the stream's key names the request (readers set it), and repeated in every entry it would be ~40 % of
    # the memory each generated token keeps in Redis.
    outputs: list[tuple[str, generation_pb2.GenerateResponse]] = field(default_factory=list)
    finished_requests: list[str] = field(default_factory=list)
    # Those of finished_requests that ended by an abort (their caller left, or Abort): their digest goes, so that
    # the same request sent again runs afresh instead of replaying the cut-off stream.
    aborted_requests: list[str] = field(default_factory=list)
    # Requests that entered the running or swapped queue since the last snapshot (the admission queue
    # count drops them).
    newly_scheduled: list[str] = field(default_factory=list)
    # request id -> {seq_id: SequenceStatus name} for sequences finished while their request goes on.
    finished_seqs: dict[str, dict[int, str]] = field(default_factory=dict)
    # request id -> {seq_id: cumulative logprob} for requests that pick their best_of at the end.
    cumulative_logprobs: dict[str, dict[int, float]] = field(default_factory=dict)
    # (record, worker id): requests moved to another worker's inbox, to be recomputed there.
    handed_over: list[tuple[state_pb2.AdmittedRequest, str]] = field(default_factory=list)
    # Queue snapshots and cache stats; None when unchanged since the last commit.
    waiting: list[str] | None = None
    running: list[str] | None = None
    swapped: list[str] | None = None
    cache_stats: CacheStats | None = None
    num_preemptions: int = 0
    # Of those, preemptions by swapping out (the rest recompute).
    num_swaps: int = 0
    # Steps the worker failed (the loop reset it and recomputed what it held).
    num_worker_failures: int = 0

    def is_empty(self) -> bool:
        """Whether it writes nothing: every field but the loop's own three is at its default (so a new
        field cannot be left out of the check)."""
        return self == StepCommit(self.worker_id, self.epoch, self.pick_up)


@dataclass
class RestoredRequest:
    """A request an earlier owner of the worker picked up, with the outputs it committed."""

    record: state_pb2.AdmittedRequest
    # seq_id -> committed output tokens
    outputs: dict[int, list[int]]
    # seq_id -> SequenceStatus name, for sequences that finished while their request went on (n > 1)
    finished: dict[int, str] = field(default_factory=dict)
    # seq_id -> cumulative logprob of its outputs (requests with best_of > n)
    cumulative_logprobs: dict[int, float] = field(default_factory=dict)


@dataclass
class Pickup:
    """Work the engine loop picked up with a commit."""

    admitted: list[state_pb2.AdmittedRequest]
    aborts: list[str]
    # Requests another worker's loop handed over, with the outputs committed for them so far.
    handed_over: list[RestoredRequest] = field(default_factory=list)

    def is_empty(self) -> bool:
        return not (self.admitted or self.aborts or self.handed_over)


@dataclass
class StoredEngineState:
    """A worker's scheduler state as its last owner committed it (RedisStore.load_engine_state)."""

    # The state may be continued (no resume from it failed).
    valid: bool
    # The prefix cache's logical clock.
    clock: int
    # The steps the last owner had sent and not landed at its last commit: planned and not counted as run,
    # and counted as run with their samples in flight, oldest first (async or multi-step scheduling).
    step: state_pb2.StepRecord | None
    inflight: list[state_pb2.StepRecord]
    # (epoch, step id) of the last step it had sent; the worker instance its state describes.
    last_sent: tuple[int, int]
    instance_id: str
    # Request ids, in queue order.
    waiting: list[str]
    running: list[str]
    swapped: list[str]
    # The queued requests (records, committed outputs), by request id.
    requests: dict[str, RestoredRequest]
    # Each with the computed and in-flight counts of its latest progress entry.
    seq_states: dict[int, state_pb2.SequenceState]
    # block id -> its registration in the prefix cache.
    cached_blocks: dict[int, state_pb2.CachedBlock]
    prefix_cache_queries: int
    prefix_cache_hits: int
    # Live requests the last owner picked up and never queued (it stopped first), oldest first: they
    # join the waiting queue as new.
    picked_up: list[RestoredRequest] = field(default_factory=list)


def progress_entry(num_computed_tokens: int, num_inflight_tokens: int) -> bytes:
    """A sequence's value in keys.seq_progress."""
    return b"%d:%d" % (num_computed_tokens, num_inflight_tokens)


def with_progress(state: state_pb2.SequenceState, entry: bytes | None) -> state_pb2.SequenceState:
    """`state` with the counts of its keys.seq_progress entry, the newer of the two (written by every commit
    that moved them); without one, as stored."""
    if entry is not None:
        computed, _, inflight = entry.partition(b":")
        state.num_computed_tokens, state.num_inflight_tokens = int(computed), int(inflight)
    return state

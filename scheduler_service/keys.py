"""Redis key names, in one place so that every replica agrees on them."""

from __future__ import annotations

PREFIX = "llmserve"

SEQ_ID_COUNTER = f"{PREFIX}:seq_id"


def request(request_id: str) -> str:
    """Hash: the admitted request (protobuf), its worker and its state."""
    return f"{PREFIX}:req:{request_id}"


def output_stream(request_id: str) -> str:
    """Stream of committed GenerateResponse messages for one request."""
    return f"{PREFIX}:out:{request_id}"


def reader_wake(reader_id: str) -> str:
    """Stream: one replica's output-stream reader is woken by an entry here (scheduler_service/stream_mux.py)."""
    return f"{PREFIX}:reader:{reader_id}:wake"


def digest(request_id: str) -> str:
    """String: digest of a request with a client-chosen id (idempotent re-sends); expires with its output stream."""
    return f"{PREFIX}:digest:{request_id}"


def inbox(worker_id: str) -> str:
    """List of admitted requests not yet picked up by the worker's engine loop."""
    return f"{PREFIX}:w:{worker_id}:inbox"


def aborts(worker_id: str) -> str:
    """List of request ids to abort on the worker's engine loop."""
    return f"{PREFIX}:w:{worker_id}:aborts"


def live(worker_id: str) -> str:
    """Set: ids of the worker's requests from admission until their final output is committed."""
    return f"{PREFIX}:w:{worker_id}:live"


def waiting(worker_id: str) -> str:
    """List: request ids in the waiting queue, in order."""
    return f"{PREFIX}:w:{worker_id}:waiting"


def swapped(worker_id: str) -> str:
    """List: request ids swapped out to the worker's CPU pool, in order."""
    return f"{PREFIX}:w:{worker_id}:swapped"


def running(worker_id: str) -> str:
    """List: request ids in the running queue, in order."""
    return f"{PREFIX}:w:{worker_id}:running"


def stats(worker_id: str) -> str:
    """Hash: the worker's KV blocks (total / free, as last committed), preemption and prefix-cache counts."""
    return f"{PREFIX}:w:{worker_id}:stats"


def epoch(worker_id: str) -> str:
    """Counter: fencing epoch of the worker's engine loop ownership."""
    return f"{PREFIX}:w:{worker_id}:epoch"


def seq_tokens(seq_id: int) -> str:
    """List: output token ids committed for one sequence."""
    return f"{PREFIX}:seq:{seq_id}:tokens"


def seq_states(worker_id: str) -> str:
    """Hash: seq id -> SequenceState (status, block table, hash chain) of the worker's sequences, rewritten when
    one of those changes; its computed and in-flight counts are those of `seq_progress`."""
    return f"{PREFIX}:w:{worker_id}:seqs"


def seq_progress(worker_id: str) -> str:
    """Hash: seq id -> "computed:inflight" token counts of the worker's sequences, rewritten whenever they move
    (every step a sequence decodes), so that a decode step does not rewrite the sequence's whole block table."""
    return f"{PREFIX}:w:{worker_id}:progress"


def cached_blocks(worker_id: str) -> str:
    """Hash: block id -> CachedBlock, the blocks registered in the worker's prefix cache."""
    return f"{PREFIX}:w:{worker_id}:cached"


# Fields of the engine hash: whether the stored state may be continued ("1"), the prefix cache's clock, the
# StepRecord of the step sent and not landed, the StepRecords of the steps in flight (async or multi-step
# scheduling: counted as run, their samples not back yet), the last step
# sent ("epoch:step id") and the worker instance whose KV cache the state describes.
ENGINE_VALID, ENGINE_CLOCK, ENGINE_STEP, ENGINE_INFLIGHT, ENGINE_LAST_SENT, ENGINE_INSTANCE = (
    "valid", "clock", "step", "inflight", "last_sent", "instance")


def engine(worker_id: str) -> str:
    """Hash: the engine loop's own state, in the ENGINE_* fields above."""
    return f"{PREFIX}:w:{worker_id}:engine"


def queue(worker_id: str) -> str:
    """Hash: `requests` and `tokens` (prompt tokens) admitted to the worker and not yet scheduled once."""
    return f"{PREFIX}:w:{worker_id}:queue"


def queued(worker_id: str) -> str:
    """Hash: request id -> prompt tokens, for each request counted in `queue(worker_id)`."""
    return f"{PREFIX}:w:{worker_id}:queued"


def prefix_holder(block_hash_hex: str) -> str:
    """String: the worker that last received a prompt with this full block (chained hash); expires."""
    return f"{PREFIX}:prefix:{block_hash_hex}"


def worker_state(worker_id: str) -> list[str]:
    """Every key of a worker's engine state and queues, which go with it once it left for good (its epoch
    stays: fencing never goes back)."""
    return [inbox(worker_id), aborts(worker_id), live(worker_id), waiting(worker_id), running(worker_id),
            swapped(worker_id), stats(worker_id), seq_states(worker_id), seq_progress(worker_id),
            cached_blocks(worker_id), engine(worker_id), queue(worker_id), queued(worker_id)]

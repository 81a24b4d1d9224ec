"""What of an engine loop's scheduler changed since its last commit, written into the next one.

Redis holds the scheduler's whole state, so that a new owner of the worker rebuilds it exactly
(scheduler_service/core/snapshot.py) and continues on the KV cache the worker still holds:

    key                          written when                    holds
    w:{id}:waiting/running/      the queue's order changed       request ids, in order
      swapped
    w:{id}:seqs                  a sequence's status, table or   SequenceState per seq id
                                 hash chain changed
    w:{id}:progress              its computed or in-flight       "computed:inflight" per seq id
                                 count moved (each decode)       (overrides the SequenceState's)
    w:{id}:cached                a block's registration or       CachedBlock per block id
                                 evictor stamp changed
    w:{id}:engine                every commit                    valid, clock, the steps not landed
    w:{id}:stats                 the cache's counts changed      free / total blocks, prefix lookups

Tokens are in the sequences' token lists and the prompts and parameters in the request records
(both written by the step's results); a token in flight (async scheduling) is counted per sequence
until the step that samples it lands.
"""

from __future__ import annotations

from protos import state_pb2, worker_pb2
from scheduler_service import keys
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.core.scheduler_output import SchedulerOutput
from scheduler_service.core.sequence import Sequence
from scheduler_service.store import CacheStats, StepCommit
from scheduler_service.store_types import progress_entry

_TABLE = state_pb2.SequenceState.Table
# Read once: each attribute of a protobuf enum wrapper is a lookup by name (~0.5 us a sequence a step).
_DEVICE, _CPU, _NO_TABLE = _TABLE.DEVICE, _TABLE.CPU, _TABLE.NO_TABLE


def step_record(plan: worker_pb2.StepPlan, out: SchedulerOutput) -> state_pb2.StepRecord:
    """What a new owner needs of a step sent and not landed: its sequences' token counts and block operations."""
    record = state_pb2.StepRecord(epoch=plan.epoch, step_id=plan.step_id, swap_in=plan.swap_in, swap_out=plan.swap_out,
                                  copy=plan.copy)
    for item in out.scheduled:
        if not item.seq.is_finished:
            record.scheduled.add(seq_id=item.seq.seq_id, num_new_tokens=item.num_new_tokens,
                                 num_computed_tokens=item.num_computed_tokens)
    return record


class StateJournal:
    """Writes into each commit the parts of the scheduler's state that changed since the last one."""

    def __init__(self) -> None:
        # Request ids of the waiting, running and swapped queues as last written (None: not yet).
        self._queues: tuple[list[str] | None, ...] = (None, None, None)
        self._stats: CacheStats | None = None
        # seq id -> (layout, progress) last written of it (compared before anything is built): its SequenceState
        # is rewritten when the layout changed, its progress entry when either did.
        self._seqs: dict[int, tuple[tuple, tuple[int, int]]] = {}
        # The next valid commit rewrites the whole state (the stored one is another owner's, or not valid).
        self._rewrite = True
        self._instance_id = ""

    def restart(self, instance_id: str) -> None:
        """The next commit rewrites everything: the loop (re)took a worker, whose instance id is this."""
        self._rewrite = True
        self._instance_id = instance_id

    def write(self, scheduler: Scheduler, commit: StepCommit, unlanded: state_pb2.StepRecord | None,
              last_sent: tuple[int, int], inflight: list[state_pb2.StepRecord] = ()) -> None:
        """Queues, cache counts and the restorable state into `commit`.

        unlanded: the step planned and sent, not landed nor advanced, if any (the commit runs beside it);
        inflight: the steps advanced and not landed, oldest first (async scheduling: the one step ahead; multi-step
        scheduling: those of the call in flight), whose samples are the tokens in flight;
        last_sent: (epoch, step id) of the last step sent.
        """
        self._write_queues(scheduler, commit)
        # One pass over the sequences, the per-step cost: what each would be written as.
        keyed = {seq.seq_id: self._seq_key(scheduler, seq)
                 for group in (*scheduler.waiting, *scheduler.running, *scheduler.swapped) for seq in group.seqs}
        pool = scheduler.block_manager.block_pool
        changed_blocks = pool.take_changes()
        if self._rewrite:
            commit.reset_engine_state = True
            commit.engine_fields[keys.ENGINE_INSTANCE] = self._instance_id.encode()
            self._seqs = {}
            changed_blocks = {e.block_id for e in pool.cached_blocks()}
            self._rewrite = False
        for seq_id, key in keyed.items():
            old = self._seqs.get(seq_id)
            if old != key:
                layout, progress = key
                if old is None or old[0] != layout:
                    commit.seq_states[seq_id] = _sequence_state(seq_id, *layout, *progress).SerializeToString()
                commit.seq_progress[seq_id] = progress_entry(*progress)
        commit.dropped_seq_states.extend(s for s in self._seqs if s not in keyed)
        self._seqs = keyed
        for block_id in sorted(changed_blocks):
            entry = pool.cached_entry(block_id)
            if entry is None:
                commit.uncached_blocks.append(block_id)
            else:
                commit.cached_blocks[block_id] = state_pb2.CachedBlock(
                    block_hash=entry.block_hash, num_hashed_tokens=entry.num_hashed_tokens,
                    last_accessed=-1 if entry.last_accessed is None else entry.last_accessed,
                ).SerializeToString()
        commit.engine_fields[keys.ENGINE_VALID] = b"1"
        commit.engine_fields[keys.ENGINE_CLOCK] = str(pool.clock).encode()
        commit.engine_fields[keys.ENGINE_LAST_SENT] = f"{last_sent[0]}:{last_sent[1]}".encode()
        stored = (unlanded.SerializeToString() if unlanded is not None else None,
                  state_pb2.StepRecords(steps=inflight).SerializeToString() if inflight else None)
        for field, value in zip((keys.ENGINE_STEP, keys.ENGINE_INFLIGHT), stored):
            if value is not None:
                commit.engine_fields[field] = value
            else:
                commit.dropped_engine_fields.append(field)

    @staticmethod
    def _seq_key(scheduler: Scheduler, seq: Sequence) -> tuple[tuple, tuple[int, int]]:
        """(layout, progress): (status, table kind, block ids, hash chain) and (computed, in-flight tokens)."""
        bm = scheduler.block_manager
        table = bm.block_tables.get(seq.seq_id)
        cpu_table = bm.swapper.cpu_tables.get(seq.seq_id)
        chain = bm.chain_length(seq.seq_id)
        kind, blocks = (_DEVICE, table) if table is not None else (
            (_CPU, cpu_table) if cpu_table is not None else (_NO_TABLE, ()))
        return ((seq.status.name, kind, tuple(blocks), -1 if chain is None else chain),
                (seq.num_computed_tokens, seq.num_inflight_tokens))

    def _write_queues(self, scheduler: Scheduler, commit: StepCommit) -> None:
        """Queue order and free blocks go into a commit only when they changed (an idle loop writes nothing)."""
        bm = scheduler.block_manager
        queues = tuple([g.request_id for g in q] for q in (scheduler.waiting, scheduler.running, scheduler.swapped))
        # Only the requests that just started running leave the admission queue count: sending the whole
        # running list would cost Redis a lookup per running request whenever the list changes.
        before = set().union(*(q for q in self._queues[1:] if q is not None))
        commit.newly_scheduled.extend(r for q in queues[1:] for r in q if r not in before)
        commit.waiting, commit.running, commit.swapped = (new if new != old else None
                                                          for new, old in zip(queues, self._queues))
        self._queues = queues
        prefix = bm.prefix_cache_stats
        stats = CacheStats(bm.num_free_gpu_blocks, bm.num_gpu_blocks, prefix.queries, prefix.hits)
        commit.cache_stats = stats if stats != self._stats else None
        self._stats = stats


def _sequence_state(seq_id: int, status: str, kind: int, blocks: tuple[int, ...], chain: int, computed: int,
                    inflight: int) -> state_pb2.SequenceState:
    """The SequenceState of a sequence's key (StateJournal._seq_key), built for each sequence whose layout changed
    (admitted, grown by a block, copied on write, preempted, swapped, forked), so the fields are passed directly."""
    return state_pb2.SequenceState(seq_id=seq_id, status=status, num_computed_tokens=computed, table=kind,
                                   block_table=blocks, num_hashed_blocks=chain, num_inflight_tokens=inflight)

"""StateJournal: what a step writes of a sequence (its whole state, or only its token counts)."""

from __future__ import annotations

from protos import state_pb2
from scheduler_service.core.config import CacheConfig, SchedulerConfig
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.core.sequence import Sequence, SequenceGroup
from scheduler_service.state_journal import StateJournal
from scheduler_service.store_types import StepCommit, progress_entry, with_progress
from shared.sampling_params import SamplingParams


def _step(sched: Scheduler, journal: StateJournal) -> StepCommit:
    out = sched.schedule()
    sched.update_after_step(out, {s.seq.seq_id: 7 for s in out.scheduled if s.samples})
    commit = StepCommit("w")
    journal.write(sched, commit, None, (1, 0))
    return commit


def test_a_decode_writes_the_token_counts_and_the_table_only_when_it_grows() -> None:
    sched = Scheduler(SchedulerConfig(max_model_len=256), CacheConfig(num_gpu_blocks=8, block_size=16))
    sched.add_request(SequenceGroup("r", [Sequence(1, list(range(1, 21)))], SamplingParams(max_tokens=64), 0.0))
    journal = StateJournal()
    first = _step(sched, journal)  # the prompt's 20 tokens: two blocks
    state = state_pb2.SequenceState.FromString(first.seq_states[1])
    assert (state.status, list(state.block_table), state.num_computed_tokens) == ("RUNNING", [0, 1], 20)
    assert first.seq_progress == {1: progress_entry(20, 0)}
    # Tokens 21 to 32 decode into the second block: the table is as stored, only the counts move.
    for computed in range(21, 33):
        commit = _step(sched, journal)
        assert commit.seq_states == {}
        assert commit.seq_progress == {1: progress_entry(computed, 0)}
    # Token 33 starts a third block: the state is written again, with the new table.
    grown = _step(sched, journal)
    state = state_pb2.SequenceState.FromString(grown.seq_states[1])
    assert list(state.block_table) == [0, 1, 2] and state.num_computed_tokens == 33
    assert grown.seq_progress == {1: progress_entry(33, 0)}
    # Read back, the progress entry's counts win over those the state was written with.
    read = with_progress(state_pb2.SequenceState(num_computed_tokens=20), progress_entry(40, 1))
    assert (read.num_computed_tokens, read.num_inflight_tokens) == (40, 1)
    # A state stored without a progress entry (by an engine loop that wrote none) reads as stored.
    assert with_progress(state_pb2.SequenceState(num_computed_tokens=20), None).num_computed_tokens == 20

"""Beam search: the pure step (core.beam_search), the scheduler's beam verbs and the parameters' validation."""

from __future__ import annotations

import numpy as np
import pytest

from scheduler_service.beam_processor import beam_params, restore_beam_ids
from scheduler_service.core.beam_search import (
    BeamParams,
    Hypothesis,
    RunningBeam,
    beam_step,
    hypothesis_score,
)
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.core.sequence import Sequence, SequenceGroup, SequenceStatus
from shared.sampling_params import SamplingParams
from tests.unit.test_scheduler import make_scheduler

EOS = 9


def params(width: int = 2, early_stopping: bool | str = False, length_penalty: float = 1.0,
           max_generated: int = 10) -> BeamParams:
    return BeamParams(width, length_penalty, early_stopping, frozenset({EOS}), max_generated, 2 * width)


# -- the step ------------------------------------------------------------------------------


def test_first_step_expands_the_prompt_into_width_beams() -> None:
    prompt = RunningBeam(0, 0.0, [(5, -0.1), (6, -0.5), (7, -0.9), (8, -1.5)])
    result = beam_step(params(width=3), [prompt], [], num_generated=0)
    assert [(c.parent_id, c.token_id) for c in result.running] == [(0, 5), (0, 6), (0, 7)]
    assert [c.cumulative_logprob for c in result.running] == pytest.approx([-0.1, -0.5, -0.9])
    assert result.finished == [] and result.dropped_hypotheses == [] and not result.done


def test_candidates_are_ranked_across_beams_by_cumulative_logprob() -> None:
    beams = [RunningBeam(1, -1.0, [(5, -0.1), (6, -2.0)]), RunningBeam(2, -1.5, [(5, -0.2), (7, -0.3)])]
    result = beam_step(params(width=2), beams, [], num_generated=3)
    # -1.1 (beam 1 + 5), -1.7 (beam 2 + 5), -1.8 (beam 2 + 7), -3.0 (beam 1 + 6)
    assert [(c.parent_id, c.token_id) for c in result.running] == [(1, 5), (2, 5)]


def test_a_stop_token_in_the_top_width_finishes_a_hypothesis_and_a_beam_goes_on_instead() -> None:
    beam = RunningBeam(0, -1.0, [(EOS, -0.1), (5, -0.2), (6, -0.3), (7, -0.4)])
    result = beam_step(params(width=2), [beam], [], num_generated=3)
    assert [(c.token_id) for c in result.running] == [5, 6]
    (hyp,) = result.finished
    assert (hyp.parent_id, hyp.token_id) == (0, EOS)
    assert hyp.cumulative_logprob == pytest.approx(-1.1)


def test_a_stop_token_ranked_below_width_is_not_a_hypothesis() -> None:
    beam = RunningBeam(0, 0.0, [(5, -0.1), (6, -0.2), (EOS, -0.3), (7, -0.4)])
    result = beam_step(params(width=2), [beam], [], num_generated=1)
    assert result.finished == [] and [c.token_id for c in result.running] == [5, 6]


def test_only_the_best_width_hypotheses_are_kept() -> None:
    old = [Hypothesis(10, -4.0, 2), Hypothesis(11, -9.0, 3)]  # scores -2.0 and -3.0
    beam = RunningBeam(0, -0.2, [(EOS, -0.1), (5, -0.15), (6, -3.0), (7, -3.1)])
    result = beam_step(params(width=2, max_generated=50), [beam], old, num_generated=3)
    # New hypothesis: -0.3 / 4 = -0.075, better than both; the worse old one (11) is dropped.
    assert [c.token_id for c in result.finished] == [EOS]
    assert result.dropped_hypotheses == [11]
    # Best running (-0.35 / 4 = -0.0875) cannot beat the worst kept (-2.0)? It can: the search goes on.
    assert not result.done


def test_heuristic_stop_when_the_best_running_beam_cannot_beat_the_worst_hypothesis() -> None:
    kept = [Hypothesis(10, -0.2, 2), Hypothesis(11, -0.4, 2)]  # -0.1, -0.2
    beam = RunningBeam(0, -3.0, [(5, -0.1), (6, -0.2), (7, -0.3), (8, -0.4)])
    result = beam_step(params(width=2), [beam], kept, num_generated=4)
    assert result.done and result.running == [] and result.finished == []


def test_early_stopping_true_stops_once_width_hypotheses_exist() -> None:
    beam = RunningBeam(0, -1.0, [(EOS, -0.1), (5, -0.2), (6, -0.3), (7, -0.4)])
    result = beam_step(params(width=2, early_stopping=True), [beam], [Hypothesis(10, -50.0, 5)], num_generated=3)
    assert len(result.finished) == 1 and result.done
    # Full already: nothing more is added and the search is over.
    full = [Hypothesis(10, -0.1, 1), Hypothesis(11, -0.2, 1)]
    again = beam_step(params(width=2, early_stopping=True), [beam], full, num_generated=3)
    assert again.finished == [] and again.done


def test_never_with_a_positive_length_penalty_assumes_the_longest_reachable_length() -> None:
    kept = [Hypothesis(10, -2.0, 2), Hypothesis(11, -2.0, 2)]  # -1.0 each with length_penalty 1
    beam = RunningBeam(0, -6.0, [(5, -0.1), (6, -0.2), (7, -0.3), (8, -0.4)])
    # Heuristic: -6.1 / 5 = -1.22 < -1.0: done. "never": -6.1 / 10 = -0.61 > -1.0: go on.
    assert beam_step(params(width=2), [beam], kept, num_generated=4).done
    assert not beam_step(params(width=2, early_stopping="never"), [beam], kept, num_generated=4).done


def test_the_length_limit_finishes_the_best_width_candidates_and_the_search() -> None:
    beams = [RunningBeam(1, -1.0, [(5, -0.1), (6, -0.2)]), RunningBeam(2, -1.2, [(5, -0.3), (7, -0.4)])]
    result = beam_step(params(width=2, max_generated=4), beams, [], num_generated=3)
    assert result.done and result.running == []
    assert [(c.parent_id, c.token_id) for c in result.finished] == [(1, 5), (1, 6)]


def test_cumulative_logprobs_are_summed_in_float32() -> None:
    beam = RunningBeam(0, -1.1, [(5, -0.7), (6, -0.9), (7, -1.0), (8, -1.1)])
    result = beam_step(params(width=2), [beam], [], num_generated=1)
    assert result.running[0].cumulative_logprob == float(np.float32(np.float32(-1.1) + np.float32(-0.7)))
    assert hypothesis_score(-3.0, 4, 0.5) == float(np.float32(-3.0) / np.float32(2.0))


def test_beam_step_needs_a_running_beam() -> None:
    with pytest.raises(ValueError, match="at least one running beam"):
        beam_step(params(), [], [], num_generated=0)


# -- request parameters ----------------------------------------------------------------------


def test_beam_params_from_a_request() -> None:
    sp = SamplingParams(use_beam_search=True, best_of=3, temperature=0.0, max_tokens=20, stop_token_ids=[4])
    bp = beam_params(sp, prompt_len=10, max_seq_len=25, eos_token_id=2)
    assert bp.stop_token_ids == {2, 4} and bp.max_generated == 15 and bp.num_candidates == 9 and bp.width == 3
    assert sp.num_sequences == 6 and sp.num_beam_candidates == 9 and not sp.streams_outputs
    ignoring = SamplingParams(use_beam_search=True, best_of=2, temperature=0.0, ignore_eos=True)
    assert beam_params(ignoring, 5, 100, 2).stop_token_ids == frozenset()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"use_beam_search": True, "best_of": 1, "temperature": 0.0}, "best_of must be greater than 1 when using beam search"),
        ({"use_beam_search": True, "best_of": 2, "temperature": 0.7}, "temperature must be 0 when using beam search"),
        ({"use_beam_search": True, "best_of": 2, "temperature": 0.0, "top_p": 0.5}, "top_p must be 1"),
        ({"use_beam_search": True, "best_of": 2, "temperature": 0.0, "top_k": 5}, "top_k must be 0 or -1"),
        ({"use_beam_search": True, "best_of": 2, "temperature": 0.0, "early_stopping": "soon"}, "early_stopping must be"),
        ({"use_beam_search": True, "best_of": 2, "temperature": 0.0, "stop": ["x"]}, "stop strings are not supported"),
        ({"early_stopping": True}, "early_stopping is not effective"),
        ({"length_penalty": 2.0}, "length_penalty is not effective"),
    ],
)
def test_beam_search_validation_messages(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_restore_beam_ids_keeps_sequences_with_tokens_or_a_status() -> None:
    assert restore_beam_ids([4, 5, 6, 7], {}, {}) == [4]
    assert restore_beam_ids([4, 5, 6, 7], {4: [], 5: [1], 7: [2]}, {6: "FINISHED_STOPPED"}) == [5, 6, 7]


# -- scheduler verbs ---------------------------------------------------------------------------


def _beam_group(prompt: list[int]) -> SequenceGroup:
    sp = SamplingParams(use_beam_search=True, best_of=2, temperature=0.0, max_tokens=8)
    return SequenceGroup("b", [Sequence(0, prompt)], sp, 0.0)


def _after_first_step(prompt: list[int]) -> tuple[Scheduler, SequenceGroup, Sequence]:
    """A beam search request whose prompt ran one step (token 7): the scheduler, the group and its one beam."""
    sched = make_scheduler(num_gpu_blocks=8, block_size=4)
    group = _beam_group(prompt)
    sched.add_request(group)
    out = sched.schedule()
    sched.update_after_step(out, {0: 7})
    return sched, group, group.seqs[0]


def test_fork_seq_shares_blocks_and_the_next_step_copies_the_last_on_write() -> None:
    sched, group, parent = _after_first_step([1, 2, 3, 4, 5, 6])
    child = Sequence(1, [1, 2, 3, 4, 5, 6], [8])
    sched.fork_seq(group, parent, child)
    bm = sched.block_manager
    assert bm.get_block_table(child) == bm.get_block_table(parent) == [0, 1]
    assert [bm.block_pool.get_ref_count(b) for b in (0, 1)] == [2, 2]
    assert child.status is SequenceStatus.RUNNING and child.num_computed_tokens == 6
    out = sched.schedule()
    # Both write position 6, in shared block 1: one copy, the other writes in place.
    assert len(out.blocks_to_copy) == 1 and out.blocks_to_copy[0][0] == 1
    assert sorted(s.seq.seq_id for s in out.scheduled) == [0, 1]


def test_replace_beams_frees_dropped_beams_reuses_their_ids_and_finishes_the_group() -> None:
    sched, group, parent = _after_first_step([1, 2, 3])
    sched.fork_seq(group, parent, Sequence(1, [1, 2, 3], [8]))
    used = sched.block_manager.get_num_used_blocks()
    # The first beam finishes as a hypothesis under the dropped beam's id 0; beam 1 goes on.
    hyp = Sequence(2, [1, 2, 3], [7, EOS], status=SequenceStatus.FINISHED_STOPPED)
    sched.replace_beams(group, [parent], [hyp])
    assert [s.seq_id for s in group.seqs] == [1, 2]
    assert sched.block_manager.get_num_used_blocks() == used  # block 0 is still the child's
    with pytest.raises(ValueError, match="already in use"):
        sched.replace_beams(group, [], [Sequence(1, [1, 2, 3], [5], status=SequenceStatus.FINISHED_LENGTH)])
    with pytest.raises(ValueError, match="must be finished"):
        sched.replace_beams(group, [], [Sequence(0, [1, 2, 3], [5])])
    # The last running beam leaves: only hypotheses remain, the request is done and every block free.
    sched.replace_beams(group, [group.seqs[0]], [Sequence(0, [1, 2, 3], [8, 5], status=SequenceStatus.FINISHED_LENGTH)])
    assert group.is_finished() and not sched.has_unfinished_requests()
    assert sched.block_manager.get_num_used_blocks() == 0


def test_a_child_that_cannot_join_is_refused_before_it_shares_a_block() -> None:
    sched, group, parent = _after_first_step([1, 2, 3, 4, 5, 6])
    bm = sched.block_manager
    with pytest.raises(ValueError, match="must share the prompt"):
        sched.fork_seq(group, parent, Sequence(1, [1, 2, 3, 4, 5, 9], [8]))
    with pytest.raises(ValueError, match="already in use"):
        sched.fork_seq(group, parent, Sequence(0, [1, 2, 3, 4, 5, 6], [8]))
    assert [bm.block_pool.get_ref_count(b) for b in bm.get_block_table(parent)] == [1, 1]
    assert [s.seq_id for s in group.seqs] == [0]
    sched.fork_seq(group, parent, Sequence(1, [1, 2, 3, 4, 5, 6], [8]))  # the id and prompt are still free to use
    assert [bm.block_pool.get_ref_count(b) for b in bm.get_block_table(parent)] == [2, 2]


def test_a_refused_hypothesis_leaves_the_beams_and_their_blocks_as_they_were() -> None:
    sched, group, parent = _after_first_step([1, 2, 3])
    sched.fork_seq(group, parent, Sequence(1, [1, 2, 3], [8]))
    bm = sched.block_manager
    table, used = bm.get_block_table(parent), bm.get_num_used_blocks()
    bad = [Sequence(2, [1, 2, 4], [7, EOS], status=SequenceStatus.FINISHED_STOPPED)]
    twice = [Sequence(2, [1, 2, 3], [7, EOS], status=SequenceStatus.FINISHED_STOPPED),
             Sequence(2, [1, 2, 3], [8, EOS], status=SequenceStatus.FINISHED_STOPPED)]
    for hypotheses, message in ((bad, "must share the prompt"), (twice, "already in use")):
        with pytest.raises(ValueError, match=message):
            sched.replace_beams(group, [parent], hypotheses)
        assert [s.seq_id for s in group.seqs] == [0, 1] and parent.status is SequenceStatus.RUNNING
        assert bm.get_block_table(parent) == table and bm.get_num_used_blocks() == used
    # The dropped beam's id is free for a hypothesis of the same call.
    sched.replace_beams(group, [parent], [Sequence(0, [1, 2, 3], [7, EOS], status=SequenceStatus.FINISHED_STOPPED)])
    assert [s.seq_id for s in group.seqs] == [1, 0]


def test_a_beam_search_wider_than_max_num_seqs_is_ignored() -> None:
    sched = make_scheduler(max_num_seqs=2)
    sp = SamplingParams(use_beam_search=True, best_of=3, temperature=0.0)
    group = SequenceGroup("wide", [Sequence(0, [1, 2])], sp, 0.0)
    sched.add_request(group)
    out = sched.schedule()
    assert out.ignored == [group] and group.seqs[0].status is SequenceStatus.FINISHED_IGNORED

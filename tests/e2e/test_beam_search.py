"""Beam search end to end on a tiny random Llama, against transformers' generate(num_beams=k).

The cache is small and has a CPU swap pool, so concurrent beam searches (each
up to best_of running beams) are swapped out and recomputed while the beams
they return must still equal transformers' token for token.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from llmserve.client import GenerationClient, make_request
from llmserve.local_cluster import ClusterSpec, LocalCluster
from protos import common_pb2
from tests.e2e.cluster_checks import assert_all_blocks_free, redis_state
from tests.e2e.concurrency import Streams
from tests.beam_cases import MAX_NEW, BeamCase, beam_case, hf_beams, stop_token_for
from tests.hf_reference import HFReference, compare_greedy

# Tokens each greedy single generates: with its 90-token prompt, 10 blocks of 16.
SINGLE_NEW = 60
EARLY = {False: common_pb2.EARLY_STOPPING_HEURISTIC, True: common_pb2.EARLY_STOPPING_TRUE,
         "never": common_pb2.EARLY_STOPPING_NEVER}


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir: Path) -> Iterator[LocalCluster]:
    spec = ClusterSpec(
        model=str(tiny_llama_dir),
        worker_args=["--num-gpu-blocks-override", "36", "--swap-space", "0.005", "--max-model-len", "256",
                     "--num-threads", "1"],
    )
    with LocalCluster(spec) as c:
        yield c


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: Path) -> HFReference:
    return HFReference(str(tiny_llama_dir))


def _request(case: BeamCase, stop: int) -> object:
    return make_request(
        prompt_token_ids=case.prompt, max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True,
        stop_token_ids=[stop], use_beam_search=True, best_of=case.width, n=case.n,
        length_penalty=case.length_penalty, early_stopping=EARLY[case.early_stopping],
    )


def test_beam_search_equals_transformers_under_preemption(cluster: LocalCluster, reference: HFReference) -> None:
    cases = [beam_case(i) for i in range(9)]
    stops = [stop_token_for(reference, c) for c in cases]
    expected = [hf_beams(reference, c, s) for c, s in zip(cases, stops)]
    # Greedy single-sequence requests first, running before the beam searches arrive. Alone they need
    # 4 x 10 blocks (90 + 60 tokens) of the 36: some are preempted by recompute whatever the timing; the
    # later-arrived beam groups, the first victims while they run, are preempted by swapping.
    singles = [[(53 * i + 7 * j) % 40000 + 100 for j in range(90)] for i in range(4)]
    with GenerationClient(cluster.address) as client, ThreadPoolExecutor(max_workers=len(cases)) as pool:
        greedy = Streams(client, [make_request(prompt_token_ids=p, max_tokens=SINGLE_NEW, temperature=0.0,
                                               ignore_eos=True) for p in singles])
        greedy.wait_started(60)
        futures = [pool.submit(client.generate_n, _request(c, s)) for c, s in zip(cases, stops)]
        results = [f.result() for f in futures]
        greedy_results = [r[0] for r in greedy.join(120)]
    finished_by_stop = 0
    for case, stop, want, got in zip(cases, stops, expected, results):
        assert [c.error for c in got] == [""] * len(got)
        assert [c.token_ids for c in got] == want, f"{case}"
        for completion in got:
            ended_by_stop = completion.token_ids[-1] == stop
            finished_by_stop += ended_by_stop
            assert completion.finish_reason == ("FINISH_REASON_STOP" if ended_by_stop else "FINISH_REASON_LENGTH")
            assert completion.stop_reason == (str(stop) if ended_by_stop else "")
            assert completion.text
        assert got[0].completion_tokens == sum(len(c.token_ids) for c in got)
    print(f"beams returned: {sum(len(r) for r in results)}, ended by a stop token: {finished_by_stop}")
    # The stop tokens were chosen so that some beams end early: that path is exercised.
    assert finished_by_stop > 0
    for result, expected in zip(greedy_results, reference.greedy_many(singles, SINGLE_NEW, stop_at_eos=False)):
        cmp = compare_greedy(result.token_ids, expected)
        assert cmp.matched, cmp.detail
    state = redis_state(cluster)
    print(f"preemptions: {state['preemptions']} (of which swaps: {state['swaps']})")
    assert state["swaps"] > 0 and state["preemptions"] > state["swaps"], state
    assert_all_blocks_free(cluster)

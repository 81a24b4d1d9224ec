"""End to end on a tiny random Llama: Redis + worker + scheduler as real processes.

The KV cache is deliberately small (64 blocks of 16 tokens for 16 concurrent
requests of up to 300 + 64 tokens), so the engine preempts and recomputes
while the outputs must still match transformers token for token. Every test
runs three times: with the synchronous engine loop, with async scheduling and
with multi-step scheduling (tests/e2e/engine_modes.py).
"""

from __future__ import annotations

import os
import random
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import redis

from llmserve.client import GenerationClient, make_request
from llmserve.local_cluster import ClusterSpec, LocalCluster
from protos import common_pb2
from scheduler_service import keys
from scheduler_service.step_profile import read_profiles
from tests.e2e.cluster_checks import assert_all_blocks_free, committed_stream, redis_state, wait_for
from tests.e2e.concurrency import Streams, generate_all
from tests.e2e.engine_modes import SCHEDULING
from tests.hf_reference import HFReference, Reference, compare_greedy

MAX_NEW = 64
NUM_BLOCKS = 64


@pytest.fixture(scope="module")
def profile_path(tmp_path_factory: pytest.TempPathFactory, scheduling: str) -> Path:
    return tmp_path_factory.mktemp(f"profile-{scheduling}") / "steps.jsonl"


@pytest.fixture(scope="module", params=list(SCHEDULING))
def scheduling(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir: Path, profile_path: Path, scheduling: str) -> Iterator[LocalCluster]:
    spec = ClusterSpec(
        model=str(tiny_llama_dir),
        worker_args=["--num-gpu-blocks-override", str(NUM_BLOCKS), "--max-model-len", "512", "--num-threads", "1"],
        scheduler_args=["--max-num-batched-tokens", "1024", "--profile-steps", str(profile_path),
                        *SCHEDULING[scheduling]],
    )
    with LocalCluster(spec) as c:
        yield c


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: Path) -> HFReference:
    return HFReference(str(tiny_llama_dir))


def _prompts(n: int, vocab: int, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [5, 300] + [rng.randint(5, 300) for _ in range(n - 2)]
    return [[rng.randrange(3, vocab) for _ in range(length)] for length in lengths]


def test_concurrent_greedy_matches_transformers(cluster: LocalCluster, reference: HFReference) -> None:
    vocab = reference.model.config.vocab_size
    prompts = _prompts(16, vocab)
    # Named, so that a mismatch can be told apart: lost between Redis and the client, or never committed.
    ids = [f"concurrent-{i}" for i in range(len(prompts))]
    requests = [make_request(request_id=rid, prompt_token_ids=p, max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
                for rid, p in zip(ids, prompts)]
    results = generate_all(cluster.address, requests)
    near_ties = []
    for rid, prompt, result, ref in zip(ids, prompts, results, reference.greedy_many(prompts, MAX_NEW, stop_at_eos=False)):
        assert result.error == ""
        assert result.finish_reason == "FINISH_REASON_LENGTH"
        assert result.prompt_tokens == len(prompt) and result.completion_tokens == MAX_NEW
        cmp = compare_greedy(result.token_ids, ref)
        if not cmp.matched:
            with redis.Redis.from_url(cluster.redis_url) as rds:
                committed = committed_stream(rds, rid)[0].get(0, [])
            pytest.fail(f"{rid}, prompt of {len(prompt)} tokens: {cmp.detail}; the client got {len(result.token_ids)} "
                        f"tokens, Redis's stream holds {len(committed)} (the same: {committed == result.token_ids}); "
                        f"client {result.token_ids}, reference {ref.token_ids}")
        if cmp.near_tie_at is not None:
            near_ties.append(cmp.detail)
    print(f"near-ties accepted: {near_ties or 'none'}")
    assert_all_blocks_free(cluster)
    state = redis_state(cluster)
    # The cache is too small for all 16 at once: the run must have gone through recompute preemption.
    assert state["preemptions"] > 0
    # Every step ran: a recompute after a failed step would hide what made it fail (the scheduler's log says).
    assert state["worker_failures"] == 0, cluster.tail("scheduler", 80)


def test_step_profiles_split_each_step(cluster: LocalCluster, profile_path: Path, scheduling: str) -> None:
    """--profile-steps: every step's phases are measured and add up to at most its wall time (planning
    overlaps the step before with async scheduling: there the landing's phases do)."""
    with GenerationClient(cluster.address) as client:
        client.generate(make_request(prompt_token_ids=list(range(50, 90)), max_tokens=20, temperature=0.0,
                                     ignore_eos=True))
    # The loop flushes its profiles when it goes idle; under multi-step scheduling the request's decodes
    # run 4 steps a call (it runs alone), and such a call's profile is awaited.
    def written() -> bool:
        found = read_profiles(profile_path) if profile_path.exists() else []
        return bool(found) and (scheduling != "multi_step" or any(p.num_steps == 4 for p in found))

    deadline = time.monotonic() + 30
    while not written():
        assert time.monotonic() < deadline, "no step profile (of a multi-step call) was written"
        time.sleep(0.2)
    profiles = read_profiles(profile_path)
    for p in profiles:
        parts = max(p.rpc_s, p.commit_s) + p.process_s
        # A call's decode tokens are those of its steps (one call, one step but under multi-step scheduling;
        # a sequence that ends by length with a token in flight is not in the steps after).
        assert p.num_steps == 1 or (scheduling == "multi_step" and p.num_decode_tokens <= p.num_steps * p.num_seqs), p
        if scheduling != "async":
            parts += p.ingest_s + p.schedule_s + p.plan_s
            assert p.worker_s <= p.rpc_s, p
        # (async: the worker starts a step as it answers the one before, so the loop's wait can be the shorter)
        assert 0 < p.worker_s and parts <= p.wall_s * 1.01 + 1e-3, p
        # A plan may carry only sequences for the worker to forget (num_seqs 0).
        assert p.num_seqs == 0 or 0 < p.kv_tokens <= p.kv_slots, p
    assert any(p.num_prefill_tokens for p in profiles) and any(p.num_decode_tokens for p in profiles)


def test_the_cluster_names_each_of_its_processes(cluster: LocalCluster) -> None:
    """What benchmarks sample (CPU time, memory) by process id: every role's id is its own running process."""
    names = {role: Path(f"/proc/{cluster.pid(role)}/cmdline").read_bytes().split(b"\0") for role in
             ("worker", "scheduler", "redis")}
    assert any(b"redis-server" in part for part in names["redis"])
    for role in ("worker", "scheduler"):
        assert role.encode() in names[role], names[role]


def test_text_prompt_streams_text_and_stops_on_string(cluster: LocalCluster, reference: HFReference) -> None:
    with GenerationClient(cluster.address) as client:
        full = client.generate(make_request(prompt="The quick brown fox", max_tokens=12, temperature=0.0, ignore_eos=True))
        assert len(full.token_ids) == 12 and full.text
        # Stop on a piece of the text we know comes: the output is cut just before it.
        stop = full.text[len(full.text) // 2:][:3]
        cut = client.generate(make_request(prompt="The quick brown fox", max_tokens=12, temperature=0.0,
                                           ignore_eos=True, stop=[stop]))
    assert cut.finish_reason == "FINISH_REASON_STOP" and cut.stop_reason == stop
    assert cut.text == full.text[: full.text.index(stop)]
    assert_all_blocks_free(cluster)


def test_seeded_sampling_is_reproducible(cluster: LocalCluster) -> None:
    req = dict(prompt="Once upon a time", max_tokens=16, temperature=1.0, top_p=0.9, top_k=50, ignore_eos=True)
    reqs = [make_request(**req, seed=7), make_request(**req, seed=7), make_request(**req, seed=8)]
    a, b, c = generate_all(cluster.address, reqs)
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(), "prompt is empty"),
        (dict(prompt="hi", prompt_token_ids=[1, 2]), "exactly one"),
        (dict(prompt="hi", top_p=1.5), "top_p must be in (0, 1], got 1.5"),
        (dict(prompt="hi", temperature=-1.0), "temperature must be non-negative"),
        (dict(prompt_token_ids=[10**9]), "outside the vocabulary"),
        (dict(prompt_token_ids=[5] * 600), "maximum context length is 512"),
        (dict(prompt="hi", max_tokens=100000), "lower max_tokens"),
        (dict(messages=[("robot", "hi")]), "role must be one of"),
    ],
)
def test_bad_requests_are_invalid_argument(cluster: LocalCluster, kwargs: dict, message: str) -> None:
    with GenerationClient(cluster.address) as client, pytest.raises(grpc.RpcError) as info:
        client.generate(make_request(**kwargs), timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in info.value.details()


def test_duplicate_live_request_id_is_refused_and_cancel_frees_blocks(cluster: LocalCluster) -> None:
    with GenerationClient(cluster.address) as client:
        stream = client.stream(make_request(request_id="dup", prompt_token_ids=[7] * 50, max_tokens=400,
                                            ignore_eos=True, temperature=0.0))
        first = next(stream)  # the request is live and holds blocks
        assert first.outputs
        with pytest.raises(grpc.RpcError) as info:
            client.generate(make_request(request_id="dup", prompt="again"), timeout=30)
        assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
        stream.cancel()
    assert_all_blocks_free(cluster)


def test_idle_engine_loop_does_not_spin(cluster: LocalCluster) -> None:
    """With no work the loop blocks on its inbox (one BLPOP a second), it does not commit in a loop.

    The rest of an idle cluster's traffic is periodic too: the scheduler's supervisor tick (registry,
    replica roster, lease renewal: ~10 commands a second) and the worker's heartbeat (~2 a second).
    """
    import time

    import redis

    assert_all_blocks_free(cluster)
    client = redis.Redis.from_url(cluster.redis_url)
    before = client.info("stats")["total_commands_processed"]
    time.sleep(3.0)
    after = client.info("stats")["total_commands_processed"]
    client.close()
    # ~3 BLPOPs, ~30 supervisor and ~6 heartbeat commands plus our own INFO calls; a spinning loop makes thousands.
    assert after - before < 80, after - before


def test_abort_rpc_ends_the_stream_and_frees_blocks(cluster: LocalCluster) -> None:
    with GenerationClient(cluster.address) as client:
        stream = client.stream(make_request(request_id="to-abort", prompt_token_ids=[9] * 40, max_tokens=400,
                                            ignore_eos=True, temperature=0.0))
        assert next(stream).outputs
        client.abort("to-abort")
        last = list(stream)[-1]
        assert last.outputs[0].finish_reason == common_pb2.FINISH_REASON_ABORT
        assert last.usage.prompt_tokens == 40 and 0 < last.usage.completion_tokens < 400
        with pytest.raises(grpc.RpcError) as info:
            client.abort("to-abort")
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert_all_blocks_free(cluster)


def test_cancelling_every_third_of_60_streams_frees_everything(cluster: LocalCluster) -> None:
    """Cancelled streams abort in whichever queue their request is; the rest complete normally."""
    from concurrent.futures import ThreadPoolExecutor

    rng = random.Random(3)

    def run(i: int) -> tuple[int, str]:
        prompt = [rng.randrange(3, 40000) for _ in range(rng.randint(5, 60))]
        stream = client.stream(make_request(prompt_token_ids=prompt, max_tokens=48, ignore_eos=True, temperature=0.0))
        if i % 3 == 0:
            next(stream)
            stream.cancel()
            return i, "cancelled"
        tokens = sum(len(d.token_ids) for msg in stream for d in msg.outputs)
        return i, f"{tokens} tokens"

    with GenerationClient(cluster.address) as client, ThreadPoolExecutor(max_workers=60) as pool:
        outcomes = dict(pool.map(run, range(60)))
    assert sum(v == "cancelled" for v in outcomes.values()) == 20
    assert all(v == "48 tokens" for i, v in outcomes.items() if i % 3), outcomes
    assert_all_blocks_free(cluster)


def test_seeded_sampling_survives_preemption(cluster: LocalCluster) -> None:
    """A seeded request samples the same tokens alone and after being preempted by recompute."""
    before = redis_state(cluster)["preemptions"]
    seeded = dict(prompt_token_ids=list(range(1000, 1100)), max_tokens=200, temperature=0.8, top_p=0.95,
                  seed=1234, ignore_eos=True)
    (alone,) = generate_all(cluster.address, [make_request(**seeded)])
    # The crowd runs first and outgrows the cache by itself (4 x 22 blocks of 64 at 40 + 300 tokens).
    # The seeded request arrives last, so it is the first victim when the blocks run out, about 150
    # steps in, while it still has about 50 of its 200 tokens to go.
    crowd = [make_request(prompt_token_ids=[(31 * i + 7 * j) % 40000 + 100 for j in range(40)], max_tokens=300,
                          ignore_eos=True, temperature=1.0) for i in range(4)]
    with GenerationClient(cluster.address) as client:
        streams = Streams(client, crowd)
        streams.wait_started(60)
        loaded = client.generate(make_request(**seeded))
        streams.join(120)
    assert loaded.token_ids == alone.token_ids
    assert redis_state(cluster)["preemptions"] > before
    assert_all_blocks_free(cluster)


def test_parallel_sampling_with_a_seed_is_reproducible(cluster: LocalCluster) -> None:
    """n = 3 sequences per request: distinct, each reproducible, and every block freed afterwards."""
    req = dict(prompt_token_ids=list(range(500, 537)), max_tokens=20, temperature=1.0, top_k=100, ignore_eos=True,
               n=3, seed=77)
    with GenerationClient(cluster.address) as client:
        first = client.generate_n(make_request(**req))
    crowd = [make_request(prompt_token_ids=p, max_tokens=20, ignore_eos=True, temperature=0.0) for p in _prompts(6, 40000)]
    with GenerationClient(cluster.address) as client, ThreadPoolExecutor(max_workers=8) as pool:
        again = pool.submit(client.generate_n, make_request(**req))
        for f in [pool.submit(client.generate, r) for r in crowd]:
            f.result()
        second = again.result()
    assert [c.token_ids for c in first] == [c.token_ids for c in second]
    assert len({tuple(c.token_ids) for c in first}) == 3
    assert all(len(c.token_ids) == 20 and c.finish_reason == "FINISH_REASON_LENGTH" for c in first)
    assert first[0].completion_tokens == 60
    assert_all_blocks_free(cluster)


@pytest.fixture(scope="module")
def swap_cluster(tiny_llama_dir: Path, scheduling: str) -> Iterator[LocalCluster]:
    """A cache of 40 blocks plus a CPU swap pool, so forked groups are swapped out under load."""
    spec = ClusterSpec(
        model=str(tiny_llama_dir),
        worker_args=["--num-gpu-blocks-override", "40", "--swap-space", "0.005", "--max-model-len", "256",
                     "--num-threads", "1"],
        scheduler_args=SCHEDULING[scheduling],
    )
    with LocalCluster(spec) as c:
        yield c


def test_swap_and_recompute_preemption_keep_outputs_identical(swap_cluster: LocalCluster) -> None:
    """Seeded n = 2 requests give the same tokens alone and under loads that recompute and swap."""
    reqs = [make_request(prompt_token_ids=list(range(700 + 9 * i, 740 + 9 * i)), max_tokens=48, temperature=0.9,
                         ignore_eos=True, n=2, seed=50 + i) for i in range(6)]
    with GenerationClient(swap_cluster.address) as client:
        alone = [client.generate_n(r) for r in reqs[:3]]
        # Greedy singles first: they need 6 x 11 blocks (60 + 110 tokens) of the 40 when they run together, so
        # some of them are preempted by recompute. They are sent while the worker is stopped, so that the engine
        # loop takes them in together: on a busy machine their calls could otherwise arrive so far apart that the
        # first ones finish before the last ones start, and nothing is preempted (seen once in CI).
        singles = [make_request(prompt_token_ids=p[:60], max_tokens=110, ignore_eos=True, temperature=0.0)
                   for p in _prompts(6, 40000, seed=4)]
        rds = redis.Redis.from_url(swap_cluster.redis_url)
        os.kill(swap_cluster.pid("worker"), signal.SIGSTOP)
        try:
            greedy = Streams(client, singles)
            wait_for(lambda: rds.scard(keys.live(swap_cluster.worker_address)) == len(singles), 60,
                     "the singles were not all admitted")
        finally:
            os.kill(swap_cluster.pid("worker"), signal.SIGCONT)
            rds.close()
        greedy.wait_started(60)
        assert all(len(r[0].token_ids) == 110 for r in greedy.join(120))
        assert redis_state(swap_cluster)["preemptions"] > 0, "the singles finished without a preemption"
        # Then the forked groups, all at once into the emptied cache: the six of them need 6 x 10 blocks (a shared
        # 2-block prompt, 4 blocks per sequence), so the latest-arrived, decoding by then, are preempted by
        # swapping. (Sent while the singles still ran, they were admitted as the singles' blocks came free, and
        # under a busy machine's timing they once finished without ever holding more than the cache.)
        with ThreadPoolExecutor(max_workers=len(reqs)) as pool:
            results = [f.result() for f in [pool.submit(client.generate_n, r) for r in reqs]]
    for solo, loaded in zip(alone, results[:3]):
        assert [c.token_ids for c in solo] == [c.token_ids for c in loaded]
    state = redis_state(swap_cluster)
    print(f"preemptions: {state['preemptions']} (of which swaps: {state['swaps']})")
    assert state["swaps"] > 0 and state["preemptions"] > state["swaps"], state
    assert_all_blocks_free(swap_cluster)


def test_best_of_returns_the_n_most_likely_sequences(cluster: LocalCluster, reference: HFReference) -> None:
    """best_of = 4, n = 2 returns the two of the four sampled sequences that transformers finds most likely."""
    import torch

    prompt = list(range(900, 930))
    base = dict(prompt_token_ids=prompt, max_tokens=12, temperature=1.0, ignore_eos=True, seed=99)
    with GenerationClient(cluster.address) as client:
        all_four = client.generate_n(make_request(**base, n=4))
        best_two = client.generate_n(make_request(**base, n=2, best_of=4))
    assert len(all_four) == 4 and len(best_two) == 2

    def score(tokens: list[int]) -> float:
        with torch.inference_mode():
            logits = reference.model(torch.tensor([prompt + tokens])).logits[0].float()
        logprobs = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
        return float(logprobs[torch.arange(len(tokens)), torch.tensor(tokens)].sum())

    ranked = sorted(all_four, key=lambda c: score(c.token_ids), reverse=True)
    assert [c.token_ids for c in best_two] == [c.token_ids for c in ranked[:2]]
    assert all(c.text and c.finish_reason == "FINISH_REASON_LENGTH" for c in best_two)
    assert best_two[0].completion_tokens == 24
    assert_all_blocks_free(cluster)


def test_logprobs_match_transformers(cluster: LocalCluster, reference: HFReference) -> None:
    """Each token's logprob and the top-3 at its position agree with HF's log_softmax within 1e-4."""
    prompt = list(range(1200, 1241))
    with GenerationClient(cluster.address) as client:
        out = client.generate(make_request(prompt_token_ids=prompt, max_tokens=10, temperature=0.0,
                                           ignore_eos=True, logprobs=3))
        plain = client.generate(make_request(prompt_token_ids=prompt, max_tokens=2, temperature=0.0, ignore_eos=True))
    assert plain.logprobs == []
    ref = reference.greedy(prompt, 10, stop_at_eos=False)
    assert out.token_ids == ref.token_ids and len(out.logprobs) == 10
    for position, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        expected = ref.logprobs[position]
        assert abs(entry.logprob - float(expected[token])) < 1e-4
        top_values, top_ids = expected.topk(3)
        assert [t.token_id for t in entry.top] == top_ids.tolist()
        assert max(abs(t.logprob - float(v)) for t, v in zip(entry.top, top_values)) < 1e-4


def test_prompt_logprobs_match_transformers(cluster: LocalCluster, reference: HFReference) -> None:
    """Every prompt token's logprob and the top-3 at its position agree with HF's log_softmax within 1e-4."""
    import torch

    prompt = list(range(1300, 1341))
    with GenerationClient(cluster.address) as client:
        out = client.generate(make_request(prompt_token_ids=prompt, max_tokens=4, temperature=0.0,
                                           ignore_eos=True, prompt_logprobs=3))
        plain = client.generate(make_request(prompt_token_ids=prompt, max_tokens=2, temperature=0.0, ignore_eos=True))
    assert plain.prompt_logprobs == []
    assert out.prompt_logprobs_start == 1 and len(out.prompt_logprobs) == len(prompt) - 1
    with torch.inference_mode():
        expected = torch.log_softmax(reference.model(torch.tensor([prompt])).logits[0, :-1].float(), dim=-1)
    for position, entry in enumerate(out.prompt_logprobs):
        assert abs(entry.logprob - float(expected[position, prompt[position + 1]])) < 1e-4
        top_values, top_ids = expected[position].topk(3)
        assert [t.token_id for t in entry.top] == top_ids.tolist()
        assert max(abs(t.logprob - float(v)) for t, v in zip(entry.top, top_values)) < 1e-4
    assert_all_blocks_free(cluster)


def _penalized_greedy(
    reference: HFReference, prompt: list[int], steps: int, repetition: float, frequency: float, presence: float
) -> list[int]:
    """Straightforward reference: full forward per token, vLLM's penalties on the last logits, argmax."""
    import torch

    tokens: list[int] = []
    with torch.inference_mode():
        for _ in range(steps):
            logits = reference.model(torch.tensor([prompt + tokens])).logits[0, -1].float()
            for token in set(prompt + tokens):
                logits[token] = logits[token] / repetition if logits[token] > 0 else logits[token] * repetition
            for token in set(tokens):
                logits[token] -= frequency * tokens.count(token) + presence
            tokens.append(int(logits.argmax()))
    return tokens


# The tiny random model never repeats a token greedily, so penalties that discourage repeats change
# nothing; these encourage them (repetition < 1, negative frequency / presence), which they visibly do.
@pytest.mark.parametrize(
    ("repetition", "frequency", "presence"), [(0.3, 0.0, 0.0), (1.0, -2.0, 0.0), (1.0, 0.0, -2.0), (0.5, -1.0, -1.0)]
)
def test_penalties_match_a_reference_end_to_end(
    cluster: LocalCluster, reference: HFReference, repetition: float, frequency: float, presence: float
) -> None:
    rng = random.Random(0)
    prompt = [rng.randrange(3, 2000) for _ in range(12)]
    penalties = dict(repetition_penalty=repetition, frequency_penalty=frequency, presence_penalty=presence)
    with GenerationClient(cluster.address) as client:
        plain = client.generate(make_request(prompt_token_ids=prompt, max_tokens=16, temperature=0.0, ignore_eos=True))
        out = client.generate(make_request(prompt_token_ids=prompt, max_tokens=16, temperature=0.0, ignore_eos=True,
                                           **penalties))
    assert out.token_ids == _penalized_greedy(reference, prompt, 16, repetition, frequency, presence)
    assert out.token_ids != plain.token_ids
    assert_all_blocks_free(cluster)


def test_min_tokens_holds_back_stop_tokens_end_to_end(cluster: LocalCluster, reference: HFReference) -> None:
    prompt = list(range(1500, 1520))
    ref = reference.greedy(prompt, 1, stop_at_eos=False)
    first, second_best = ref.logprobs[0].topk(2).indices.tolist()
    base = dict(prompt_token_ids=prompt, max_tokens=8, temperature=0.0, ignore_eos=True, stop_token_ids=[first])
    with GenerationClient(cluster.address) as client:
        stopped = client.generate(make_request(**base))
        held = client.generate(make_request(**base, min_tokens=3))
    assert stopped.token_ids == [first] and stopped.finish_reason == "FINISH_REASON_STOP"
    # The worker masks the stop token for three outputs: greedy takes the runner-up first.
    assert held.token_ids[0] == second_best and len(held.token_ids) >= 3
    assert first not in held.token_ids[:3]
    assert_all_blocks_free(cluster)


def test_a_stop_token_ends_the_stream_where_it_was_sampled(cluster: LocalCluster, reference: HFReference) -> None:
    """Concurrent greedy streams end at a stop token; with async scheduling the step planned behind it
    runs and its token never reaches the client."""
    rng = random.Random(5)
    cases = []
    for i in range(6):
        prompt = [rng.randrange(3, reference.model.config.vocab_size) for _ in range(rng.randint(8, 80))]
        ref = reference.greedy(prompt, 24, stop_at_eos=False)
        # The first output token that did not come before: the greedy stream ends right after it.
        at = next(k for k in range(4 + i, 24) if ref.token_ids[k] not in ref.token_ids[:k])
        cases.append((prompt, Reference(ref.token_ids[: at + 1], ref.logprobs[: at + 1])))
    requests = [make_request(prompt_token_ids=p, max_tokens=24, temperature=0.0, ignore_eos=True,
                             stop_token_ids=[want.token_ids[-1]]) for p, want in cases]
    for (_, want), result in zip(cases, generate_all(cluster.address, requests)):
        cmp = compare_greedy(result.token_ids, want)
        assert cmp.matched, cmp.detail
        if cmp.near_tie_at is None:  # (past a near-tie the stream may legitimately go elsewhere)
            assert result.finish_reason == "FINISH_REASON_STOP" and result.completion_tokens == len(want.token_ids)
    assert_all_blocks_free(cluster)


def test_model_info_and_tokenize(cluster: LocalCluster, tiny_llama_dir: Path) -> None:
    """ModelInfo reports the limits admission uses; Tokenize gives exactly the tokens Generate computes."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    with GenerationClient(cluster.address) as client:
        info = client.model_info()
        assert (info.max_model_len, info.vocab_size, info.num_workers) == (512, len(tokenizer), 1)
        assert info.eos_token_id == tokenizer.eos_token_id and info.has_chat_template
        text = client.tokenize(prompt="The quick brown fox")
        assert list(text.token_ids) == tokenizer("The quick brown fox").input_ids
        assert list(text.tokens) == tokenizer.convert_ids_to_tokens(list(text.token_ids))
        chat = client.tokenize(messages=[("user", "Hi there")])
        done = client.generate(make_request(messages=[("user", "Hi there")], max_tokens=1, temperature=0.0))
        assert done.prompt_tokens == len(chat.token_ids) and chat.tokens[-1] == tokenizer.convert_ids_to_tokens(
            chat.token_ids[-1])
        with pytest.raises(grpc.RpcError) as err:
            client.tokenize(messages=[("robot", "beep")])
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "role" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            client.tokenize()
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_a_deadline_ends_the_call_and_frees_the_request(cluster: LocalCluster) -> None:
    """A client deadline cancels the call with DEADLINE_EXCEEDED; the request is aborted, its blocks freed."""
    request = make_request(prompt_token_ids=list(range(3000, 3100)), max_tokens=400, temperature=0.0, ignore_eos=True)
    worker_pid = cluster.pid("worker")  # the test freezes the worker process
    received = 0
    frozen = False
    try:
        with GenerationClient(cluster.address) as client:
            with pytest.raises(grpc.RpcError) as err:
                for msg in client.stream(request, timeout=3.0):
                    received += sum(len(d.token_ids) for d in msg.outputs)
                    if received and not frozen:
                        # The request is running: with its worker frozen it cannot finish before the deadline,
                        # however fast the machine (the tiny model writes 400 tokens in well under a second).
                        os.kill(worker_pid, signal.SIGSTOP)
                        frozen = True
    finally:
        if frozen:
            os.kill(worker_pid, signal.SIGCONT)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert received < 400
    assert_all_blocks_free(cluster)


def test_health_and_reflection_on_every_service(cluster: LocalCluster) -> None:
    """grpc.health.v1 reports SERVING for each service; reflection lists them."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    for address, service in ((cluster.address, "llmserve.v1.Generation"), (cluster.worker_address, "llmserve.v1.Worker")):
        with grpc.insecure_channel(address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            for name in ("", service):
                reply = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=10)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING, (address, name)
            reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
            (answer,) = reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                                        timeout=10)
            names = {s.name for s in answer.list_services_response.service}
            assert {service, "grpc.health.v1.Health"} <= names, names
            # grpc.reflection.v1 too (same messages, new package): it lists and describes the same services.
            v1 = channel.stream_stream("/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
                                       request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                                       response_deserializer=reflection_pb2.ServerReflectionResponse.FromString)
            listed, described = v1(iter([reflection_pb2.ServerReflectionRequest(list_services=""),
                                         reflection_pb2.ServerReflectionRequest(file_containing_symbol=service)]),
                                   timeout=10)
            assert {s.name for s in listed.list_services_response.service} == names
            assert described.file_descriptor_response.file_descriptor_proto, described

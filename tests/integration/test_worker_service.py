"""The worker service over real gRPC: fencing, plan validation, staying up after bad plans."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from protos import common_pb2, worker_pb2, worker_pb2_grpc
from llmserve.local_cluster import wait_serving
from shared.redis_server import free_port
from tests.worker_steps import execute_step, execute_steps

BLOCKS = 32


@pytest.fixture(scope="module")
def worker(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[worker_pb2_grpc.WorkerStub]:
    port = free_port()
    log = tmp_path_factory.mktemp("worker") / "worker.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "llmserve", "worker", "--model", str(tiny_llama_dir), "--host", "127.0.0.1",
             "--port", str(port), "--num-gpu-blocks-override", str(BLOCKS), "--max-model-len", "256"],
            stdout=out, stderr=subprocess.STDOUT,
        )
    def check_alive() -> None:
        if proc.poll() is not None:
            pytest.fail(f"worker exited: {log.read_text()}")

    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        if not wait_serving(f"127.0.0.1:{port}", 120, check_alive):
            pytest.fail(f"worker not ready: {log.read_text()}")
        yield worker_pb2_grpc.WorkerStub(channel)
    finally:
        channel.close()
        proc.terminate()
        proc.wait(timeout=15)


def _new_seq(seq_id: int, prompt: list[int], table: list[int]) -> worker_pb2.NewSequence:
    return worker_pb2.NewSequence(
        seq_id=seq_id, prompt_token_ids=prompt, block_table=table, num_computed_tokens=0,
        num_new_tokens=len(prompt), sampling=common_pb2.SamplingParams(temperature=0.0),
    )


def test_describe_reports_the_cache(worker: worker_pb2_grpc.WorkerStub) -> None:
    desc = worker.Describe(worker_pb2.DescribeRequest(), timeout=10)
    assert desc.num_gpu_blocks == BLOCKS and desc.block_size == 16 and desc.max_model_len == 256
    assert desc.dtype == "float32" and desc.device == "cpu" and len(desc.instance_id) == 32


def test_fencing_rejects_older_epochs(worker: worker_pb2_grpc.WorkerStub) -> None:
    worker.Reset(worker_pb2.ResetRequest(epoch=10), timeout=10)
    with pytest.raises(grpc.RpcError) as info:
        execute_step(worker, worker_pb2.StepPlan(epoch=9, step_id=1), timeout=10)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "older than the current epoch 10" in info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        worker.Reset(worker_pb2.ResetRequest(epoch=3), timeout=10)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert worker.Describe(worker_pb2.DescribeRequest(), timeout=10).epoch == 10


def test_bad_plans_are_invalid_argument_and_the_worker_stays_up(worker: worker_pb2_grpc.WorkerStub) -> None:
    worker.Reset(worker_pb2.ResetRequest(epoch=20), timeout=10)
    bad_plans = {
        "not cached": worker_pb2.StepPlan(epoch=20, step_id=1, cached_sequences=[worker_pb2.SequenceDelta(seq_id=99, num_new_tokens=1)]),
        "do not fit": worker_pb2.StepPlan(epoch=20, step_id=2, new_sequences=[_new_seq(1, list(range(5, 40)), [0])]),
        "out of range": worker_pb2.StepPlan(epoch=20, step_id=3, copy=[worker_pb2.BlockPair(src=0, dst=BLOCKS + 5)]),
    }
    for fragment, plan in bad_plans.items():
        with pytest.raises(grpc.RpcError) as info:
            execute_step(worker, plan, timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, fragment
        assert fragment in info.value.details()
    # After a reset the same worker serves a valid plan: prefill then a decode delta.
    worker.Reset(worker_pb2.ResetRequest(epoch=21), timeout=10)
    first = execute_step(worker, worker_pb2.StepPlan(epoch=21, step_id=1, new_sequences=[_new_seq(1, [5, 6, 7], [2])]), timeout=30)
    assert [s.seq_id for s in first.sampled] == [1]
    # A delta whose count of the sequence's tokens is not the worker's (3 prompt tokens + 1 sampled) is refused
    # and changes nothing: the scheduler and the worker no longer see the same sequence.
    with pytest.raises(grpc.RpcError) as info:
        execute_step(worker, worker_pb2.StepPlan(epoch=21, step_id=2, cached_sequences=[
            worker_pb2.SequenceDelta(seq_id=1, num_new_tokens=1, num_tokens=5)]), timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sequence 1: the scheduler counts 5 tokens, the worker holds 4" in info.value.details()
    second = execute_step(worker, worker_pb2.StepPlan(
        epoch=21, step_id=2, cached_sequences=[worker_pb2.SequenceDelta(seq_id=1, num_new_tokens=1, num_tokens=4)]),
        timeout=30)
    assert [s.seq_id for s in second.sampled] == [1]
    desc = worker.Describe(worker_pb2.DescribeRequest(), timeout=10)
    assert desc.num_cached_sequences == 1 and desc.num_used_blocks == 1
    execute_step(worker, worker_pb2.StepPlan(epoch=21, step_id=3, finished_seq_ids=[1]), timeout=10)
    assert worker.Describe(worker_pb2.DescribeRequest(), timeout=10).num_cached_sequences == 0


def test_a_step_batch_runs_its_plans_in_order_as_single_steps_would(worker: worker_pb2_grpc.WorkerStub) -> None:
    """A call of several plans (multi-step): each decode reads the token the plan before sampled; the tokens are those of one plan a
    call, and an empty batch or a stale epoch is refused before anything runs."""
    def prefill(epoch: int) -> worker_pb2.StepResult:
        worker.Reset(worker_pb2.ResetRequest(epoch=epoch), timeout=10)
        return execute_step(worker, worker_pb2.StepPlan(epoch=epoch, step_id=1, new_sequences=[
            _new_seq(1, list(range(40, 50)), [3])]), timeout=30)

    def decode(epoch: int, step_id: int, num_tokens: int) -> worker_pb2.StepPlan:
        return worker_pb2.StepPlan(epoch=epoch, step_id=step_id, cached_sequences=[
            worker_pb2.SequenceDelta(seq_id=1, num_new_tokens=1, num_tokens=num_tokens)])

    first = prefill(24)
    one_a_call = [first.sampled[0].token_id]
    one_a_call += [execute_step(worker, decode(24, 2 + i, 11 + i), timeout=30).sampled[0].token_id for i in range(3)]
    again = prefill(25)
    batch = execute_steps(worker, [decode(25, 2 + i, 11 + i) for i in range(3)], timeout=30)
    assert [r.step_id for r in batch.results] == [2, 3, 4]
    assert [again.sampled[0].token_id] + [r.sampled[0].token_id for r in batch.results] == one_a_call
    with pytest.raises(grpc.RpcError) as info:
        execute_steps(worker, [], timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "holds no plan" in info.value.details()
    # A stale plan anywhere in the batch refuses it whole: the sequence's next decode is still the 5th token.
    with pytest.raises(grpc.RpcError) as info:
        execute_steps(worker, [decode(25, 5, 14), decode(22, 6, 15)], timeout=10)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert execute_step(worker, decode(25, 5, 14), timeout=30).sampled[0].seq_id == 1
    execute_step(worker, worker_pb2.StepPlan(epoch=25, step_id=6, finished_seq_ids=[1]), timeout=10)


def test_prompt_logprobs_over_two_prefill_chunks_match_transformers(
    worker: worker_pb2_grpc.WorkerStub, tiny_llama_dir: Path
) -> None:
    """A 30-token prompt prefilled as 12 + 18 tokens: each chunk returns its prompt tokens' logprobs."""
    import torch

    from tests.hf_reference import HFReference

    prompt = list(range(300, 330))
    worker.Reset(worker_pb2.ResetRequest(epoch=30), timeout=10)
    new = worker_pb2.NewSequence(
        seq_id=5, prompt_token_ids=prompt, block_table=[0, 1], num_computed_tokens=0, num_new_tokens=12,
        sampling=common_pb2.SamplingParams(temperature=0.0, prompt_logprobs=2),
    )
    first = execute_step(worker, worker_pb2.StepPlan(epoch=30, step_id=1, new_sequences=[new]), timeout=30)
    second = execute_step(worker, worker_pb2.StepPlan(
        epoch=30, step_id=2, cached_sequences=[worker_pb2.SequenceDelta(seq_id=5, num_new_tokens=18)]), timeout=30)
    third = execute_step(worker, worker_pb2.StepPlan(
        epoch=30, step_id=3, cached_sequences=[worker_pb2.SequenceDelta(seq_id=5, num_new_tokens=1)]), timeout=30)
    execute_step(worker, worker_pb2.StepPlan(epoch=30, step_id=4, finished_seq_ids=[5]), timeout=10)
    assert [(p.seq_id, p.start, len(p.positions)) for p in first.prompt_logprobs] == [(5, 1, 12)]
    assert [(p.seq_id, p.start, len(p.positions)) for p in second.prompt_logprobs] == [(5, 13, 17)]
    assert not third.prompt_logprobs and not first.sampled and [s.seq_id for s in second.sampled] == [5]
    entries = [*first.prompt_logprobs[0].positions, *second.prompt_logprobs[0].positions]
    reference = HFReference(str(tiny_llama_dir)).model
    with torch.inference_mode():
        expected = torch.log_softmax(reference(torch.tensor([prompt])).logits[0, :-1].float(), dim=-1)
    for position, entry in enumerate(entries):
        assert abs(entry.logprob - float(expected[position, prompt[position + 1]])) < 1e-4
        values, ids = expected[position].topk(2)
        assert [t.token_id for t in entry.top] == ids.tolist()
        assert max(abs(t.logprob - float(v)) for t, v in zip(entry.top, values)) < 1e-4
        # The token's rank in the vocabulary, up to the tokens within rounding of its logprob.
        target = float(expected[position, prompt[position + 1]])
        surely_ahead = int((expected[position] > target + 1e-4).sum())
        maybe_ahead = int((expected[position] >= target - 1e-4).sum())
        assert surely_ahead + 1 <= entry.rank <= maybe_ahead


def test_a_fence_only_reset_keeps_the_cache_and_resume_checks_each_view(worker: worker_pb2_grpc.WorkerStub) -> None:
    """A new owner fences without a reset, gets the last steps' results, and resumes what matches the cache."""
    prompt = list(range(5, 21))  # one full block
    worker.Reset(worker_pb2.ResetRequest(epoch=100), timeout=10)
    first = execute_step(worker, worker_pb2.StepPlan(epoch=100, step_id=1, new_sequences=[_new_seq(77, prompt, [0, 1])]),
                               timeout=30)
    second = execute_step(worker, worker_pb2.StepPlan(epoch=100, step_id=2, cached_sequences=[
        worker_pb2.SequenceDelta(seq_id=77, num_new_tokens=1)]), timeout=30)
    recomputed = worker.Describe(worker_pb2.DescribeRequest(), timeout=10).num_recomputed_tokens

    fenced = worker.Reset(worker_pb2.ResetRequest(epoch=101, keep_cache=True), timeout=10)
    assert [(s.epoch, s.step_id) for s in fenced.last_steps] == [(100, 1), (100, 2)]
    assert [s.result.sampled[0].token_id for s in fenced.last_steps] == [first.sampled[0].token_id,
                                                                         second.sampled[0].token_id]
    newest = fenced.last_steps[-1].sequences[0]
    assert (newest.seq_id, newest.num_computed_tokens, newest.num_new_tokens, list(newest.block_table)) == (77, 16, 1, [0, 1])
    assert worker.Describe(worker_pb2.DescribeRequest(), timeout=10).num_cached_sequences == 1

    outputs = [first.sampled[0].token_id, second.sampled[0].token_id]
    view = worker_pb2.NewSequence(seq_id=77, prompt_token_ids=prompt, output_token_ids=outputs, block_table=[0, 1],
                                  num_computed_tokens=17, sampling=common_pb2.SamplingParams(temperature=0.0))
    with pytest.raises(grpc.RpcError) as info:
        worker.Resume(worker_pb2.ResumeSequencesRequest(epoch=100, sequences=[view]), timeout=10)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    # A view of another sequence is refused (not cached); the matching one goes on as a delta.
    stranger = worker_pb2.NewSequence(seq_id=78, prompt_token_ids=prompt, block_table=[3], num_computed_tokens=16,
                                      sampling=common_pb2.SamplingParams(temperature=0.0))
    resumed = worker.Resume(worker_pb2.ResumeSequencesRequest(epoch=101, sequences=[view, stranger]), timeout=10)
    assert [(r.seq_id, r.reason, r.not_cached) for r in resumed.refused] == [(78, "not cached on this worker", True)]
    third = execute_step(worker, worker_pb2.StepPlan(epoch=101, step_id=1, cached_sequences=[
        worker_pb2.SequenceDelta(seq_id=77, num_new_tokens=1)]), timeout=30)
    assert len(third.sampled) == 1
    assert worker.Describe(worker_pb2.DescribeRequest(), timeout=10).num_recomputed_tokens == recomputed

    # A view whose blocks disagree with the cache is refused; recomputing it counts every position again.
    worker.Reset(worker_pb2.ResetRequest(epoch=102, keep_cache=True), timeout=10)
    moved = worker_pb2.NewSequence()
    moved.CopyFrom(view)
    moved.block_table[:] = [0, 2]
    resumed = worker.Resume(worker_pb2.ResumeSequencesRequest(epoch=102, sequences=[moved]), timeout=10)
    assert [(r.seq_id, r.reason, r.not_cached) for r in resumed.refused] == [
        (77, "block 1 of its table is 2 in the view, 1 on the worker", False)]
    assert worker.Describe(worker_pb2.DescribeRequest(), timeout=10).num_cached_sequences == 0
    again = _new_seq(77, prompt + outputs, [0, 2])
    execute_step(worker, worker_pb2.StepPlan(epoch=102, step_id=1, new_sequences=[again]), timeout=30)
    assert worker.Describe(worker_pb2.DescribeRequest(), timeout=10).num_recomputed_tokens == recomputed + 18


def test_a_cache_larger_than_the_memory_left_stops_the_worker_at_start(tiny_llama_dir: Path) -> None:
    """`--kv-cache-memory` beyond what the host has: refused before the cache is allocated (with zeroed pages
    reserved, not backed, it would start and be OOM-killed once requests filled it), naming the flag; exit 2."""
    done = subprocess.run([sys.executable, "-m", "llmserve", "worker", "--model", str(tiny_llama_dir), "--host",
                           "127.0.0.1", "--port", str(free_port()), "--kv-cache-memory", "1000000"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "llmserve worker: error: the KV cache needs 1000000.00 GiB of host memory (the cache 1000000.00 GiB) " \
           "but only " in done.stderr, done.stderr
    assert "lower --kv-cache-memory" in done.stderr and "Traceback" not in done.stderr, done.stderr

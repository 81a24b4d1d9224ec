"""Tensor parallelism on CPUs (gloo): a worker of 2 ranks against one of 1 rank and transformers.

Both workers run as real `llmserve worker` processes (the TP-2 one starts its rank 1) and are
driven through the Worker gRPC API with plans as the scheduler sends them: prefills, a
prefill joining running decodes, deltas, finished ids, a seeded random row, prompt logprobs.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from transformers import AutoConfig

from llmserve.local_cluster import wait_serving
from protos import common_pb2, worker_pb2, worker_pb2_grpc
from shared.redis_server import free_port
from tests.hf_reference import HFReference, compare_greedy
from tests.worker_steps import execute_step
from worker_service.sharding import TensorParallelError, check_tensor_parallel

BLOCK = 16
MAX_NEW = 12
RPC_TIMEOUT = 60


@dataclass
class Worker:
    proc: subprocess.Popen
    log: Path
    stub: worker_pb2_grpc.WorkerStub
    channel: grpc.Channel


def _start(model: Path, log: Path, tp: int) -> tuple[subprocess.Popen, int]:
    port = free_port()
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "llmserve", "worker", "--model", str(model), "--host", "127.0.0.1",
             "--port", str(port), "--num-gpu-blocks-override", "64", "--max-model-len", "256",
             "--num-threads", "1", "--tensor-parallel-size", str(tp)],
            stdout=out, stderr=subprocess.STDOUT,
        )
    return proc, port


def _connect(proc: subprocess.Popen, port: int, log: Path) -> Worker:
    def check_alive() -> None:
        if proc.poll() is not None:
            pytest.fail(f"worker exited ({proc.returncode}): {log.read_text()}")

    if not wait_serving(f"127.0.0.1:{port}", 120, check_alive):
        pytest.fail(f"worker not ready: {log.read_text()}")
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    return Worker(proc, log, worker_pb2_grpc.WorkerStub(channel), channel)


def _stop(worker: Worker) -> None:
    worker.channel.close()
    if worker.proc.poll() is None:
        worker.proc.terminate()
        worker.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def workers(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[int, Worker]]:
    """TP 1 and TP 2 workers on the tiny Llama (4 query / 2 KV heads), started side by side."""
    logs = tmp_path_factory.mktemp("tp-workers")
    started = {tp: (*_start(tiny_llama_dir, logs / f"tp{tp}.log", tp), logs / f"tp{tp}.log") for tp in (1, 2)}
    out: dict[int, Worker] = {}
    try:
        for tp, (proc, port, log) in started.items():
            out[tp] = _connect(proc, port, log)
        yield out
    finally:
        for tp, (proc, _, _) in started.items():
            if tp in out:
                _stop(out[tp])
            elif proc.poll() is None:
                proc.kill()


@dataclass
class Seq:
    """One sequence the test schedules: its prompt, blocks, the step it joins, what came back."""

    seq_id: int
    prompt: list[int]
    blocks: list[int]
    sampling: common_pb2.SamplingParams
    join_step: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    prompt_logprobs: list[float] = field(default_factory=list)


def _sequences(vocab: int) -> list[Seq]:
    greedy = common_pb2.SamplingParams(temperature=0.0, ignore_eos=True)
    specs = [  # (prompt length, step it joins, sampling)
        (7, 1, greedy),
        (23, 1, common_pb2.SamplingParams(temperature=0.0, ignore_eos=True, prompt_logprobs=1)),
        (40, 3, greedy),  # a prefill joining two running decodes
        (12, 3, common_pb2.SamplingParams(temperature=0.8, seed=7, ignore_eos=True)),
        (30, 6, greedy),
    ]
    seqs, next_block = [], 0
    for i, (length, join, sampling) in enumerate(specs):
        prompt = [(37 * i + 11 * p) % (vocab - 3) + 3 for p in range(length)]
        n_blocks = -(-(length + MAX_NEW) // BLOCK)
        seqs.append(Seq(i + 1, prompt, list(range(next_block, next_block + n_blocks)), sampling, join))
        next_block += n_blocks
    return seqs


def _run(stub: worker_pb2_grpc.WorkerStub, epoch: int) -> list[Seq]:
    """Schedules every sequence to MAX_NEW tokens as the scheduler would; returns what was sampled."""
    stub.Reset(worker_pb2.ResetRequest(epoch=epoch), timeout=RPC_TIMEOUT)
    seqs = _sequences(stub.Describe(worker_pb2.DescribeRequest(), timeout=RPC_TIMEOUT).vocab_size)
    running: list[Seq] = []
    finished: list[int] = []
    step = 0
    while step == 0 or running or any(s.join_step > step for s in seqs):
        step += 1
        joining = [s for s in seqs if s.join_step == step]
        plan = worker_pb2.StepPlan(
            epoch=epoch, step_id=step, finished_seq_ids=finished,
            new_sequences=[worker_pb2.NewSequence(
                seq_id=s.seq_id, prompt_token_ids=s.prompt, block_table=s.blocks, num_computed_tokens=0,
                num_new_tokens=len(s.prompt), sampling=s.sampling) for s in joining],
            cached_sequences=[worker_pb2.SequenceDelta(seq_id=s.seq_id, num_new_tokens=1) for s in running],
        )
        result = execute_step(stub, plan, timeout=RPC_TIMEOUT)
        by_id = {s.seq_id: s for s in seqs}
        for sampled in result.sampled:
            by_id[sampled.seq_id].tokens.append(sampled.token_id)
            by_id[sampled.seq_id].logprobs.append(sampled.logprob)
        for p in result.prompt_logprobs:
            by_id[p.seq_id].prompt_logprobs.extend(pos.logprob for pos in p.positions)
        running += joining
        finished = [s.seq_id for s in running if len(s.tokens) == MAX_NEW]
        running = [s for s in running if len(s.tokens) < MAX_NEW]
    execute_step(stub, worker_pb2.StepPlan(epoch=epoch, step_id=step + 1, finished_seq_ids=finished),
                     timeout=RPC_TIMEOUT)
    return seqs


@pytest.fixture(scope="module")
def tp1_run(workers: dict[int, Worker]) -> list[Seq]:
    return _run(workers[1].stub, epoch=1)


def _assert_same(ours: list[Seq], expected: list[Seq]) -> None:
    for a, b in zip(ours, expected):
        assert len(a.tokens) == MAX_NEW
        assert a.tokens == b.tokens, f"sequence {a.seq_id}"
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
        assert len(a.prompt_logprobs) == len(b.prompt_logprobs)
        assert all(abs(x - y) < 1e-4 for x, y in zip(a.prompt_logprobs, b.prompt_logprobs))


def test_describe_reports_the_shared_block_count(workers: dict[int, Worker]) -> None:
    one = workers[1].stub.Describe(worker_pb2.DescribeRequest(), timeout=10)
    two = workers[2].stub.Describe(worker_pb2.DescribeRequest(), timeout=10)
    assert two.num_gpu_blocks == one.num_gpu_blocks == 64 and two.block_size == BLOCK
    assert (two.vocab_size, two.max_model_len, two.dtype) == (one.vocab_size, one.max_model_len, "float32")
    assert "rank 1 ready: 64 KV blocks of 1 KV heads" in workers[2].log.read_text()


def test_tp2_matches_tp1_and_transformers(workers: dict[int, Worker], tp1_run: list[Seq],
                                          tiny_llama_dir: Path) -> None:
    tp2_run = _run(workers[2].stub, epoch=1)
    assert len(tp2_run[1].prompt_logprobs) == len(tp2_run[1].prompt) - 1
    _assert_same(tp2_run, tp1_run)
    reference = HFReference(str(tiny_llama_dir))
    near_ties = []
    for seq in tp2_run:
        if seq.sampling.temperature != 0.0:
            continue
        ref = reference.greedy(seq.prompt, MAX_NEW, stop_at_eos=False)
        cmp = compare_greedy(seq.tokens, ref)
        assert cmp.matched, f"sequence {seq.seq_id}: {cmp.detail}"
        exact = MAX_NEW if cmp.near_tie_at is None else cmp.near_tie_at
        if cmp.near_tie_at is not None:
            near_ties.append(cmp.detail)
        for i in range(exact):
            assert abs(seq.logprobs[i] - float(ref.logprobs[i, seq.tokens[i]])) < 1e-4
    print(f"near-ties accepted: {near_ties or 'none'}")


def test_bad_plans_and_resets_keep_the_ranks_in_step(workers: dict[int, Worker], tp1_run: list[Seq]) -> None:
    """Rank 1 must follow resets and drop the plans rank 0 rejects, or the next steps desynchronize."""
    stub = workers[2].stub
    stub.Reset(worker_pb2.ResetRequest(epoch=5), timeout=RPC_TIMEOUT)
    seq = _sequences(stub.Describe(worker_pb2.DescribeRequest(), timeout=RPC_TIMEOUT).vocab_size)[0]
    execute_step(stub, worker_pb2.StepPlan(epoch=5, step_id=1, new_sequences=[worker_pb2.NewSequence(
        seq_id=seq.seq_id, prompt_token_ids=seq.prompt, block_table=seq.blocks, num_computed_tokens=0,
        num_new_tokens=len(seq.prompt), sampling=seq.sampling)]), timeout=RPC_TIMEOUT)
    stub.Reset(worker_pb2.ResetRequest(epoch=6), timeout=RPC_TIMEOUT)
    bad_plans = {
        "not cached": worker_pb2.StepPlan(epoch=6, step_id=1, cached_sequences=[
            worker_pb2.SequenceDelta(seq_id=seq.seq_id, num_new_tokens=1)]),
        "out of range": worker_pb2.StepPlan(epoch=6, step_id=2, copy=[worker_pb2.BlockPair(src=0, dst=99)]),
    }
    for fragment, plan in bad_plans.items():
        with pytest.raises(grpc.RpcError) as info:
            execute_step(stub, plan, timeout=RPC_TIMEOUT)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, fragment
        assert fragment in info.value.details()
    _assert_same(_run(stub, epoch=7), tp1_run)


def test_heads_not_divisible_by_the_size_are_refused(tmp_path: Path) -> None:
    base = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=1, head_dim=32, vocab_size=64)
    three_heads = {**base, "hidden_size": 96}
    with pytest.raises(TensorParallelError, match="num_attention_heads=3"):
        check_tensor_parallel(AutoConfig.for_model("llama", num_attention_heads=3, num_key_value_heads=3, **three_heads), 2)
    with pytest.raises(TensorParallelError, match="intermediate size=255"):
        check_tensor_parallel(AutoConfig.for_model("llama", num_attention_heads=4, num_key_value_heads=2,
                                                   **{**base, "intermediate_size": 255}), 2)
    check_tensor_parallel(AutoConfig.for_model("llama", num_attention_heads=4, num_key_value_heads=2, **base), 2)
    # Through the command line: the worker refuses at start-up, before starting any other rank.
    AutoConfig.for_model("llama", num_attention_heads=4, num_key_value_heads=1, **base).save_pretrained(tmp_path)
    done = subprocess.run(
        [sys.executable, "-m", "llmserve", "worker", "--model", str(tmp_path), "--port", str(free_port()),
         "--tensor-parallel-size", "2"],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert "tensor_parallel_size=2 must divide the model's num_key_value_heads=1" in done.stderr
    assert "started tensor-parallel rank" not in done.stderr


def _rank1_pid(log: Path) -> int:
    found = re.search(r"started tensor-parallel rank 1 of 2 \(pid (\d+)\)", log.read_text())
    assert found, log.read_text()
    return int(found.group(1))


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # A zombie (exited, not yet reaped by its parent) counts as gone.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] == "Z"


def _wait(condition, timeout_s: float) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return False


def test_a_dead_rank_stops_the_worker_and_rank_0_stops_the_others(tiny_llama_dir: Path, tmp_path: Path) -> None:
    first, second = (_start(tiny_llama_dir, tmp_path / f"w{i}.log", 2) for i in (1, 2))
    workers = [_connect(proc, port, tmp_path / f"w{i}.log") for i, (proc, port) in enumerate((first, second), 1)]
    try:
        # Rank 1 killed: rank 0 exits non-zero instead of waiting on it forever.
        os.kill(_rank1_pid(workers[0].log), signal.SIGKILL)
        assert workers[0].proc.wait(timeout=30) == 1
        assert "exited with status" in workers[0].log.read_text(), "the watchdog saw the rank die"
        # Rank 0 killed: rank 1 does not outlive it.
        rank1 = _rank1_pid(workers[1].log)
        workers[1].proc.kill()
        workers[1].proc.wait(timeout=30)
        assert _wait(lambda: _gone(rank1), 30), f"rank 1 (pid {rank1}) still runs after rank 0 died"
    finally:
        for w in workers:
            _stop(w)


@pytest.mark.slow  # a worker of 2 ranks per family: ~10 s each on 2 cores
@pytest.mark.parametrize("family", ["opt", "gpt2", "qwen2"])
def test_other_families_shard_and_match_transformers(family: str, tmp_path: Path) -> None:
    """OPT (num_heads reshapes, biases), GPT-2 (packed q/k/v Conv1D) and Qwen2 (q/k/v biases) at TP 2."""
    from tests.integration.test_model_families import _build  # noqa: PLC0415 - the families' tiny configs

    model_dir = _build(tmp_path / family, family)
    worker = _connect(*_start(model_dir, tmp_path / "worker.log", 2), tmp_path / "worker.log")
    try:
        run = _run(worker.stub, epoch=1)
    finally:
        _stop(worker)
    reference = HFReference(str(model_dir))
    for seq in run:
        if seq.sampling.temperature != 0.0:
            continue
        ref = reference.greedy(seq.prompt, MAX_NEW, stop_at_eos=False)
        cmp = compare_greedy(seq.tokens, ref)
        assert cmp.matched, f"{family} sequence {seq.seq_id}: {cmp.detail}"
        for i in range(MAX_NEW if cmp.near_tie_at is None else cmp.near_tie_at):
            assert abs(seq.logprobs[i] - float(ref.logprobs[i, seq.tokens[i]])) < 1e-4


@pytest.mark.slow  # Redis, a scheduler and a worker of 2 ranks
def test_the_whole_system_serves_a_tensor_parallel_worker(tiny_llama_dir: Path) -> None:
    """`up`'s path: the scheduler drives a TP-2 worker like any other; greedy outputs match transformers."""
    from llmserve.client import make_request  # noqa: PLC0415
    from llmserve.local_cluster import ClusterSpec, LocalCluster  # noqa: PLC0415
    from tests.e2e.concurrency import generate_all  # noqa: PLC0415

    spec = ClusterSpec(model=str(tiny_llama_dir), worker_args=[
        "--tensor-parallel-size", "2", "--num-threads", "1", "--num-gpu-blocks-override", "64",
        "--max-model-len", "256"])
    prompts = [[(7 * i + 13 * p) % 40000 + 3 for p in range(n)] for i, n in enumerate([5, 30, 77, 12])]
    with LocalCluster(spec) as cluster:
        results = generate_all(cluster.address, [
            make_request(prompt_token_ids=p, max_tokens=20, temperature=0.0, ignore_eos=True) for p in prompts])
    reference = HFReference(str(tiny_llama_dir))
    for result, expected in zip(results, reference.greedy_many(prompts, 20, stop_at_eos=False)):
        assert result.error == ""
        cmp = compare_greedy(result.token_ids, expected)
        assert cmp.matched, cmp.detail

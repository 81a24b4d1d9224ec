"""Host time of one worker step: the step call's path in-process, without gRPC.

    python -m benchmarks.worker_step [--models tiny default] [--batch-sizes 1 4 16] [--steps 40]
        [--prompt-len 32] [--logprobs K] [--threads N] [--dtype auto|float32|bfloat16|float16]
        [--decode-gemv-rows N] [--cpu-matmul auto|onednn|panels] [--device DEVICE] [--profile]
        [--output benchmarks/results/worker_step.json]

For each model and batch size B, a ModelRunner prefills B greedy sequences
(random prompts of --prompt-len tokens), then runs --steps decode steps. Each step is what
the servicer does between receiving the plan's bytes and returning the reply's,
on the thread that loaded the model, as the worker's model thread
(worker_service/model_thread.py), with the worker's OpenMP setting:

    parse  StepPlan.FromString + plan_from_proto
    run    ModelRunner.execute (sequence cache, inputs, forward pass, LM head, sampling)
    reply  the StepBatchResult protobuf (the stream's answer), serialized

Reported: median wall and CPU (process time, every thread) milliseconds per
step. On the tiny model (hidden 128, 2 layers, the default tokenizer's 49k
vocabulary) nearly all of it is host overhead. `tokens_digest` hashes every
sampled token and logprob: runs before and after a change must agree.
--profile prints cProfile's top functions over the decode steps of each run.
--device cuda (or cuda:N) runs the worker on a GPU (its Numba-CUDA kernels): a step's wall time then
includes waiting for the device, since the sampled tokens come back to the host in every step.
"""

from __future__ import annotations

import argparse
import cProfile
import hashlib
import json
import pstats
import random
import statistics
import tempfile
import time
from pathlib import Path

from shared.omp import prefer_short_spins

# As `llmserve worker` does before torch loads: the step is measured with the worker's OpenMP setting.
prefer_short_spins()

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from benchmarks.run_info import run_info  # noqa: E402
from protos import worker_pb2  # noqa: E402
from shared.default_model import prepare_default_model  # noqa: E402
from shared.defaults import CPU_MATMULS  # noqa: E402
from shared.sampling_params import SamplingParams  # noqa: E402
from shared.sampling_proto import sampling_to_proto  # noqa: E402
from worker_service.config import WorkerConfig  # noqa: E402
from worker_service.model_runner import ModelRunner  # noqa: E402
from worker_service.model_thread import ModelThread  # noqa: E402
from worker_service.plan import plan_from_proto  # noqa: E402
from worker_service.servicer import batch_result  # noqa: E402

RESULTS = Path("benchmarks/results/worker_step.json")
DEFAULT_PROMPT_LEN = 32
BLOCK_SIZE = 16
PHASES = ["parse", "run", "reply"]


def _prefill_plan(batch: int, prompt_len: int, steps: int, vocab: int, logprobs: int | None,
                  seed: int) -> worker_pb2.StepPlan:
    rng = random.Random(seed)
    blocks = -(-(prompt_len + steps + 1) // BLOCK_SIZE)
    sampling = sampling_to_proto(SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True,
                                                logprobs=logprobs))
    return worker_pb2.StepPlan(epoch=1, step_id=0, new_sequences=[
        worker_pb2.NewSequence(
            seq_id=i, prompt_token_ids=[rng.randrange(vocab) for _ in range(prompt_len)], sampling=sampling,
            block_table=list(range(i * blocks, (i + 1) * blocks)), num_computed_tokens=0, num_new_tokens=prompt_len,
        )
        for i in range(batch)
    ])


def _decode_plan(batch: int, step_id: int) -> bytes:
    # Every block was sent with the prefill: decode deltas carry no new block ids.
    return worker_pb2.StepPlan(epoch=1, step_id=step_id, cached_sequences=[
        worker_pb2.SequenceDelta(seq_id=i, num_new_tokens=1) for i in range(batch)
    ]).SerializeToString()


def _step(runner: ModelRunner, wire: bytes) -> tuple[bytes, dict[str, float]]:
    """One step as the servicer runs it, timed by phase (wall seconds)."""
    t0 = time.perf_counter()
    request = worker_pb2.StepPlan.FromString(wire)
    plan = plan_from_proto(request)
    t1 = time.perf_counter()
    out = runner.execute(plan, request)
    t2 = time.perf_counter()
    reply = batch_result([out]).SerializeToString()
    t3 = time.perf_counter()
    return reply, {"parse": t1 - t0, "run": t2 - t1, "reply": t3 - t2}


def measure(runner: ModelRunner, batch: int, prompt_len: int, steps: int, logprobs: int | None,
            profile: bool) -> dict[str, object]:
    """Prefills `batch` sequences, then times `steps` decode steps."""
    vocab = runner.shape.vocab_size
    runner.reset()
    _step(runner, _prefill_plan(batch, prompt_len, steps, vocab, logprobs, seed=batch).SerializeToString())
    plans = [_decode_plan(batch, step_id) for step_id in range(1, steps + 1)]
    digest = hashlib.sha256()
    wall: list[float] = []
    cpu: list[float] = []
    phases: dict[str, list[float]] = {name: [] for name in PHASES}
    profiler = cProfile.Profile() if profile else None
    for wire in plans:
        c0, w0 = time.process_time(), time.perf_counter()
        if profiler is not None:
            profiler.enable()
        reply, split = _step(runner, wire)
        if profiler is not None:
            profiler.disable()
        wall.append(time.perf_counter() - w0)
        cpu.append(time.process_time() - c0)
        for name, seconds in split.items():
            phases[name].append(seconds)
        result = worker_pb2.StepBatchResult.FromString(reply).results[0]
        result.execute_seconds = 0.0  # a timing, not an output
        digest.update(result.SerializeToString(deterministic=True))
    if profiler is not None:
        print(f"--- batch {batch}: cProfile of {steps} decode steps (by own time) ---")
        pstats.Stats(profiler).sort_stats("tottime").print_stats(30)
    # The first decode steps warm caches and allocators; the medians ignore them anyway.
    return {
        "batch": batch,
        "steps": steps,
        "wall_ms": statistics.median(wall) * 1e3,
        "cpu_ms": statistics.median(cpu) * 1e3,
        "phases_ms": {name: statistics.median(v) * 1e3 for name, v in phases.items()},
        "tokens_digest": digest.hexdigest()[:16],
    }


def _model_dir(name: str, tmp: Path) -> Path:
    default = prepare_default_model()
    if name == "default":
        return default
    from tests.tiny_models import build_tiny_llama  # noqa: PLC0415 - only the tiny model needs it

    return build_tiny_llama(tmp / "tiny-llama", default)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=["tiny", "default"], default=["tiny", "default"])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--steps", type=int, default=40, help="decode steps per batch size")
    parser.add_argument("--prompt-len", type=int, default=DEFAULT_PROMPT_LEN,
                        help="prompt tokens of every sequence (the decode steps attend to them)")
    parser.add_argument("--logprobs", type=int, default=None, help="top logprobs per sampled token (default none)")
    # A worker's --num-threads 0 (its default) keeps torch's default, one thread per core: so does this.
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads (default 0: torch's default, one per core, as a worker's)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="weights and KV cache (auto: float32 on a CPU)")
    parser.add_argument("--decode-gemv-rows", type=int, default=WorkerConfig.decode_gemv_rows,
                        help="the worker's GEMV decode form's row limit (0: none; unused where projections are in panels)")
    parser.add_argument("--cpu-matmul", default=WorkerConfig.cpu_matmul, choices=CPU_MATMULS,
                        help="the worker's float32 CPU projection kernel (auto, onednn, panels)")
    parser.add_argument("--device", default=WorkerConfig.device,
                        help="torch device of the worker's model, as `llmserve worker --device` (cpu, cuda, cuda:1)")
    parser.add_argument("--profile", action="store_true", help="print cProfile's top functions per run")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    context = args.prompt_len + args.steps + 1
    blocks = max(args.batch_sizes) * -(-context // BLOCK_SIZE)
    runs = []
    model_thread = ModelThread()
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            config = WorkerConfig(model=str(_model_dir(name, Path(tmp))), block_size=BLOCK_SIZE, dtype=args.dtype,
                                  num_gpu_blocks_override=blocks, max_model_len=context,
                                  decode_gemv_rows=args.decode_gemv_rows, cpu_matmul=args.cpu_matmul,
                                  device=args.device)
            runner = model_thread.run(ModelRunner, config)
            for batch in tqdm(args.batch_sizes, desc=f"{name} model", unit="batch size"):
                row = model_thread.run(measure, runner, batch, args.prompt_len, args.steps, args.logprobs,
                                       args.profile)
                runs.append({"model": name, **row})
    model_thread.shutdown()
    result = {
        **run_info(f"torch {torch.__version__}", f"{torch.get_num_threads()} torch threads"),
        "description": (f"Decode steps of B greedy sequences ({args.prompt_len}-token prompts, logprobs={args.logprobs}) "
                        "driven in-process through the worker's step path (plan bytes in, reply bytes out, "
                        "no gRPC); medians over the steps. tiny: 2-layer hidden-128 Llama with the default "
                        "tokenizer's vocabulary; default: SmolLM2-135M."),
        "dtype": args.dtype,
        "device": args.device,
        "decode_gemv_rows": args.decode_gemv_rows,
        "cpu_matmul": args.cpu_matmul,
        "prompt_len": args.prompt_len,
        "phases": PHASES,
        "rows": runs,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2))
    for row in runs:
        print(f"{row['model']:>7} batch {row['batch']:>3}: wall {row['wall_ms']:.2f} ms, cpu {row['cpu_ms']:.2f} ms, "
              + ", ".join(f"{k} {v:.2f}" for k, v in row["phases_ms"].items()) + f", digest {row['tokens_digest']}")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()

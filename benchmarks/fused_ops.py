"""A/B of the worker's fused CPU ops against the torch ops they replace, in one run, at the default model's shapes.

    python -m benchmarks.fused_ops [--rows 1 16 64 512] [--output benchmarks/results/fused_ops.json]

Per op and row count: median milliseconds of the torch version (what transformers'
modules run: several dispatched ops) and of the fused one the worker runs
(worker_service/models/fused_ops.py), on the worker's thread count. The matmul
rows compare F.linear (MKL) with the worker's projection (worker_service/models/linear.py:
oneDNN on weights packed at load) over one decoder layer's four weight matrices plus
the LM head, with the bandwidth each reads the weights at and its GFLOP/s. Outputs
are checked equal (or within float32 rounding) before timing.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

from shared.omp import prefer_sleeping_threads

prefer_sleeping_threads()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks._timing import time_ms  # noqa: E402
from benchmarks.run_info import run_info  # noqa: E402
from worker_service.models import fused_ops  # noqa: E402
from worker_service.models.linear import Linear  # noqa: E402

RESULTS = Path("benchmarks/results/fused_ops.json")
# SmolLM2-135M: hidden 576, 9 + 3 heads of 64, MLP 1536, vocabulary 49152.
HIDDEN, HEADS, KV_HEADS, HEAD, MLP, VOCAB = 576, 9, 3, 64, 1536, 49152
CPU = torch.device("cpu")


def _torch_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    residual.add_(x)
    return weight * (residual * torch.rsqrt(residual.pow(2).mean(-1, keepdim=True) + 1e-5))


def _torch_rotary(qk: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    x1, x2 = qk[..., : HEAD // 2], qk[..., HEAD // 2 :]
    r1, r2 = x1 * c - x2 * s, x2 * c + x1 * s
    x1.copy_(r1)
    x2.copy_(r2)


def _pair(name: str, rows: int, torch_fn: Callable[[], object], fused_fn: Callable[[], object]) -> dict[str, object]:
    torch_ms, fused_ms = time_ms(torch_fn, CPU, repeats=30), time_ms(fused_fn, CPU, repeats=30)
    print(f"{name:>14} rows {rows:4d}: torch {torch_ms:8.3f} ms  fused {fused_ms:8.3f} ms  ({torch_ms / fused_ms:.2f}x)")
    return {"op": name, "rows": rows, "torch_ms": torch_ms, "fused_ms": fused_ms}


def measure(rows: int) -> list[dict[str, object]]:
    torch.manual_seed(rows)
    x, residual, weight = torch.randn(rows, HIDDEN), torch.randn(rows, HIDDEN), torch.randn(HIDDEN)
    gate_up = torch.randn(rows, 2 * MLP)
    qkv = torch.randn(rows, HEADS + 2 * KV_HEADS, HEAD)
    qk = qkv[:, : HEADS + KV_HEADS]
    positions = torch.randint(0, 2048, (rows,))
    cos, sin = torch.randn(2048, HEAD // 2), torch.randn(2048, HEAD // 2)
    torch.testing.assert_close(fused_ops.silu_and_mul(gate_up), F.silu(gate_up[:, :MLP]) * gate_up[:, MLP:])
    out = [
        _pair("add_rms_norm", rows, lambda: _torch_add_rms_norm(x.clone(), residual.clone(), weight),
              lambda: fused_ops.add_rms_norm(x.clone(), residual.clone(), weight, 1e-5)),
        _pair("rotary", rows, lambda: _torch_rotary(qk, positions, cos, sin),
              lambda: fused_ops.apply_rotary(qkv, HEADS + KV_HEADS, positions, cos, sin)),
        _pair("silu_and_mul", rows, lambda: F.silu(gate_up[:, :MLP]) * gate_up[:, MLP:],
              lambda: fused_ops.silu_and_mul(gate_up)),
    ]
    weights = [torch.randn(n, k) for n, k in (((HEADS + 2 * KV_HEADS) * HEAD, HIDDEN), (HIDDEN, HIDDEN),
                                              (2 * MLP, HIDDEN), (HIDDEN, MLP), (VOCAB, HIDDEN))]
    inputs = {HIDDEN: torch.randn(rows, HIDDEN), MLP: torch.randn(rows, MLP)}
    projections = [Linear(w) for w in weights]
    for w, projection in zip(weights, projections):
        x = inputs[w.shape[1]]
        torch.testing.assert_close(projection(x), F.linear(x, w), rtol=1e-4, atol=1e-3)

    def mkl() -> None:
        for w in weights:
            F.linear(inputs[w.shape[1]], w)

    def packed() -> None:
        for projection in projections:
            projection(inputs[projection.in_features])

    entry = _pair("layer + lm_head matmuls", rows, mkl, packed)
    gigabytes = sum(w.numel() for w in weights) * 4 / 1e9
    flops = 2 * rows * sum(w.numel() for w in weights)
    for side in ("torch", "fused"):
        seconds = entry[f"{side}_ms"] / 1e3  # type: ignore[operator]
        entry[f"{side}_gbs"] = gigabytes / seconds
        entry[f"{side}_gflops"] = flops / seconds / 1e9
    out.append(entry)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 512], help="token rows per call")
    parser.add_argument("--output", type=Path, default=RESULTS, help="JSON results file")
    args = parser.parse_args(argv)
    results = {**run_info(f"torch {torch.__version__}", f"{torch.get_num_threads()} threads"),
               "ops": [entry for rows in args.rows for entry in measure(rows)]}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()

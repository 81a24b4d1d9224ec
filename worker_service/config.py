"""Worker configuration, validated at start-up."""

from __future__ import annotations

from dataclasses import dataclass

from shared import defaults
from shared.checkpoint import require_local
from shared.tls import ServerTLS

_DTYPES = ("auto", "float32", "float16", "bfloat16")
_GIB = 1 << 30


@dataclass
class WorkerConfig:
    """Everything a worker needs to load its model and size its KV cache.

    model: local Hugging Face checkpoint directory (config.json + safetensors), or a .gguf file.
    dtype: "auto" picks float32 on a CPU and the checkpoint's dtype (at least 16-bit) on a GPU.
    block_size: tokens per KV-cache block.
    kv_cache_memory_gib: memory given to the KV cache on a CPU, when no override is set.
    gpu_memory_utilization: fraction of a GPU's memory for weights, activations and the KV cache;
        the cache gets what a profiling step leaves (vLLM's rule), when no override is set.
    num_gpu_blocks_override: exact number of device blocks (tests, tuning).
    swap_space_gib: host memory for swapped-out blocks.
    max_model_len: longest sequence accepted; 0 takes the model's max_position_embeddings.
    otlp_endpoint: send OpenTelemetry spans to this OTLP/gRPC collector.
    trace_file: append spans to this JSON-lines file (read by `llmserve trace show`).
    metrics_port: serve Prometheus metrics on this port at /metrics (0 = off).
    tls: serve the Worker API over TLS; with a client CA, only clients holding a certificate it signed
        (the schedulers) may call it (mutual TLS). None = plaintext.
    liveness_timeout_s: grpc.health.v1 "liveness" turns NOT_SERVING while one step has been executing
        longer than this (a forward pass stuck); above the scheduler's step timeout and any real step.
    tensor_parallel_size: ranks that split each layer's heads and MLP (and the KV cache's heads);
        rank 0 is this process, it starts the others. kv_cache_memory_gib and swap_space_gib are
        per rank (as vLLM's per-GPU budgets): N ranks hold N shards of the same number of blocks.
    simulate: a simulation profile (worker_service/simulation.py): no model, modelled step times.
    decode_gemv_rows: decode steps of up to this many sequences run every layer in one compiled call with
        GEMV projections over a dense copy of the layer weights (float32 or bf16 on a CPU, one rank, projections
        not in panels; the copy costs the weights' size in memory again); 0 turns it off
        (worker_service/models/compiled_decode.py).
    cpu_matmul: the float32 CPU projections' kernel: "auto" (the panel kernel on AVX-512 AMD CPUs, where it
        was measured faster, else oneDNN), "onednn" or "panels" (worker_service/models/linear.py). With panels,
        every decode step runs every layer in one compiled call over the same panels (no dense copy).
    """

    model: str
    dtype: str = "auto"
    device: str = "cpu"
    block_size: int = defaults.BLOCK_SIZE
    kv_cache_memory_gib: float = defaults.KV_CACHE_MEMORY_GIB
    gpu_memory_utilization: float = defaults.GPU_MEMORY_UTILIZATION
    num_gpu_blocks_override: int | None = None
    swap_space_gib: float = defaults.SWAP_SPACE_GIB
    max_model_len: int = 0
    seed: int = 0
    num_threads: int = 0
    otlp_endpoint: str = ""
    trace_file: str = ""
    metrics_port: int = 0
    tls: ServerTLS | None = None
    tensor_parallel_size: int = 1
    liveness_timeout_s: float = defaults.LIVENESS_TIMEOUT_S
    simulate: str = ""
    decode_gemv_rows: int = defaults.DECODE_GEMV_ROWS
    cpu_matmul: str = defaults.CPU_MATMULS[0]

    def __post_init__(self) -> None:
        require_local(self.model, "model")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, got {self.dtype!r}.")
        if self.block_size not in (8, 16, 32):
            raise ValueError(f"block_size must be 8, 16 or 32, got {self.block_size}.")
        if self.kv_cache_memory_gib <= 0:
            raise ValueError(f"kv_cache_memory_gib must be positive, got {self.kv_cache_memory_gib}.")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}.")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError(f"num_gpu_blocks_override must be at least 1, got {self.num_gpu_blocks_override}.")
        if self.swap_space_gib < 0:
            raise ValueError(f"swap_space_gib must be non-negative, got {self.swap_space_gib}.")
        if self.decode_gemv_rows < 0:
            raise ValueError(f"decode_gemv_rows must be non-negative, got {self.decode_gemv_rows}.")
        if self.cpu_matmul not in defaults.CPU_MATMULS:
            raise ValueError(f"cpu_matmul must be one of {', '.join(defaults.CPU_MATMULS)}, got {self.cpu_matmul!r}.")
        if self.max_model_len < 0:
            raise ValueError(f"max_model_len must be non-negative, got {self.max_model_len}.")
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in 0..65535 (0 = off), got {self.metrics_port}.")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be at least 1, got {self.tensor_parallel_size}.")
        if self.simulate and self.tensor_parallel_size != 1:
            raise ValueError("simulate models a whole GPU worker: tensor_parallel_size must be 1 "
                             "(a profile can describe several GPUs).")
        if not self.liveness_timeout_s > 0:
            raise ValueError(f"liveness_timeout_s must be positive, got {self.liveness_timeout_s}.")

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes budgeted for the device KV cache."""
        return int(self.kv_cache_memory_gib * _GIB)

    @property
    def swap_space_bytes(self) -> int:
        """Bytes budgeted for the host swap cache."""
        return int(self.swap_space_gib * _GIB)

"""Every default a user can set by a flag, in one place: the CLI, the configurations and the core read it here.

Plain values with no imports, so that parsing the command line stays cheap.
"""

from __future__ import annotations

# KV cache (worker and scheduler core).
BLOCK_SIZE = 16
KV_CACHE_MEMORY_GIB = 1.0
GPU_MEMORY_UTILIZATION = 0.9
SWAP_SPACE_GIB = 0.0
# Worker: decode steps of up to this many sequences as one compiled call over dense weights (CPU, float32).
DECODE_GEMV_ROWS = 4
# Worker: the float32 CPU projections' kernel (worker_service/models/linear.py's use_panels), auto first.
CPU_MATMULS = ("auto", "onednn", "panels")
# Scheduling.
MAX_NUM_SEQS = 256
# A CPU worker's step budget, with chunked prefill on by default there (scheduler_service/scheduling.py says why).
CPU_STEP_BUDGET = 256
# Boolean flags left unset by default, decided per worker: an explicit off is forwarded as --no-NAME.
PER_WORKER_FLAGS = frozenset({"enable_chunked_prefill"})
# Steps one call to a worker may carry (multi-step scheduling), and the most a scheduler accepts: a worker
# keeps the last steps of its calls for a new owner (worker_service/model_runner.py KEPT_STEPS).
NUM_SCHEDULER_STEPS = 1
MAX_NUM_SCHEDULER_STEPS = 16
# Deadlines and leases, in seconds.
STEP_TIMEOUT_S = 60.0
LIVENESS_TIMEOUT_S = 300.0
LEASE_TTL_S = 10.0
# How long `llmserve up` (and LocalCluster) lets its services start: a first start on a machine compiles the CPU
# kernels, 2-4 min on an idle 2-core EPYC (float32: 139 s on a Zen 3), longer on a busy or slower machine.
LOCAL_START_TIMEOUT_S = 900.0
# While that start-up has no news for this long, it says what it still waits for (rather than minutes of silence).
START_PROGRESS_EVERY_S = 20.0
# How long a finished request's output stream (and its digest) stays in Redis for Resume and idempotent re-sends.
# Each generated token keeps ~50 bytes there that long: Redis memory grows with output tokens/s x retention.
OUTPUT_RETENTION_S = 3600

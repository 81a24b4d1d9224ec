"""Where each engine-loop step's time goes, written as JSON lines when asked (`--profile-steps PATH`).

The loop overlaps the Redis commit of step N-1 with the worker's step N, so
a step's wall time is ingest + schedule + plan + max(worker RPC, commit) +
postprocess. The worker's own execute time comes back in its StepResult;
everything else is the cost of splitting the engine into services.

With async scheduling a step is planned (ingest, schedule, plan) while the step
ahead of it runs: its wall time and its RPC time then start when the step ahead's
answer came back, and wall - worker is what the worker's step did not cover.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO


@dataclass
class StepProfile:
    """One step (seconds)."""

    step: int
    num_seqs: int
    num_prefill_tokens: int
    num_decode_tokens: int
    ingest_s: float = 0.0
    schedule_s: float = 0.0
    plan_s: float = 0.0
    # The step call's round trip as the loop saw it (async scheduling: from the answer to the step ahead, which
    # can be less than worker_s: the worker starts the step while that answer travels); worker_s ran in the worker.
    rpc_s: float = 0.0
    worker_s: float = 0.0
    # The previous step's commit, overlapped with this RPC; the part that outlasted it is commit_wait_s.
    commit_s: float = 0.0
    commit_wait_s: float = 0.0
    process_s: float = 0.0
    wall_s: float = 0.0
    # KV cache at the end of planning: slots in allocated blocks, and tokens they hold.
    kv_slots: int = 0
    kv_tokens: int = 0
    # Steps of the worker call (multi-step scheduling; their decode tokens and worker time are summed above).
    num_steps: int = 1


class StepProfileWriter:
    """Appends profiles to a JSON-lines file, flushed every `flush_every` steps and on close."""

    def __init__(self, path: Path, flush_every: int = 32) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] = path.open("a", encoding="utf-8")
        self._flush_every = flush_every
        self._pending = 0

    def write(self, profile: StepProfile) -> None:
        self._file.write(json.dumps(asdict(profile)) + "\n")
        self._pending += 1
        if self._pending >= self._flush_every:
            self.flush()

    def flush(self) -> None:
        if self._pending:
            self._file.flush()
            self._pending = 0

    def close(self) -> None:
        self._file.close()


def read_profiles(path: Path) -> list[StepProfile]:
    with path.open(encoding="utf-8") as f:
        return [StepProfile(**json.loads(line)) for line in f if line.strip()]

"""Writes docs/faults.md from the rows tests/e2e/test_faults.py appended (`make faults`).

    python -m tests.e2e.fault_report TABLE.md OUT.md
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from pathlib import Path


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(table: str, out: str) -> None:
    rows = Path(table).read_text()
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    Path(out).write_text(f"""# Fault table

Written by `make faults` (tests/e2e/test_faults.py) on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())},
commit {_commit()}, {platform.machine()} with {os.cpu_count()} CPUs (load average {load} at the end).

Each row: the cpu overlay's processes on localhost (2 scheduler replicas, 2 workers, Redis with AOF),
greedy requests of 40 tokens (8; or 24 of 300 tokens where a queue is needed, 8 of 300 for a scheduler's stop)
streamed through both replicas (clients fall back to the other one), the fault injected while tokens flow. "completed" counts
requests that ended normally with exactly transformers' greedy tokens; "tokens lost" counts tokens
a client never received; "time to recover" is the longest pause any client saw between two tokens
from the fault on. Test knobs: heartbeat TTL 3 s, lease TTL 4 s (production defaults: 6 s and 10 s).

{rows}
- **worker SIGKILL**: the owning loop's step fails; once the worker's heartbeat expires its requests are
  handed to the other worker in the loop's fenced commit and recomputed there from prompt + committed
  outputs; the dead worker's registration is dropped.
- **worker drain**: SIGTERM, as Kubernetes sends on scale-in or a rolling update, once the worker has
  a queue; the owner routes nothing new to it, its running requests finish where their KV cache is,
  the waiting ones move to the other worker, and the worker deregisters and exits once the owner
  marks it drained (well before its 30 s drain timeout). No client pauses.
- **scheduler replica SIGKILL**: clients on it resume on the other replica (Resume from their last
  index); its lease expires and the survivor takes it at that moment, rebuilds the loop's scheduler
  from Redis and continues the running requests on the KV cache the worker kept (nothing recomputed).
- **scheduler replica SIGTERM**: a rolling update's stop of the lease owner; its loop makes a last commit and
  gives its lease back, which the other replica takes at once, while the replica keeps serving its streams
  for a 2 s grace. Streams still open after it end with UNAVAILABLE and their requests are kept (not
  aborted), for their clients to resume on the other replica (on a 2-core machine some of the 300-token
  streams here outlive the grace; tests/e2e/test_stream_resume.py makes that case certain).
- **Redis restart**: SIGTERM (Redis flushes its append-only file) and a new process on the same port
  and data directory; streams break with UNAVAILABLE and resume, engine loops whose commit failed stop
  and are restarted from Redis by their supervisor. A crash instead of a clean stop can lose up to 1 s
  of writes with `appendfsync everysec`.
""")


if __name__ == "__main__":
    main(*sys.argv[1:3])

"""Start-up time of `llmserve up` on the default model: how long until it serves, start after start.

    python -m benchmarks.startup [--starts 3] [--output benchmarks/results/startup.json]

Each start runs `llmserve up` as a user would (Redis, a worker and a scheduler, on free ports),
reads its `llmserve up: serving after ...` line (the time from the command's start until the
scheduler holds the worker's lease and serves), then stops it with SIGINT as Ctrl-C does and
waits for it to exit. The first start of a session may also fill the page cache and Numba's
kernel cache; the ones after it are what a machine that has served once sees.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

from benchmarks.run_info import run_info, write_results
from shared.default_model import prepare_default_model
from shared.redis_server import free_port
from shared.startup_timer import StartupReport, parse_summary

RESULTS = Path("benchmarks/results/startup.json")
SERVING_LINE = "llmserve up: serving after"
# Generous: a cold first start on a busy 2-core machine takes well under a minute.
START_DEADLINE_S = 300.0


def start_once(model: Path, log_dir: Path) -> StartupReport:
    """One `llmserve up` until it serves, then Ctrl-C; its start-up report."""
    cmd = [sys.executable, "-m", "llmserve", "up", "--model", str(model), "--port", str(free_port()),
           "--log-dir", str(log_dir)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    assert proc.stdout is not None
    deadline = time.monotonic() + START_DEADLINE_S
    seen: list[str] = []
    try:
        for line in proc.stdout:
            seen.append(line)
            if SERVING_LINE in line:
                return parse_summary(line.split(SERVING_LINE, 1)[1].strip())
            if time.monotonic() > deadline:
                break
        raise RuntimeError("llmserve up did not serve:\n" + "".join(seen[-40:]))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--starts", type=int, default=3, help="starts, one after another (the first may be cold)")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    model = prepare_default_model()
    starts = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in tqdm(range(args.starts), desc="llmserve up", unit="start"):
            report = start_once(model, Path(tmp) / f"start-{n}")
            print(f"start {n + 1}: serving after {report.summary()}", flush=True)
            starts.append(report.to_dict())
    result = {
        **run_info(),
        "description": "`llmserve up` on the default model (SmolLM2-135M-Instruct, float32), started one after "
                       "another on this machine; seconds from the command's start until it serves "
                       "(its `llmserve up: serving after` line).",
        "starts": starts,
    }
    write_results(args.output, result)


if __name__ == "__main__":
    main()

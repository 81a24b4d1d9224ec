"""`llmserve up` says where its start-up went, and so does each service, in parts that add up.

Only the structure is checked, never a duration: the CI machine is shared and slow.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from llmserve.local_cluster import ClusterSpec, LocalCluster
from shared.redis_server import free_port
from shared.startup_timer import StartupReport, parse_summary
from tests.e2e.up_process import up

# Each part is shown to 0.1 s: the parts of a line may add up to its total plus half a tenth each.
ROUNDING_S = 0.05


def line_with(text: str, needle: str) -> str:
    found = [line for line in text.splitlines() if needle in line]
    assert len(found) == 1, f"expected one line with {needle!r}:\n{text[-3000:]}"
    return found[0]


def assert_consistent(report: StartupReport, names: list[str]) -> None:
    """The named phases are there in this order (other ones may follow), and together fit in the total."""
    shown = [p.name for p in report.phases]
    assert shown[: len(names)] == names, shown
    assert report.accounted_s <= report.total_s + ROUNDING_S * len(report.phases), report


def test_up_and_its_services_log_where_the_start_up_went(tiny_llama_dir: Path, tmp_path: Path) -> None:
    with up(tiny_llama_dir, tmp_path) as running:
        up_line = line_with("".join(running.lines), "llmserve up: serving after")
        os.killpg(running.proc.pid, signal.SIGINT)
        running.proc.communicate(timeout=60)
    cluster = parse_summary(up_line)
    assert_consistent(cluster, ["imports", "redis", "worker", "scheduler", "first lease"])
    assert [p.parallel for p in cluster.phases[1:4]] == [True, True, True], "Redis and the services start together"

    worker = parse_summary(line_with((tmp_path / "worker.log").read_text(), "worker ready in"))
    # heap: the start-up heap collected once and frozen, as `llmserve worker` / `scheduler` do (shared/startup_heap.py).
    assert_consistent(worker, ["imports", "kernels", "model", "server", "heap", "registration"])
    scheduler_log = (tmp_path / "scheduler.log").read_text()
    scheduler = parse_summary(line_with(scheduler_log, "scheduler ready in"))
    assert_consistent(scheduler, ["imports", "redis", "tokenizer", "heap", "waiting for a worker", "server"])
    serving = parse_summary(line_with(scheduler_log, "scheduler serving in").split(": worker ")[0])
    assert_consistent(serving, [p.name for p in scheduler.phases if p.name != "other"] + ["first lease"])
    # A service's own clock starts after `up` spawned it: its total fits in what `up` saw of it.
    assert worker.total_s <= cluster.seconds("worker") + 2 * ROUNDING_S, (worker, cluster)


def test_a_service_refusing_its_flags_ends_up_with_its_message(
        tiny_llama_dir: Path, tmp_path: Path) -> None:
    # The scheduler refuses the pair (its configuration's check): `up` says so, without a traceback of its own.
    cmd = [sys.executable, "-m", "llmserve", "up", "--model", str(tiny_llama_dir), "--port", str(free_port()),
           "--log-dir", str(tmp_path), "--num-threads", "1", "--num-scheduler-steps", "4", "--async-scheduling"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 1, output
    assert "llmserve up: error: the scheduler exited with code 2 during start-up" in output, output
    assert "num_scheduler_steps > 1 and async_scheduling are exclusive" in output, output
    assert "Traceback" not in output, output


def test_a_start_up_says_what_it_still_waits_for(tiny_llama_dir: Path, tmp_path: Path) -> None:
    # `up` hears this every 20 s (a first start compiles the kernels for minutes); here every 0.1 s of a start
    # that takes seconds: the worker's imports alone (torch) outlast it.
    said: list[str] = []
    spec = ClusterSpec(model=str(tiny_llama_dir), worker_args=["--num-threads", "1"], log_dir=str(tmp_path))
    with LocalCluster(spec, progress=said.append, progress_every_s=0.1):
        pass
    assert said, "no progress while the services started"
    first = said[0]
    assert first.startswith("still starting after ") and ", waiting for the worker (logs in " in first, first
    assert str(tmp_path) in first and "its log's last line: " in first, first
    assert all(", waiting for the " in line for line in said), said
    shown = [line.split("its log's last line: ")[1] for line in said if "its log's last line: " in line]
    assert len(shown) == len(set(shown)), f"a log line was shown twice: {said}"

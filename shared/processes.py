"""Starting and stopping child processes: no child lost to a signal while it starts; a clean shutdown first, a
kill after a grace period."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import threading
from collections.abc import Iterator

# The signals whose handlers may raise (KeyboardInterrupt, `llmserve up`'s start-up stop).
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Holds SIGINT / SIGTERM / SIGHUP for the block and delivers the first one that came after it.

    Around a ``subprocess.Popen`` whose object must reach its owner: a handler that raises inside Popen (it waits
    for the child's exec) leaves a forked child that nothing holds, and a service started in a session of its own
    would then outlive the command that was told to stop. Only Python handlers are held (an ignored signal stays
    ignored, and so inherited by the child); only the main thread has them, elsewhere the block runs as is.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    came: list[int] = []
    held = [sig for sig in _STOP_SIGNALS if callable(signal.getsignal(sig))]
    previous = {sig: signal.signal(sig, lambda signum, frame: came.append(signum)) for sig in held}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if came:
            signal.raise_signal(came[0])


def terminate(proc: subprocess.Popen, grace_s: float) -> None:  # type: ignore[type-arg]
    """SIGTERM, then SIGKILL if it has not exited within grace_s; a no-op for a process that exited."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()

"""A service's start-up heap: collection paused while it loads, then one collection, a freeze and the C heap's free
pages handed back (in a process of its own)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_PAUSED_START_UP = """
import gc, weakref
from shared.startup_heap import pause_collection, settle_startup_heap

pause_collection()
assert not gc.isenabled()

class Node:
    pass

garbage = Node()
garbage.self = garbage  # a cycle: only a collection frees it
dead = weakref.ref(garbage)
del garbage
alive = Node()
alive.self = alive

seconds = settle_startup_heap("test")
assert seconds is not None and seconds >= 0, seconds
assert dead() is None, "the start-up's cyclic garbage is collected before the freeze, not frozen with the rest"
assert gc.isenabled() and gc.get_freeze_count() > 0
assert settle_startup_heap("test") is None, "a second settle does nothing"
print("ok")
"""


def test_a_paused_start_up_collects_once_freezes_and_collects_again() -> None:
    done = subprocess.run([sys.executable, "-c", _PAUSED_START_UP], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stdout + done.stderr


def test_a_process_that_never_paused_keeps_its_collector_as_it_was() -> None:
    # The tests and the offline API start services in-process: nothing of their heap may be frozen.
    code = ("import gc; from shared.startup_heap import settle_startup_heap; "
            "assert settle_startup_heap('test') is None; assert gc.get_freeze_count() == 0 and gc.isenabled(); "
            "print('ok')")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stdout + done.stderr


_FREED_UNDER_LIVE_MEMORY = """
import ctypes
from shared.startup_heap import resident_anonymous_bytes, return_free_heap

libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
# 200 MB in 64 KiB blocks from the heap (below the mmap threshold), touched, then one live block above them:
# freeing the rest leaves it free but resident, as a model load's temporaries are.
blocks = [libc.malloc(1 << 16) for _ in range(3200)]
for block in blocks:
    ctypes.memset(block, 1, 1 << 16)
keep = libc.malloc(64)
for block in blocks:
    libc.free(block)
held = resident_anonymous_bytes()
returned = return_free_heap()
assert returned is not None and returned >= 100 << 20, (held, returned)
assert resident_anonymous_bytes() <= held - (100 << 20)
print("ok")
"""


def test_free_heap_pages_under_live_memory_go_back_to_the_system() -> None:
    done = subprocess.run([sys.executable, "-c", _FREED_UNDER_LIVE_MEMORY], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stdout + done.stderr

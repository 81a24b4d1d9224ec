"""This machine's float32 multiply-add peak: the rate no matmul here can exceed.

    python -m benchmarks.fma_peak

Each of the cores this process may use runs, on a thread of its own, a loop of independent vector FMAs on
registers (no memory traffic), compiled for the host CPU through llvmlite. The
report divides a step's linear-layer FLOPs by this rate: a lower bound on the
step's time that holds for any engine in float32 on this machine.
"""

from __future__ import annotations

from collections.abc import Callable
import ctypes
import struct
import threading
import time

import llvmlite.binding as llvm

from shared.omp import usable_cpus

# Independent accumulators: enough to cover an FMA's latency (4 cycles) on two pipes, few enough to stay
# in the 16 vector registers of AVX2 with the two operands.
_ACCUMULATORS = 12
_ITERATIONS = 20_000_000
# Each step: accumulator * _B + _C (float32 values; the sums stay finite over any count timed here).
_B = float(struct.unpack("f", struct.pack("f", 1 + 2 ** -23))[0])
_C = float(struct.unpack("f", struct.pack("f", 1e-7))[0])


def _constant(value: float) -> str:
    """An LLVM IR float constant: a float32 value written as the double of the same value, in hex."""
    return "0x" + struct.pack(">d", value).hex().upper()


def _ir(lanes: int) -> str:
    """``fma_loop(count, out)``: ``count`` (at least 1) steps of ``a_i = fma(a_i, b, c)`` on _ACCUMULATORS vectors,
    ``a_i`` starting with ``i`` in lane 0 and zeros elsewhere; ``out`` gets their sum, added in order of ``i``."""
    vector = f"<{lanes} x float>"
    body, phis = [], []
    for i in range(_ACCUMULATORS):
        phis.append(f"  %a{i} = phi {vector} [ %init{i}, %entry ], [ %n{i}, %loop ]")
        body.append(f"  %n{i} = call {vector} @llvm.fma.v{lanes}f32({vector} %a{i}, {vector} %b, {vector} %c)")
    inits = [f"  %init{i} = insertelement {vector} zeroinitializer, float {float(i):e}, i32 0"
             for i in range(_ACCUMULATORS)]
    total = ["  %s0 = fadd " + f"{vector} %n0, %n1"]
    total += [f"  %s{i - 1} = fadd {vector} %s{i - 2}, %n{i}" for i in range(2, _ACCUMULATORS)]
    return "\n".join([
        f"declare {vector} @llvm.fma.v{lanes}f32({vector}, {vector}, {vector})",
        f"define void @fma_loop(i64 %count, {vector}* %out) {{",
        "entry:",
        f"  %b0 = insertelement {vector} undef, float {_constant(_B)}, i32 0",
        f"  %b = shufflevector {vector} %b0, {vector} undef, <{lanes} x i32> zeroinitializer",
        f"  %c0 = insertelement {vector} undef, float {_constant(_C)}, i32 0",
        f"  %c = shufflevector {vector} %c0, {vector} undef, <{lanes} x i32> zeroinitializer",
        *inits,
        "  br label %loop",
        "loop:",
        "  %i = phi i64 [ 0, %entry ], [ %next, %loop ]",
        *phis,
        *body,
        "  %next = add i64 %i, 1",
        "  %more = icmp ult i64 %next, %count",
        "  br i1 %more, label %loop, label %done",
        "done:",
        *total,
        # The sums are stored so that the loop is not dead code.
        f"  store {vector} %s{_ACCUMULATORS - 2}, {vector}* %out, align 4",
        "  ret void",
        "}",
    ])


def _compiled() -> tuple[llvm.ExecutionEngine, Callable[[int, int], None], int]:
    """(engine, fma_loop as a ctypes function of (count, address of out), its vector width in floats) for the
    host CPU. The function lives as long as the engine."""
    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    features = llvm.get_host_cpu_features()
    lanes = 16 if features.get("avx512f") else 8
    machine = llvm.Target.from_default_triple().create_target_machine(
        cpu=llvm.get_host_cpu_name(), features=features.flatten(), opt=3)
    module = llvm.parse_assembly(_ir(lanes))
    module.verify()
    engine = llvm.create_mcjit_compiler(module, machine)
    engine.finalize_object()
    # ctypes lets go of the GIL in the call: the threads below run at once.
    loop = ctypes.CFUNCTYPE(None, ctypes.c_int64, ctypes.c_void_p)(engine.get_function_address("fma_loop"))
    return engine, loop, lanes


def fma_peak_gflops(threads: int | None = None, repeats: int = 5) -> float:
    """float32 GFLOP/s of independent vector FMAs on ``threads`` threads (one per usable core by default), best of
    ``repeats``."""
    threads = threads or usable_cpus()
    # The engine holds the loop's code: a local, it lives until this function returns.
    _engine, loop, lanes = _compiled()
    outs = [(ctypes.c_float * lanes)() for _ in range(threads)]
    best = 0.0
    for _ in range(repeats):
        workers = [threading.Thread(target=loop, args=(_ITERATIONS, ctypes.addressof(out))) for out in outs]
        started = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        seconds = time.perf_counter() - started
        best = max(best, threads * _ITERATIONS * _ACCUMULATORS * lanes * 2 / seconds / 1e9)
    return best


if __name__ == "__main__":
    print(f"float32 FMA peak: {fma_peak_gflops():.1f} GFLOP/s on {usable_cpus()} threads "
          f"({fma_peak_gflops(threads=1):.1f} on one)")

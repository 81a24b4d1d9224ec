"""Two machine operations Numba's CPU target does not expose, written as LLVM intrinsics.

- :func:`float_from_bits`: reinterpret an int32 as the float32 with the same bits (a
  register move; ``np.int32(...).view(np.float32)`` is not supported on scalars).
- :func:`fetch_add`: an atomic ``counter[0] += 1`` that returns the old value, the
  shared work queue of a ``prange`` whose items differ widely in cost (Numba's own
  ``parallel_chunksize`` still hands each thread a fixed, contiguous share).

Both compile to a single instruction and are cacheable (``cache=True`` callers).
"""

from __future__ import annotations

from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic


@intrinsic
def float_from_bits(typingctx: object, bits: types.Type) -> tuple:
    """The float32 whose IEEE bits are the int32 ``bits``."""
    signature = types.float32(types.int32)

    def codegen(context: object, builder: ir.IRBuilder, sig: object, args: list) -> ir.Value:
        return builder.bitcast(args[0], ir.FloatType())

    return signature, codegen


@intrinsic
def fetch_add(typingctx: object, counter: types.Type) -> tuple:
    """Atomically add 1 to ``counter[0]`` (an int64 array) and return its previous value."""
    if not (isinstance(counter, types.Array) and counter.dtype == types.int64):
        return None
    signature = types.int64(counter)

    def codegen(context: object, builder: ir.IRBuilder, sig: object, args: list) -> ir.Value:
        array = cgutils.create_struct_proxy(sig.args[0])(context, builder, value=args[0])
        one = ir.Constant(ir.IntType(64), 1)
        # Monotonic: the counter orders nothing else; each item's data is read-only or its own.
        return builder.atomic_rmw("add", array.data, one, "monotonic")

    return signature, codegen

"""Machine operations Numba's CPU target does not expose, written as LLVM intrinsics.

- :func:`float_from_bits`: reinterpret an int32 as the float32 with the same bits (a
  register move; ``np.int32(...).view(np.float32)`` is not supported on scalars).
- :func:`fetch_add`: an atomic ``counter[0] += 1`` that returns the old value, the
  shared work queue of a ``prange`` whose items differ widely in cost (Numba's own
  ``parallel_chunksize`` still hands each thread a fixed, contiguous share).
- :func:`fma_lanes`: ``acc[i:i+n] += a[j:j+n] * b[k:k+n]`` as one n-lane vector multiply-add.
  LLVM's loop vectorizer unrolls a vector loop by two or four, so a loop of 16 float32s
  (one block's slots) never entered its 32- or 64-wide body and ran 4-lane remainder code;
  and Numba's arrays may alias, which keeps the SLP vectorizer off a fully unrolled one.
  Written out, it is one load per operand, an FMA and a store (two of each on AVX2).

Each compiles to one instruction (a few for fma_lanes) and is cacheable (``cache=True`` callers).
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


def _lanes_at(context: object, builder: ir.IRBuilder, array_type: types.Array, array: ir.Value, index: ir.Value,
              vector: ir.VectorType) -> ir.Value:
    """A pointer to the vector of ``array``'s elements from flat position ``index``."""
    data = cgutils.create_struct_proxy(array_type)(context, builder, value=array).data
    return builder.bitcast(builder.gep(data, [index]), vector.as_pointer())


@intrinsic
def fma_lanes(typingctx: object, acc: types.Type, acc_at: types.Type, a: types.Type, a_at: types.Type,
              b: types.Type, b_at: types.Type, lanes: types.Type) -> tuple:
    """``acc[acc_at + i] += a[a_at + i] * b[b_at + i]`` for ``i < lanes`` (a literal), one rounding per element.

    Positions are flat element offsets into C-contiguous float32 arrays; the caller keeps them in bounds.
    """
    if not isinstance(lanes, types.IntegerLiteral):
        return None
    if not all(isinstance(t, types.Array) and t.dtype == types.float32 and t.layout == "C" for t in (acc, a, b)):
        return None
    count = lanes.literal_value
    signature = types.void(acc, acc_at, a, a_at, b, b_at, lanes)

    def codegen(context: object, builder: ir.IRBuilder, sig: object, args: list) -> ir.Value:
        vector = ir.VectorType(ir.FloatType(), count)
        pointers = [_lanes_at(context, builder, sig.args[n], args[n], args[n + 1], vector) for n in (0, 2, 4)]
        # align 4: the element's alignment; blocks and rows start anywhere in their arrays.
        total, left, right = (builder.load(p, align=4) for p in pointers)
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vector, [vector] * 3),
                                             f"llvm.fma.v{count}f32")
        builder.store(builder.call(fma, [left, right, total]), pointers[0], align=4)
        return context.get_dummy_value()

    return signature, codegen

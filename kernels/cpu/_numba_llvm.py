"""Machine operations Numba's CPU target does not expose, written as LLVM intrinsics.

- :func:`float_from_bits` / :func:`bits_from_float`: reinterpret an int32 as the float32 with the
  same bits and back (a register move; ``np.int32(...).view(np.float32)`` is not supported on scalars).
- :func:`fetch_add`: an atomic ``counter[0] += 1`` that returns the old value, the
  shared work queue of a ``prange`` whose items differ widely in cost or whose threads may lose
  their core for a while (Numba's own ``parallel_chunksize`` still hands each thread a fixed,
  contiguous share).
- :func:`prefetch`: ask for the cache line of ``array``'s flat element ``index`` ahead of its use (a hint;
  it never faults). The hardware prefetcher alone kept the decode GEMV's weight reads at 11-18 GB/s
  here, 22-27 GB/s with the rows two ahead asked for.
- :func:`max_lanes`: the maximum of a run of float32 in vector lanes (the softmax's and the sampler's row
  maxima), which LLVM's vectorizer leaves scalar when written as a loop.
- :func:`fma_sum_lanes`: ``acc[i:i+n] += sum_c a[...] * b[...]`` over ``count`` steps, as n-lane vector
  multiply-adds with the running sum in registers, for one sum or several that share each loaded ``b``.
  Written as loops, the sum lived in memory (Numba's arrays may alias), and each step waited ~9 cycles
  on the previous one's store; and LLVM's vectorizer unrolls by two or four, so a loop of 16 float32s
  (one block's slots) never entered its 32- or 64-wide body and ran 4-lane remainder code.
- :func:`gemm_tile`: a register tile of a small matrix product (``rows x vectors`` vectors of
  accumulators, one broadcast element against loaded vectors per step), the prefill kernel's block products;
  :func:`gemm_tile_from` starts its sums from a bias row instead of from the output (the panel projections).
- :func:`row_sums`: the sums of 8 or 16 consecutive rows at a time as one transpose-and-add tree of
  vector shuffles (the decode kernel's last reduction over a block's slots).
- :func:`transpose_tile`: a 16 x 16 tile transposed (and scaled) in registers, the prefill kernel's query
  and output tiles between the tokens' rows and its rows-innermost layout.

The first four compile to one instruction each; all are cacheable (``cache=True`` callers).
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
def bits_from_float(typingctx: object, value: types.Type) -> tuple:
    """The int32 holding the IEEE bits of the float32 ``value`` (the inverse of ``float_from_bits``)."""
    signature = types.int32(types.float32)

    def codegen(context: object, builder: ir.IRBuilder, sig: object, args: list) -> ir.Value:
        return builder.bitcast(args[0], ir.IntType(32))

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


@intrinsic
def prefetch(typingctx: object, array: types.Type, index: types.Type) -> tuple:
    """Prefetch the cache line holding ``array``'s flat element ``index`` (a contiguous array) into every cache level."""
    if not (isinstance(array, types.Array) and array.layout == "C" and isinstance(index, types.Integer)):
        return None
    signature = types.void(array, index)

    def codegen(context: object, builder: ir.IRBuilder, sig: object, args: list) -> ir.Value:
        data = cgutils.create_struct_proxy(sig.args[0])(context, builder, value=args[0]).data
        at = context.cast(builder, args[1], sig.args[1], types.intp)
        address = builder.bitcast(builder.gep(data, [at]), ir.IntType(8).as_pointer())
        i32 = ir.IntType(32)
        hint = ir.FunctionType(ir.VoidType(), [address.type, i32, i32, i32])
        # llvm.prefetch(address, read, locality 3 = keep in all levels, data cache)
        fn = cgutils.get_or_insert_function(builder.module, hint, "llvm.prefetch.p0i8")
        builder.call(fn, [address, ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return signature, codegen


# Lanes of max_lanes' running maxima: 16 float32 (one AVX-512 vector, two AVX2 ones), four of them side by side.
_MAX_LANES = 16
_MAX_CHAINS = 4


@intrinsic
def max_lanes(typingctx: object, values: types.Type, at: types.Type, count: types.Type) -> tuple:
    """``max(values[at:at + count])`` (float32, a contiguous array), ``-inf`` for ``count == 0``; a NaN is skipped.

    Four chains of 16-lane ``llvm.maxnum`` over 64 elements a step, joined and reduced by halves, then the
    last few elements one by one. Written as a loop over ``max(largest, values[j])``, even with ``nnan``, LLVM
    kept the maximum a scalar chain (its vectorizer takes a select-based maximum only in a function marked
    no-NaNs as a whole): ~2 cycles an element, 1.7 ms for 64 rows of a 49k vocabulary against 0.25 for numpy.
    """
    if not (isinstance(values, types.Array) and values.dtype == types.float32 and values.layout == "C"
            and isinstance(at, types.Integer) and isinstance(count, types.Integer)):
        return None
    signature = types.float32(values, types.int64, types.int64)

    def codegen(context: object, builder: ir.IRBuilder, sig: object, args: list) -> ir.Value:
        array, first, total = args
        int64, flt = ir.IntType(64), ir.FloatType()
        vector = ir.VectorType(flt, _MAX_LANES)
        data = cgutils.create_struct_proxy(sig.args[0])(context, builder, value=array).data
        vmax = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vector, [vector, vector]),
                                              f"llvm.maxnum.v{_MAX_LANES}f32")
        smax = cgutils.get_or_insert_function(builder.module, ir.FunctionType(flt, [flt, flt]), "llvm.maxnum.f32")
        lowest = ir.Constant(vector, [float("-inf")] * _MAX_LANES)

        def load(index: ir.Value) -> ir.Value:
            pointer = builder.bitcast(builder.gep(data, [index]), vector.as_pointer())
            return builder.load(pointer, align=4)

        def rounded_down(multiple: int) -> ir.Value:  # total rounded down to a multiple
            return builder.mul(builder.udiv(total, ir.Constant(int64, multiple)), ir.Constant(int64, multiple))

        # 64-element steps up to `whole`, 16-lane pieces up to `pieces`, then one element at a time.
        wide = _MAX_LANES * _MAX_CHAINS
        whole, pieces = rounded_down(wide), rounded_down(_MAX_LANES)
        chains = [cgutils.alloca_once_value(builder, lowest) for _ in range(_MAX_CHAINS)]
        with cgutils.for_range(builder, builder.udiv(total, ir.Constant(int64, wide))) as loop:
            base = builder.add(first, builder.mul(loop.index, ir.Constant(int64, wide)))
            for k, chain in enumerate(chains):
                value = load(builder.add(base, ir.Constant(int64, k * _MAX_LANES)))
                builder.store(builder.call(vmax, [builder.load(chain), value]), chain)
        joined = builder.call(vmax, [builder.call(vmax, [builder.load(chains[0]), builder.load(chains[1])]),
                                     builder.call(vmax, [builder.load(chains[2]), builder.load(chains[3])])])
        running = cgutils.alloca_once_value(builder, joined)
        left = builder.udiv(builder.sub(pieces, whole), ir.Constant(int64, _MAX_LANES))
        with cgutils.for_range(builder, left) as loop:
            index = builder.add(builder.add(first, whole), builder.mul(loop.index, ir.Constant(int64, _MAX_LANES)))
            builder.store(builder.call(vmax, [builder.load(running), load(index)]), running)
        # The 16 lanes to one: each level takes the maximum of the two halves (the last, of two 1-lane vectors).
        level = builder.load(running)
        width = _MAX_LANES
        while width > 1:
            width //= 2
            half = ir.VectorType(flt, width)
            halves = [builder.shuffle_vector(level, level, ir.Constant(ir.VectorType(ir.IntType(32), width),
                                                                       list(range(start, start + width))))
                      for start in (0, width)]
            half_max = cgutils.get_or_insert_function(builder.module, ir.FunctionType(half, [half, half]),
                                                      f"llvm.maxnum.v{width}f32")
            level = builder.call(half_max, halves)
        level = builder.extract_element(level, ir.Constant(ir.IntType(32), 0))
        largest = cgutils.alloca_once_value(builder, level)
        with cgutils.for_range(builder, builder.sub(total, pieces)) as loop:
            value = builder.load(builder.gep(data, [builder.add(builder.add(first, pieces), loop.index)]))
            builder.store(builder.call(smax, [builder.load(largest), value]), largest)
        return builder.load(largest)

    return signature, codegen


def _lanes_at(context: object, builder: ir.IRBuilder, array_type: types.Array, array: ir.Value, index: ir.Value,
              vector: ir.VectorType) -> ir.Value:
    """A pointer to the vector of ``array``'s elements from flat position ``index``."""
    data = cgutils.create_struct_proxy(array_type)(context, builder, value=array).data
    return builder.bitcast(builder.gep(data, [index]), vector.as_pointer())


@intrinsic
def fma_sum_lanes(typingctx: object, acc: types.Type, acc_at: types.Type, acc_head: types.Type, a: types.Type,
                  a_at: types.Type, a_head: types.Type, a_step: types.Type, b: types.Type, b_at: types.Type,
                  b_offsets: types.Type, count: types.Type, lanes: types.Type, a_lanes: types.Type,
                  heads: types.Type) -> tuple:
    """For each ``h < heads``: ``acc[acc_at + h * acc_head + i] += sum_{c < count} a[a_at + h * a_head + c * a_step
    + i % a_lanes] * b[b_offsets[c] + b_at + i]``, ``i < lanes``.

    Summed in order of ``c``, one rounding per multiply-add (as ``count`` calls of ``fma_lanes``);
    ``b_offsets`` (int64) places each step's ``b`` lanes anywhere, e.g. in a different cache block;
    ``a``'s ``a_lanes`` (a literal dividing ``lanes``) repeat across the lanes: one block's softmax weights
    against several rows of its value block. The ``heads`` (a literal) sums share each loaded ``b`` vector:
    GQA query heads against their kv head's block, each with its own running sum in registers, each sum
    the same chain of roundings as alone. Positions are flat element offsets into C-contiguous float32
    arrays; the caller keeps them in bounds.
    """
    literals = (lanes, a_lanes, heads)
    if not all(isinstance(t, types.IntegerLiteral) for t in literals):
        return None
    if lanes.literal_value % a_lanes.literal_value or heads.literal_value < 1:
        return None
    if not all(isinstance(t, types.Array) and t.dtype == types.float32 and t.layout == "C" for t in (acc, a, b)):
        return None
    if not (isinstance(b_offsets, types.Array) and b_offsets.dtype == types.int64 and b_offsets.ndim == 1):
        return None
    width, repeat, num_heads = (t.literal_value for t in literals)
    signature = types.void(acc, types.int64, types.int64, a, types.int64, types.int64, types.int64, b, types.int64,
                           b_offsets, types.int64, lanes, a_lanes, heads)

    def codegen(context: object, builder: ir.IRBuilder, sig: object, args: list) -> ir.Value:
        acc_array, acc_index, acc_stride, a_array, a_index, a_head_stride, a_stride = args[:7]
        b_array, b_index, offsets, steps = args[7:11]
        vector = ir.VectorType(ir.FloatType(), width)
        a_vector = ir.VectorType(ir.FloatType(), repeat)
        tile = ir.Constant(ir.VectorType(ir.IntType(32), width), [i % repeat for i in range(width)])
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vector, [vector] * 3),
                                             f"llvm.fma.v{width}f32")
        acc_pointers, totals, a_firsts = [], [], []
        for h in range(num_heads):
            head = ir.Constant(ir.IntType(64), h)
            pointer = _lanes_at(context, builder, sig.args[0], acc_array,
                                builder.add(acc_index, builder.mul(head, acc_stride)), vector)
            # A stack slot that LLVM promotes to registers: the running sum never goes through memory.
            total = cgutils.alloca_once(builder, vector)
            builder.store(builder.load(pointer, align=4), total)
            acc_pointers.append(pointer)
            totals.append(total)
            a_firsts.append(builder.add(a_index, builder.mul(head, a_head_stride)))
        offsets_data = cgutils.create_struct_proxy(sig.args[9])(context, builder, value=offsets).data
        with cgutils.for_range(builder, steps) as loop:
            offset = builder.load(builder.gep(offsets_data, [loop.index]))
            b_pointer = _lanes_at(context, builder, sig.args[7], b_array, builder.add(b_index, offset), vector)
            right = builder.load(b_pointer, align=4)
            step = builder.mul(loop.index, a_stride)
            for first, total in zip(a_firsts, totals):
                a_pointer = _lanes_at(context, builder, sig.args[3], a_array, builder.add(first, step), a_vector)
                left = builder.load(a_pointer, align=4)
                if repeat != width:
                    left = builder.shuffle_vector(left, left, tile)
                builder.store(builder.call(fma, [left, right, builder.load(total)]), total)
        for pointer, total in zip(acc_pointers, totals):
            builder.store(builder.load(total), pointer, align=4)
        return context.get_dummy_value()

    return signature, codegen


def _gemm_tile_shape(out: types.Type, a: types.Type, a_group: types.Type, b: types.Type, rows: types.Type,
                     vectors: types.Type, lanes: types.Type, start: types.Type | None = None) -> tuple | None:
    """(rows, vectors, lanes, log2 of a_group) of a tile whose argument types gemm_tile takes, else None."""
    if not isinstance(a_group, types.IntegerLiteral) or a_group.literal_value & (a_group.literal_value - 1):
        return None
    literals = (rows, vectors, lanes)
    if not all(isinstance(t, types.IntegerLiteral) for t in literals):
        return None
    arrays = (out, a, b) if start is None else (out, a, b, start)
    if not all(isinstance(t, types.Array) and t.dtype == types.float32 and t.layout == "C" for t in arrays):
        return None
    return (*(t.literal_value for t in literals), a_group.literal_value.bit_length() - 1)


def _gemm_tile_codegen(shape: tuple, with_start: bool):  # -> the intrinsic's codegen
    """The tile's code; ``with_start``: its sums start from one ``start`` row (two more arguments after
    ``out_ld``) instead of from ``out``."""
    num_rows, num_vectors, width, group_shift = shape
    skip = 2 if with_start else 0

    def codegen(context: object, builder: ir.IRBuilder, sig: object, args: list) -> ir.Value:
        out_array, out_index, out_stride = args[:3]
        a_array, a_index, a_stride, _, a_group_stride = args[3 + skip:8 + skip]
        b_array, b_index, b_stride, steps = args[8 + skip:12 + skip]
        a_type, b_type = sig.args[3 + skip], sig.args[8 + skip]
        int64 = ir.IntType(64)
        vector = ir.VectorType(ir.FloatType(), width)
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vector, [vector] * 3),
                                             f"llvm.fma.v{width}f32")
        a_data = cgutils.create_struct_proxy(a_type)(context, builder, value=a_array).data

        def out_pointer(m: int, v: int) -> ir.Value:
            index = builder.add(out_index, builder.add(builder.mul(ir.Constant(ir.IntType(64), m), out_stride),
                                                       ir.Constant(ir.IntType(64), v * width)))
            return _lanes_at(context, builder, sig.args[0], out_array, index, vector)

        # Stack slots that LLVM promotes to registers: the tile never goes through memory inside the loop.
        tile = [[cgutils.alloca_once(builder, vector) for _ in range(num_vectors)] for _ in range(num_rows)]
        if with_start:
            # One row of start values for every row of the tile (a bias): nothing of out is read.
            firsts = [builder.load(_lanes_at(context, builder, sig.args[3], args[3],
                                             builder.add(args[4], ir.Constant(int64, v * width)), vector), align=4)
                      for v in range(num_vectors)]
        for m in range(num_rows):
            for v in range(num_vectors):
                first = firsts[v] if with_start else builder.load(out_pointer(m, v), align=4)
                builder.store(first, tile[m][v])
        with cgutils.for_range(builder, steps) as loop:
            b_row = builder.add(b_index, builder.mul(loop.index, b_stride))
            a_column = builder.add(
                builder.mul(builder.lshr(loop.index, ir.Constant(int64, group_shift)), a_group_stride),
                builder.and_(loop.index, ir.Constant(int64, (1 << group_shift) - 1)))
            loaded = [builder.load(_lanes_at(context, builder, b_type, b_array,
                                             builder.add(b_row, ir.Constant(ir.IntType(64), v * width)), vector),
                                   align=4) for v in range(num_vectors)]
            for m in range(num_rows):
                a_position = builder.add(a_index, builder.add(builder.mul(ir.Constant(int64, m), a_stride), a_column))
                scalar = builder.load(builder.gep(a_data, [a_position]))
                broadcast = cgutils.get_null_value(vector)
                broadcast = builder.insert_element(broadcast, scalar, ir.Constant(ir.IntType(32), 0))
                broadcast = builder.shuffle_vector(broadcast, broadcast,
                                                   ir.Constant(ir.VectorType(ir.IntType(32), width), [0] * width))
                for v in range(num_vectors):
                    builder.store(builder.call(fma, [broadcast, loaded[v], builder.load(tile[m][v])]), tile[m][v])
        for m in range(num_rows):
            for v in range(num_vectors):
                builder.store(builder.load(tile[m][v]), out_pointer(m, v), align=4)
        return context.get_dummy_value()

    return codegen


@intrinsic
def gemm_tile(typingctx: object, out: types.Type, out_at: types.Type, out_ld: types.Type, a: types.Type,
              a_at: types.Type, a_ld: types.Type, a_group: types.Type, a_group_ld: types.Type, b: types.Type,
              b_at: types.Type, b_ld: types.Type, depth: types.Type, rows: types.Type, vectors: types.Type,
              lanes: types.Type) -> tuple:
    """``out[out_at + m * out_ld + j] += sum_{k < depth} a[a(m, k)] * b[b_at + k * b_ld + j]``.

    For ``m < rows`` and ``j < vectors * lanes`` (literals): a register tile of ``rows x vectors`` vectors
    of ``lanes`` float32, each ``a`` element broadcast against ``vectors`` loaded vectors of ``b`` per step.
    ``a(m, k) = a_at + m * a_ld + (k // a_group) * a_group_ld + k % a_group``: ``a``'s rows run along ``k`` in
    groups of ``a_group`` (a literal power of two; 1 with ``a_group_ld`` 1 for a plain row), as a key
    block's dims do (x of them per cache row). Summed in order of ``k`` from ``out``'s value, one rounding
    per multiply-add. Positions are flat element offsets into C-contiguous float32 arrays; the caller keeps
    them in bounds.
    """
    shape = _gemm_tile_shape(out, a, a_group, b, rows, vectors, lanes)
    if shape is None:
        return None
    i64 = types.int64
    signature = types.void(out, i64, i64, a, i64, i64, a_group, i64, b, i64, i64, i64, rows, vectors, lanes)
    return signature, _gemm_tile_codegen(shape, with_start=False)


@intrinsic
def gemm_tile_from(typingctx: object, out: types.Type, out_at: types.Type, out_ld: types.Type, start: types.Type,
                   start_at: types.Type, a: types.Type, a_at: types.Type, a_ld: types.Type, a_group: types.Type,
                   a_group_ld: types.Type, b: types.Type, b_at: types.Type, b_ld: types.Type, depth: types.Type,
                   rows: types.Type, vectors: types.Type, lanes: types.Type) -> tuple:
    """``out[out_at + m * out_ld + j] = start[start_at + j] + sum_{k < depth} a[a(m, k)] * b[b_at + k * b_ld + j]``.

    ``gemm_tile`` with every row's sums started from one row of ``start`` (a bias, or zeros) rather than from
    ``out``, which is only written: a projection needs no pass that fills ``out`` with its bias first (on a
    2-core Zen 4 that pass and the tiles' reloading of it cost a layer's projections 9-10 % at 64 to 2048
    rows). The same chain of roundings as ``gemm_tile`` over an ``out`` holding that row.
    """
    shape = _gemm_tile_shape(out, a, a_group, b, rows, vectors, lanes, start)
    if shape is None:
        return None
    i64 = types.int64
    signature = types.void(out, i64, i64, start, i64, a, i64, i64, a_group, i64, b, i64, i64, i64, rows, vectors,
                           lanes)
    return signature, _gemm_tile_codegen(shape, with_start=True)


def _halves_mask(width: int, partials: int, upper: bool) -> ir.Constant:
    """Lanes of (a, b) that hold each row's first (or second) half of ``partials`` partial sums, a's rows first."""
    rows = width // partials
    half = partials // 2
    lanes = [vector * width + row * partials + (half if upper else 0) + i
             for vector in (0, 1) for row in range(rows) for i in range(half)]
    return ir.Constant(ir.VectorType(ir.IntType(32), width), lanes)


@intrinsic
def row_sums(typingctx: object, src: types.Type, src_at: types.Type, out: types.Type, out_at: types.Type,
             rows: types.Type, scale: types.Type, width: types.Type) -> tuple:
    """``out[out_at + r] = scale * sum_o src[src_at + r * width + o]`` for ``r < rows`` (a multiple of ``width``).

    ``width`` (a literal, 8 or 16) rows at a time as one transpose-and-add tree of vector shuffles: each
    level adds the two halves of every row's partial sums and packs two vectors into one, so ``width``
    rows take ``2 * (width - 1)`` shuffles and ``width - 1`` adds instead of ``width * (width - 1)`` scalar adds.
    """
    if not isinstance(width, types.IntegerLiteral) or width.literal_value not in (8, 16):
        return None
    if not all(isinstance(t, types.Array) and t.dtype == types.float32 and t.layout == "C" for t in (src, out)):
        return None
    lanes = width.literal_value
    signature = types.void(src, types.int64, out, types.int64, types.int64, types.float32, width)

    def codegen(context: object, builder: ir.IRBuilder, sig: object, args: list) -> ir.Value:
        src_array, src_index, out_array, out_index, count, factor, _ = args
        vector = ir.VectorType(ir.FloatType(), lanes)
        int64 = ir.IntType(64)
        groups = builder.udiv(count, ir.Constant(int64, lanes))
        with cgutils.for_range(builder, groups) as loop:
            first = builder.mul(loop.index, ir.Constant(int64, lanes))
            base = builder.add(src_index, builder.mul(first, ir.Constant(int64, lanes)))
            level = [builder.load(_lanes_at(context, builder, sig.args[0], src_array,
                                            builder.add(base, ir.Constant(int64, r * lanes)), vector), align=4)
                     for r in range(lanes)]
            partials = lanes
            while len(level) > 1:
                low, high = _halves_mask(lanes, partials, False), _halves_mask(lanes, partials, True)
                level = [builder.fadd(builder.shuffle_vector(a, b, low), builder.shuffle_vector(a, b, high))
                         for a, b in zip(level[0::2], level[1::2])]
                partials //= 2
            # One row per lane, in order, after the last level.
            broadcast = builder.shuffle_vector(
                builder.insert_element(ir.Constant(vector, None), factor, ir.Constant(ir.IntType(32), 0)),
                ir.Constant(vector, None), ir.Constant(ir.VectorType(ir.IntType(32), lanes), [0] * lanes))
            scaled = builder.fmul(level[0], broadcast)
            builder.store(scaled, _lanes_at(context, builder, sig.args[2], out_array,
                                            builder.add(out_index, first), vector), align=4)
        return context.get_dummy_value()

    return signature, codegen


# Lanes of the tiles transpose_tile moves: 16 float32, one AVX-512 vector (two AVX2 ones).
TRANSPOSE_LANES = 16


def _zip_masks(lanes: int) -> tuple[ir.Constant, ir.Constant]:
    """Lanes of (a, b) interleaved: a's first half with b's first half, then the second halves."""
    half = lanes // 2
    mask = ir.VectorType(ir.IntType(32), lanes)
    low = [lane for i in range(half) for lane in (i, lanes + i)]
    high = [lane for i in range(half, lanes) for lane in (i, lanes + i)]
    return ir.Constant(mask, low), ir.Constant(mask, high)


@intrinsic
def transpose_tile(typingctx: object, dst: types.Type, dst_at: types.Type, dst_step: types.Type, src: types.Type,
                   src_at: types.Type, src_step: types.Type, factors: types.Type, factors_at: types.Type) -> tuple:
    """``dst[dst_at + c * dst_step + r] = src[src_at + r * src_step + c] * factors[factors_at + c]`` for ``r, c < 16``.

    A 16 x 16 tile transposed in registers, each element scaled on the way (one rounding, as the scalar
    product): 16 vector loads, four rounds of interleaving row ``i`` with row ``i + 8`` (after four, row ``c``
    holds column ``c``; 64 shuffles), 16 vector stores, where the scalar loop takes 256 loads and 256 stores
    to scattered lines. Positions are flat element offsets into float32 arrays (``src`` may be a strided view:
    offsets from its first element); the caller keeps them in bounds.
    """
    if not all(isinstance(t, types.Array) and t.dtype == types.float32 for t in (dst, src, factors)):
        return None
    if dst.layout != "C" or factors.layout != "C":
        return None
    signature = types.void(dst, types.int64, types.int64, src, types.int64, types.int64, factors, types.int64)

    def codegen(context: object, builder: ir.IRBuilder, sig: object, args: list) -> ir.Value:
        dst_array, dst_index, dst_stride, src_array, src_index, src_stride, factor_array, factor_index = args
        lanes = TRANSPOSE_LANES
        vector = ir.VectorType(ir.FloatType(), lanes)
        int64 = ir.IntType(64)
        scale = builder.load(_lanes_at(context, builder, sig.args[6], factor_array, factor_index, vector), align=4)
        rows = []
        for r in range(lanes):
            at = builder.add(src_index, builder.mul(src_stride, ir.Constant(int64, r)))
            rows.append(builder.fmul(builder.load(_lanes_at(context, builder, sig.args[3], src_array, at, vector),
                                                  align=4), scale))
        low, high = _zip_masks(lanes)
        half = lanes // 2
        for _ in range(lanes.bit_length() - 1):
            rows = [zipped for i in range(half) for zipped in (builder.shuffle_vector(rows[i], rows[i + half], low),
                                                                builder.shuffle_vector(rows[i], rows[i + half], high))]
        for c in range(lanes):
            at = builder.add(dst_index, builder.mul(dst_stride, ir.Constant(int64, c)))
            builder.store(rows[c], _lanes_at(context, builder, sig.args[0], dst_array, at, vector), align=4)
        return context.get_dummy_value()

    return signature, codegen

"""16-byte global loads and stores for Numba kernels: ``load4(a, r, c)`` is ``(a[r, c], .., a[r, c + 3])``
read by one ``ld.global.v4.f32`` (SASS ``LDG.E.128``); ``store4(a, r, c, v0, v1, v2, v3)`` writes
them with one ``st.global.v4.f32`` (``STG.E.128``), under the same promise.

Why: NVVM only merges adjacent scalar loads into a vector load when it can prove the address
16-byte aligned, and a Numba array's row stride is a run-time value, so every element of a
register-blocked GEMM's global fetch is its own ``LDG.E`` (4x the load instructions, and 4x the
L1 wavefronts of the vector). ``load4`` states the alignment instead: the caller promises that
``a``'s base address and row stride are multiples of 16 bytes, its rows are contiguous, ``c`` is a
multiple of 4 and the 4 elements are inside the array (:func:`aligned16` checks the first three
from the host). A broken promise is a misaligned-address fault on the GPU, not a wrong result.

A vector store needs its 4 values in 4 adjacent registers (a quad starting at a multiple of 4).
Storing a GEMM's accumulators directly that way constrains where ptxas keeps them through the
whole FMA loop, and the FMAs then meet more register-bank conflicts (variant 12 of
``gemm.py``); stage the values through shared memory and store what a 16-byte shared load
brought (variant 13) instead.

Under the CUDA simulator ``load4`` is four ordinary (bounds-checked) element reads and ``store4``
four element writes.
"""

from __future__ import annotations

from llvmlite import ir
from numba import cuda, types

from ._util import simulating

VECTOR_BYTES = 16


def aligned16(a) -> bool:
    """True if a 2-D float32 array can be read 4 elements at a time from any column that is a
    multiple of 4: base address and row stride multiples of 16 bytes, unit column stride. Takes
    device arrays (``__cuda_array_interface__``) and the simulator's (``__array_interface__``)."""
    iface = getattr(a, "__cuda_array_interface__", None) or a.__array_interface__
    shape = tuple(iface["shape"])
    if len(shape) != 2:
        return False
    itemsize = 4
    row, col = iface.get("strides") or (shape[1] * itemsize, itemsize)
    return (iface["data"][0] % VECTOR_BYTES == 0 and (shape[0] <= 1 or row % VECTOR_BYTES == 0)
            and (shape[1] <= 1 or col == itemsize))


def _is_float32_cell(array, row, col) -> bool:
    """Typing: a 2-D float32 array indexed by two integers."""
    return (isinstance(array, types.Array) and array.ndim == 2 and array.dtype == types.float32
            and isinstance(row, types.Integer) and isinstance(col, types.Integer))


def _vector_pointer(context, builder, sig, args):
    """Codegen: a ``<4 x float>*`` to ``array[row, col]`` (the first three arguments)."""
    from numba.cuda import cgutils

    aty, rty, cty = sig.args[:3]
    ary = context.make_array(aty)(context, builder, value=args[0])
    idx = [context.cast(builder, args[1], rty, types.intp), context.cast(builder, args[2], cty, types.intp)]
    ptr = cgutils.get_item_pointer(context, builder, aty, ary, idx, wraparound=False)
    return builder.bitcast(ptr, ir.VectorType(ir.FloatType(), 4).as_pointer())


def _make_load4():
    from numba.cuda.extending import intrinsic

    @intrinsic
    def load4(typingctx, array, row, col):
        if not _is_float32_cell(array, row, col):
            return None
        sig = types.UniTuple(types.float32, 4)(array, row, col)

        def codegen(context, builder, sig, args):
            vec = builder.load(_vector_pointer(context, builder, sig, args), align=VECTOR_BYTES)
            elems = [builder.extract_element(vec, ir.Constant(ir.IntType(32), i)) for i in range(4)]
            return context.make_tuple(builder, sig.return_type, elems)

        return sig, codegen

    return load4


def _make_store4():
    from numba.cuda.extending import intrinsic

    @intrinsic
    def store4(typingctx, array, row, col, v0, v1, v2, v3):
        if not _is_float32_cell(array, row, col):
            return None
        sig = types.void(array, row, col, v0, v1, v2, v3)

        def codegen(context, builder, sig, args):
            ptr = _vector_pointer(context, builder, sig, args)
            vec = ir.Constant(ir.VectorType(ir.FloatType(), 4), ir.Undefined)
            for i, (val, ty) in enumerate(zip(args[3:], sig.args[3:])):
                vec = builder.insert_element(vec, context.cast(builder, val, ty, types.float32),
                                             ir.Constant(ir.IntType(32), i))
            builder.store(vec, ptr, align=VECTOR_BYTES)
            return context.get_dummy_value()

        return sig, codegen

    return store4


def _make_store4_sim():
    @cuda.jit(device=True)
    def store4(a, r, c, v0, v1, v2, v3):
        a[r, c] = v0
        a[r, c + 1] = v1
        a[r, c + 2] = v2
        a[r, c + 3] = v3

    return store4


def _make_load4_sim():
    @cuda.jit(device=True)
    def load4(a, r, c):
        return a[r, c], a[r, c + 1], a[r, c + 2], a[r, c + 3]

    return load4


load4 = _make_load4_sim() if simulating() else _make_load4()
store4 = _make_store4_sim() if simulating() else _make_store4()

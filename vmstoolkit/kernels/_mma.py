"""Tensor cores from Numba: ``mma.sync``, ``ldmatrix`` and ``cp.async`` as inline PTX.

numba-cuda has no MMA API; like :mod:`._vector`'s loads, these are ``numba.cuda.extending.intrinsic``
functions whose codegen emits llvmlite ``ir.InlineAsm`` (NVVM passes inline PTX through to ptxas):

- ``mma_bf16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3) -> (d0, d1, d2, d3)``:
  ``mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32``, D = A B + C for one warp, A 16 x 16 and
  B 16 x 8 bf16 as packed pairs in uint32 registers, C and D fp32 (lane layouts: :mod:`.mma_layout`);
- ``ldmatrix_x4(smem, i)`` / ``ldmatrix_x4_trans(smem, i)`` -> 4 uint32: ``ldmatrix.sync.aligned.m8n8.x4
  [.trans].shared.b16``, four 8 x 8 b16 matrices from shared memory; lane l names, by element index
  ``i`` into the 1-D uint16 shared array ``smem``, the start of row ``l % 8`` of matrix ``l // 8``
  (16 bytes, 16-byte aligned);
- ``mma_tf32(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3) -> (d0, d1, d2, d3)``:
  ``mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32``, D = A B + C, A 16 x 8 and B 8 x 8 one
  tf32 a register, passed as float32 values (from ``cvt_tf32``: the tensor core reads the top 19
  bits of each), C and D fp32 (lane layouts: :mod:`.mma_layout`);
- ``cvt_tf32(x) -> float32``: ``cvt.rna.tf32.f32``, ``x`` rounded to the nearest tf32 (ties away
  from zero), then its low 13 bits cleared: the tf32 value as an exact float32. ptxas (13.0,
  sm_90) makes the cvt an add of half a tf32 ulp to the bits of a finite ``x`` (FSETP + IADD) and
  leaves the low bits as they come, which the mma ignores but arithmetic does not (3xTF32's
  ``x - big``); ``cvt_tf32_mma(x)``: the cvt alone, for values that only feed an mma;
- ``lds4(smem, i) -> 4 float32``: ``smem[i:i+4]`` of a 1-D float32 shared array by one
  ``ld.shared.v4.f32`` (the caller promises ``i`` a multiple of 4);
- ``cp_async16(smem, i, g, r, c, nbytes)``: ``cp.async.cg.shared.global`` of the 16 bytes at
  ``g[r, c]`` (a 2-D uint16/int16 array, or a float32/int32/uint32 one, of the dtype size of
  ``smem``; the caller promises 16-byte alignment) to the 16 bytes at ``smem[i]`` (8 b16 elements
  or 4 32-bit ones), reading only ``nbytes`` (0 or 16) and zero-filling the rest; ``cp_async16_at(smem, i, g, off,
  nbytes)`` the same from element ``off`` of ``g``'s memory (``r * row_stride + c`` in elements:
  a loop can step it by one add instead of recomputing a 2-D address); ``cp_async4(smem, i, g, r,
  c, nbytes)`` the same for one float32 (``cp.async.ca``, 4 bytes; ``nbytes`` 0 or 4) from a 2-D
  float32 ``g`` into a 1-D float32 ``smem``; ``cp_async_commit()`` and
  ``cp_async_wait(n)`` (``n`` a constant: wait until at most ``n`` committed groups are pending);
- ``pack_bf16x2(lo, hi) -> uint32``: two fp32 rounded to bf16 (``cvt.rn.bf16x2.f32``), ``lo`` in
  the low half;
- ``bf16_to_f32(bits) -> float32``: the (exact) value of the bf16 bit pattern in the low 16 bits
  of ``bits`` (uint16/int16 from a bf16 array, or uint32 such as half of a packed pair): a shift and
  a bit cast, no PTX;
- ``shfl_xor_f32(v, mask) -> float32``: lane ``l`` gets lane ``l ^ mask``'s ``v``
  (``shfl.sync.bfly`` over the full warp; the simulator has no warp shuffles, hence a twin);
- ``exp2_approx(x) -> float32``: ``ex2.approx.ftz.f32`` (MUFU.EX2 alone: 2 ulp, denormals flushed,
  ``exp2(-inf) = 0``), the flash-attention softmax's exponential;
- ``red_add_f32x2(a, i0, i1, i2, i3, v0, v1)``: ``a[i0, i1, i2, i3:i3+2] += (v0, v1)`` atomically by
  one ``red.global.add.v2.f32`` (sm_90; a 4-D float32 array in global memory, the caller promises
  the pair 8-byte aligned: unit last stride and an even ``i3`` on an 8-byte-aligned base).

bf16 data are uint16 arrays of bf16 bit patterns (a torch bf16 tensor viewed as int16 works too:
both are accepted); pairs travel in uint32 registers. ``ldmatrix`` and ``cp.async`` are emitted
with side effects and a memory clobber so that LLVM keeps them in order with the barriers.

Under the CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``) no PTX runs, so each intrinsic has a twin
with the same signature computing the same per-lane result from the reference layouts: the
warp-wide ones (``mma_bf16``, ``ldmatrix_*``) exchange the 32 lanes' operands through a
per-warp table at a block barrier. They therefore need every thread of the block to call
them together (true of the GEMM, whose warps all run the same k loop), and they cost O(warp x
fragment) Python per lane: tiny sizes only. ``mma_tf32``'s twin reads each operand as the
tensor core does (the low 13 bits dropped), so a kernel that skips ``cvt_tf32`` computes with
truncated operands there too; ``lds4``'s raises on an index that is not a multiple of 4.
"""

from __future__ import annotations

import threading

import numpy as np
from llvmlite import ir
from numba import types

from . import mma_layout
from ._util import simulating

_B16 = (types.uint16, types.int16)
_BF16_NAN = 0x7FC0
_B32 = (types.float32, types.uint32, types.int32)


def _is_b16_array(a, ndim: int) -> bool:
    return isinstance(a, types.Array) and a.ndim == ndim and a.dtype in _B16


def _chunk_arrays(smem, g) -> bool:
    """cp.async's typing: a 1-D shared and a 2-D global array of one element size, 2 or 4 bytes."""
    return any(isinstance(smem, types.Array) and smem.ndim == 1 and smem.dtype in kind
               and isinstance(g, types.Array) and g.ndim == 2 and g.dtype in kind for kind in (_B16, _B32))


def _item_pointer(context, builder, aty, ary_val, idx_vals, idx_tys):
    from numba.cuda import cgutils

    ary = context.make_array(aty)(context, builder, value=ary_val)
    idx = [context.cast(builder, v, t, types.intp) for v, t in zip(idx_vals, idx_tys)]
    return cgutils.get_item_pointer(context, builder, aty, ary, idx, wraparound=False)


def _shared_address(builder, ptr):
    """A generic pointer into shared memory -> its 32-bit .shared address (NVVM: ``cvta.to.shared``)."""
    shared = builder.addrspacecast(ptr, ir.PointerType(ptr.type.pointee, 3))
    return builder.ptrtoint(shared, ir.IntType(32))


_I32 = ir.IntType(32)
_F32 = ir.FloatType()


def _emit_cp_async(context, builder, dst, src, nbytes, nbytes_ty, size: int = 16):
    """Codegen of ``cp.async.cg.shared.global [dst], [src], 16, nbytes`` (generic pointers), or for
    ``size`` 4 ``cp.async.ca`` (``.cg`` copies 16 bytes only)."""
    src = builder.addrspacecast(src, ir.PointerType(src.type.pointee, 1))
    n = context.cast(builder, nbytes, nbytes_ty, types.uint32)
    fty = ir.FunctionType(ir.VoidType(), [_I32, src.type, _I32])
    builder.asm(fty, f"cp.async.{'cg' if size == 16 else 'ca'}.shared.global [$0], [$1], {size}, $2;", "r,l,r,~{memory}",
                [_shared_address(builder, dst), src, n], side_effect=True)
    return context.get_dummy_value()


def _emit_mma(context, builder, sig, shape: str, ins):
    """Codegen of ``mma.sync.aligned.{shape}`` with 4 A and 2 B registers (i32), 4 fp32
    accumulators in and out (tied): a tuple of the 4 results."""
    fty = ir.FunctionType(ir.LiteralStructType([_F32] * 4), [_I32] * 6 + [_F32] * 4)
    asm = f"mma.sync.aligned.{shape} {{$0, $1, $2, $3}}, {{$4, $5, $6, $7}}, {{$8, $9}}, {{$10, $11, $12, $13}};"
    out = builder.asm(fty, asm, "=f,=f,=f,=f,r,r,r,r,r,r,0,1,2,3", ins, side_effect=False)
    return context.make_tuple(builder, sig.return_type, [builder.extract_value(out, i) for i in range(4)])


def widens(bits) -> bool:
    """Whether ``bf16_to_f32`` takes an argument of Numba type ``bits``: any integer, whose low 16
    bits are the bf16 value. ``packed[i] >> 16`` on a uint32 array types as int64, so a test of
    uint16/int16/uint32/int32 alone refused the upper half of a packed pair on the GPU (the
    simulator twin takes anything)."""
    return isinstance(bits, types.Integer)


def _make_gpu():
    from numba.cuda.extending import intrinsic

    @intrinsic
    def mma_bf16(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        regs, accs = (a0, a1, a2, a3, b0, b1), (c0, c1, c2, c3)
        if not all(isinstance(r, types.Integer) for r in regs) or not all(isinstance(c, types.Float) for c in accs):
            return None
        sig = types.UniTuple(types.float32, 4)(*regs, *accs)

        def codegen(context, builder, sig, args):
            ins = [context.cast(builder, v, t, types.uint32) for v, t in zip(args[:6], sig.args[:6])]
            ins += [context.cast(builder, v, t, types.float32) for v, t in zip(args[6:], sig.args[6:])]
            return _emit_mma(context, builder, sig, "m16n8k16.row.col.f32.bf16.bf16.f32", ins)

        return sig, codegen

    def _ldmatrix(trans: bool):
        suffix = ".trans" if trans else ""

        def typer(typingctx, smem, index):
            if not _is_b16_array(smem, 1) or not isinstance(index, types.Integer):
                return None
            sig = types.UniTuple(types.uint32, 4)(smem, index)

            def codegen(context, builder, sig, args):
                ptr = _item_pointer(context, builder, sig.args[0], args[0], args[1:], sig.args[1:])
                fty = ir.FunctionType(ir.LiteralStructType([_I32] * 4), [_I32])
                asm = f"ldmatrix.sync.aligned.m8n8.x4{suffix}.shared.b16 {{$0, $1, $2, $3}}, [$4];"
                out = builder.asm(fty, asm, "=r,=r,=r,=r,r,~{memory}", [_shared_address(builder, ptr)],
                                  side_effect=True)
                return context.make_tuple(builder, sig.return_type, [builder.extract_value(out, i) for i in range(4)])

            return sig, codegen

        typer.__name__ = "ldmatrix_x4" + ("_trans" if trans else "")
        return intrinsic(typer)

    @intrinsic
    def cp_async16(typingctx, smem, sindex, g, row, col, nbytes):
        if not (_chunk_arrays(smem, g) and all(isinstance(x, types.Integer) for x in (sindex, row, col, nbytes))):
            return None
        sig = types.void(smem, sindex, g, row, col, nbytes)

        def codegen(context, builder, sig, args):
            dst = _item_pointer(context, builder, sig.args[0], args[0], args[1:2], sig.args[1:2])
            src = _item_pointer(context, builder, sig.args[2], args[2], args[3:5], sig.args[3:5])
            return _emit_cp_async(context, builder, dst, src, args[5], sig.args[5])

        return sig, codegen

    @intrinsic
    def cp_async4(typingctx, smem, sindex, g, row, col, nbytes):
        if not (isinstance(smem, types.Array) and smem.ndim == 1 and smem.dtype == types.float32
                and isinstance(g, types.Array) and g.ndim == 2 and g.dtype == types.float32
                and all(isinstance(x, types.Integer) for x in (sindex, row, col, nbytes))):
            return None
        sig = types.void(smem, sindex, g, row, col, nbytes)

        def codegen(context, builder, sig, args):
            dst = _item_pointer(context, builder, sig.args[0], args[0], args[1:2], sig.args[1:2])
            src = _item_pointer(context, builder, sig.args[2], args[2], args[3:5], sig.args[3:5])
            return _emit_cp_async(context, builder, dst, src, args[5], sig.args[5], size=4)

        return sig, codegen

    @intrinsic
    def cp_async16_at(typingctx, smem, sindex, g, offset, nbytes):
        if not (_chunk_arrays(smem, g) and all(isinstance(x, types.Integer) for x in (sindex, offset, nbytes))):
            return None
        sig = types.void(smem, sindex, g, offset, nbytes)

        def codegen(context, builder, sig, args):
            dst = _item_pointer(context, builder, sig.args[0], args[0], args[1:2], sig.args[1:2])
            ary = context.make_array(sig.args[2])(context, builder, value=args[2])
            off = context.cast(builder, args[3], sig.args[3], types.intp)
            src = builder.gep(ary.data, [off])
            return _emit_cp_async(context, builder, dst, src, args[4], sig.args[4])

        return sig, codegen

    @intrinsic
    def cp_async_commit(typingctx):
        sig = types.void()

        def codegen(context, builder, sig, args):
            builder.asm(ir.FunctionType(ir.VoidType(), []), "cp.async.commit_group;", "~{memory}", [],
                        side_effect=True)
            return context.get_dummy_value()

        return sig, codegen

    @intrinsic
    def cp_async_wait(typingctx, n):
        if not isinstance(n, types.IntegerLiteral):
            return None
        pending = int(n.literal_value)
        sig = types.void(n)

        def codegen(context, builder, sig, args):
            builder.asm(ir.FunctionType(ir.VoidType(), []), f"cp.async.wait_group {pending};", "~{memory}", [],
                        side_effect=True)
            return context.get_dummy_value()

        return sig, codegen

    @intrinsic
    def pack_bf16x2(typingctx, lo, hi):
        if not (isinstance(lo, types.Float) and isinstance(hi, types.Float)):
            return None
        sig = types.uint32(lo, hi)

        def codegen(context, builder, sig, args):
            vals = [context.cast(builder, v, t, types.float32) for v, t in zip(args, sig.args)]
            fty = ir.FunctionType(_I32, [_F32, _F32])
            # cvt.rn.bf16x2.f32 d, a, b puts a in the upper half: pass (hi, lo)
            return builder.asm(fty, "cvt.rn.bf16x2.f32 $0, $1, $2;", "=r,f,f", [vals[1], vals[0]],
                               side_effect=False)

        return sig, codegen

    @intrinsic
    def bf16_to_f32(typingctx, bits):
        if not widens(bits):
            return None
        sig = types.float32(bits)

        def codegen(context, builder, sig, args):
            v = args[0]
            if v.type.width > 16:
                v = builder.trunc(v, ir.IntType(16))
            return builder.bitcast(builder.shl(builder.zext(v, _I32), ir.Constant(_I32, 16)), _F32)

        return sig, codegen

    @intrinsic
    def mma_tf32(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        args = (a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)
        if not all(isinstance(x, types.Float) for x in args):
            return None
        sig = types.UniTuple(types.float32, 4)(*args)

        def codegen(context, builder, sig, args):
            vals = [context.cast(builder, v, t, types.float32) for v, t in zip(args, sig.args)]
            ins = [builder.bitcast(v, _I32) for v in vals[:6]] + vals[6:]  # tf32 operands are .b32
            return _emit_mma(context, builder, sig, "m16n8k8.row.col.f32.tf32.tf32.f32", ins)

        return sig, codegen

    def _cvt_tf32(exact: bool):
        def typer(typingctx, x):
            if not isinstance(x, types.Float):
                return None
            sig = types.float32(x)

            def codegen(context, builder, sig, args):
                val = context.cast(builder, args[0], sig.args[0], types.float32)
                bits = builder.asm(ir.FunctionType(_I32, [_F32]), "cvt.rna.tf32.f32 $0, $1;", "=r,f", [val],
                                   side_effect=False)
                if exact:
                    bits = builder.and_(bits, ir.Constant(_I32, (0xFFFFFFFF >> 13) << 13))
                return builder.bitcast(bits, _F32)

            return sig, codegen

        typer.__name__ = "cvt_tf32" if exact else "cvt_tf32_mma"
        return intrinsic(typer)

    @intrinsic
    def lds4(typingctx, smem, index):
        if not (isinstance(smem, types.Array) and smem.ndim == 1 and smem.dtype == types.float32
                and isinstance(index, types.Integer)):
            return None
        sig = types.UniTuple(types.float32, 4)(smem, index)

        def codegen(context, builder, sig, args):
            ptr = _item_pointer(context, builder, sig.args[0], args[0], args[1:], sig.args[1:])
            vec = ir.VectorType(_F32, 4)
            shared = builder.addrspacecast(ptr, ir.PointerType(_F32, 3))
            v = builder.load(builder.bitcast(shared, ir.PointerType(vec, 3)), align=16)
            return context.make_tuple(builder, sig.return_type,
                                      [builder.extract_element(v, ir.Constant(_I32, i)) for i in range(4)])

        return sig, codegen

    from numba import cuda

    @cuda.jit(device=True)
    def shfl_xor_f32(v, mask):
        return cuda.shfl_xor_sync(0xFFFFFFFF, v, mask)

    @intrinsic
    def exp2_approx(typingctx, x):
        if not isinstance(x, types.Float):
            return None
        sig = types.float32(x)

        def codegen(context, builder, sig, args):
            val = context.cast(builder, args[0], sig.args[0], types.float32)
            return builder.asm(ir.FunctionType(_F32, [_F32]), "ex2.approx.ftz.f32 $0, $1;", "=f,f", [val],
                               side_effect=False)

        return sig, codegen

    @intrinsic
    def red_add_f32x2(typingctx, a, i0, i1, i2, i3, v0, v1):
        if not (isinstance(a, types.Array) and a.ndim == 4 and a.dtype == types.float32
                and all(isinstance(x, types.Integer) for x in (i0, i1, i2, i3))
                and all(isinstance(x, types.Float) for x in (v0, v1))):
            return None
        sig = types.void(a, i0, i1, i2, i3, v0, v1)

        def codegen(context, builder, sig, args):
            ptr = _item_pointer(context, builder, sig.args[0], args[0], args[1:5], sig.args[1:5])
            ptr = builder.addrspacecast(ptr, ir.PointerType(ptr.type.pointee, 1))
            vals = [context.cast(builder, v, t, types.float32) for v, t in zip(args[5:], sig.args[5:])]
            fty = ir.FunctionType(ir.VoidType(), [ptr.type, _F32, _F32])
            builder.asm(fty, "red.global.add.v2.f32 [$0], {$1, $2};", "l,f,f,~{memory}", [ptr, *vals],
                        side_effect=True)
            return context.get_dummy_value()

        return sig, codegen

    return {"mma_bf16": mma_bf16, "ldmatrix_x4": _ldmatrix(False), "ldmatrix_x4_trans": _ldmatrix(True),
            "cp_async16": cp_async16, "cp_async16_at": cp_async16_at, "cp_async_commit": cp_async_commit, "cp_async_wait": cp_async_wait,
            "cp_async4": cp_async4,
            "pack_bf16x2": pack_bf16x2, "bf16_to_f32": bf16_to_f32, "shfl_xor_f32": shfl_xor_f32,
            "exp2_approx": exp2_approx, "mma_tf32": mma_tf32, "cvt_tf32": _cvt_tf32(True),
            "cvt_tf32_mma": _cvt_tf32(False), "lds4": lds4, "red_add_f32x2": red_add_f32x2}


# ---- simulator twins ---------------------------------------------------------------------------

_EXCHANGE: dict = {}
_EXCHANGE_LOCK = threading.Lock()
_RED_LOCK = threading.Lock()


def _warp_exchange(value):
    """Under the simulator: every lane of the calling warp posts ``value``; returns the 32 posted
    values in lane order and the caller's lane. One block barrier: all threads of the block must
    call it together. Two slot tables alternate, so a lane posting its next value cannot
    overwrite one that a slower lane has yet to read (it passes a barrier first, which waits for
    that lane)."""
    me = threading.current_thread()
    tid = me.thread_id
    turn = getattr(me, "_mma_turn", 0)
    me._mma_turn = turn ^ 1
    key = (tuple(me.blockIdx), tid // mma_layout.WARP, turn)
    with _EXCHANGE_LOCK:
        slots = _EXCHANGE.setdefault(key, [None] * mma_layout.WARP)
    slots[tid % mma_layout.WARP] = value
    me.syncthreads()
    return list(slots), tid % mma_layout.WARP


def _mma_twin(model, reg_type, a, b, c):
    """One lane's mma under the simulator: the warp's operands exchanged, ``model`` (a
    :mod:`.mma_layout` function of the 32 lanes' registers) run, this lane's 4 results."""
    posted, lane = _warp_exchange((a, b, c))
    d = model(np.array([p[0] for p in posted], reg_type), np.array([p[1] for p in posted], reg_type),
              np.array([p[2] for p in posted], np.float32))[lane]
    return np.float32(d[0]), np.float32(d[1]), np.float32(d[2]), np.float32(d[3])


def _make_sim():
    def mma_bf16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        return _mma_twin(mma_layout.mma, np.uint32, (a0, a1, a2, a3), (b0, b1), (c0, c1, c2, c3))

    def _ldmatrix(trans: bool):
        def ld(smem, index):
            posted, lane = _warp_exchange(int(index))
            regs = mma_layout.ldmatrix(np.asarray(smem), np.array(posted), trans)[lane]
            return tuple(np.uint32(r) for r in regs)

        return ld

    def cp_async16(smem, sindex, g, row, col, nbytes):
        # past the end of a row of a view the GPU reads whatever its padded row stride holds:
        # the twin reads NaN there, so that such bytes reaching a sum show (a chunk whose
        # columns run past a "t" operand's rows only feeds outputs outside the matrix)
        size = np.dtype(g.dtype).itemsize
        n = int(nbytes) // size
        for e in range(16 // size):
            if e >= n:
                smem[sindex + e] = 0
            elif col + e < g.shape[1]:
                smem[sindex + e] = g[row, col + e]
            else:
                smem[sindex + e] = np.nan if size == 4 else _BF16_NAN

    def cp_async4(smem, sindex, g, row, col, nbytes):
        smem[sindex] = g[row, col] if int(nbytes) else np.float32(0.0)

    def cp_async16_at(smem, sindex, g, offset, nbytes):
        pitch = g.strides[0] // np.dtype(g.dtype).itemsize if g.shape[0] > 1 else g.shape[1]
        cp_async16(smem, sindex, g, int(offset) // pitch, int(offset) % pitch, nbytes)

    def cp_async_commit():
        pass

    def cp_async_wait(n):
        pass

    def pack_bf16x2(lo, hi):
        bits = mma_layout.bf16_bits(np.array([lo, hi], np.float32))
        return np.uint32(mma_layout.pack(bits[0], bits[1]))

    def bf16_to_f32(bits):
        return mma_layout.bf16_value(np.array([int(bits) & 0xFFFF], np.uint16))[0]

    def shfl_xor_f32(v, mask):
        posted, lane = _warp_exchange(np.float32(v))
        return posted[lane ^ int(mask)]

    def exp2_approx(x):
        with np.errstate(over="ignore"):
            return np.exp2(np.float32(x))

    def mma_tf32(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        return _mma_twin(mma_layout.mma_tf32, np.float32, (a0, a1, a2, a3), (b0, b1), (c0, c1, c2, c3))

    def cvt_tf32(x):
        return mma_layout.tf32_round(np.float32(x))[()]

    def lds4(smem, index):
        i = int(index)
        if i % 4:
            raise AssertionError(f"lds4: element index {i} is not 16-byte aligned")
        return tuple(np.float32(smem[i + e]) for e in range(4))

    def red_add_f32x2(a, i0, i1, i2, i3, v0, v1):
        if int(i3) % 2:
            raise AssertionError(f"red_add_f32x2: column {int(i3)} is not 8-byte aligned")
        with _RED_LOCK:
            a[i0, i1, i2, i3] += np.float32(v0)
            a[i0, i1, i2, i3 + 1] += np.float32(v1)

    return {"mma_bf16": mma_bf16, "ldmatrix_x4": _ldmatrix(False), "ldmatrix_x4_trans": _ldmatrix(True),
            "cp_async16": cp_async16, "cp_async16_at": cp_async16_at, "cp_async_commit": cp_async_commit, "cp_async_wait": cp_async_wait,
            "cp_async4": cp_async4,
            "pack_bf16x2": pack_bf16x2, "bf16_to_f32": bf16_to_f32, "shfl_xor_f32": shfl_xor_f32,
            "exp2_approx": exp2_approx, "mma_tf32": mma_tf32, "cvt_tf32": cvt_tf32,
            "cvt_tf32_mma": cvt_tf32, "lds4": lds4, "red_add_f32x2": red_add_f32x2}


_IMPL = _make_sim() if simulating() else _make_gpu()
mma_bf16 = _IMPL["mma_bf16"]
ldmatrix_x4 = _IMPL["ldmatrix_x4"]
ldmatrix_x4_trans = _IMPL["ldmatrix_x4_trans"]
cp_async16 = _IMPL["cp_async16"]
cp_async16_at = _IMPL["cp_async16_at"]
cp_async4 = _IMPL["cp_async4"]
cp_async_commit = _IMPL["cp_async_commit"]
cp_async_wait = _IMPL["cp_async_wait"]
pack_bf16x2 = _IMPL["pack_bf16x2"]
bf16_to_f32 = _IMPL["bf16_to_f32"]
shfl_xor_f32 = _IMPL["shfl_xor_f32"]
exp2_approx = _IMPL["exp2_approx"]
mma_tf32 = _IMPL["mma_tf32"]
cvt_tf32 = _IMPL["cvt_tf32"]
cvt_tf32_mma = _IMPL["cvt_tf32_mma"]
lds4 = _IMPL["lds4"]
red_add_f32x2 = _IMPL["red_add_f32x2"]

"""Hopper's warpgroup MMA from Numba: ``wgmma.mma_async`` and its fences as inline PTX.

Like :mod:`._mma`, each function is a ``numba.cuda.extending.intrinsic`` whose codegen emits an
llvmlite ``ir.InlineAsm``. They need ``sm_90a`` PTX, which numba-cuda emits for a compute
capability 9.0 device (it compiles for ``compute_90a`` there). The shared-memory operand layouts
and the accumulator fragment are in :mod:`.wgmma_layout` (pure Python, tested on the CPU); the
GPU checks are ``tests/gpu/test_gemm_wgmma_gpu.py``.

- ``shared_addr(smem, i) -> uint32``: the ``.shared`` address of ``smem[i]`` (descriptors and the
  1024-byte alignment of the swizzled tiles are computed from it);
- ``wgmma_zeros(n) -> UniTuple(float32, n)``: ``n`` (a constant) zero accumulators;
- ``wgmma_bf16(d, addr_a, addr_b, hi_a, hi_b, n, trans_a, trans_b) -> d'``:
  ``wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16``, D += A B for one warpgroup (128
  threads), A 64 x 16 and B 16 x n both in shared memory. ``d`` is the tuple of the thread's
  ``n / 2`` fp32 accumulators. ``addr_*`` are 32-bit shared addresses; ``hi_*`` (constants) are
  the descriptors' upper fields (leading and stride byte offsets, swizzle mode:
  :func:`.wgmma_layout.descriptor_hi`), to which the address's bits 4-17 are added.
  ``trans_*`` (constants) select M/N-major (1) or K-major (0) operands;
- ``wgmma_fence()``, ``wgmma_commit()``, ``wgmma_wait(n)``: ``wgmma.fence``,
  ``wgmma.commit_group``, ``wgmma.wait_group n`` (``.sync.aligned``);
- ``wgmma_pin(d) -> d``: an empty volatile asm through which the accumulators pass, so that the
  compiler keeps reads of them after the ``wait`` that completes the MMAs writing them (what
  CUTLASS's ``warpgroup_fence_operand`` does);
- ``fence_proxy_async()``: ``fence.proxy.async.shared::cta``: shared-memory writes made by this
  thread (``cp.async`` included, once waited for) become visible to the async proxy that
  ``wgmma`` reads through; a block barrier after it publishes them to the other threads.

Under the CUDA simulator each has a twin (:func:`_make_sim`): the MMA reads shared memory
through the descriptor model of :mod:`.wgmma_layout`, so the generated kernel runs end to end on
the CPU, at tiny sizes.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types

from ._mma import _item_pointer, _shared_address
from ._util import simulating

_I32 = ir.IntType(32)
_I64 = ir.IntType(64)
_F32 = ir.FloatType()
WGMMA_N = (8, 16, 24, 32, 48, 64, 96, 128, 192, 256)  # the n this module builds (multiples of 8 up to 256)


def _void_asm(builder, text: str) -> None:
    builder.asm(ir.FunctionType(ir.VoidType(), []), text, "~{memory}", [], side_effect=True)


def _literal(x):
    return int(x.literal_value) if isinstance(x, types.IntegerLiteral) else None


def _make():
    from numba.cuda.extending import intrinsic

    @intrinsic
    def shared_addr(typingctx, smem, index):
        if not (isinstance(smem, types.Array) and isinstance(index, types.Integer)):
            return None
        sig = types.uint32(smem, index)

        def codegen(context, builder, sig, args):
            ptr = _item_pointer(context, builder, sig.args[0], args[0], args[1:], sig.args[1:])
            return _shared_address(builder, ptr)

        return sig, codegen

    @intrinsic
    def wgmma_zeros(typingctx, n):
        count = _literal(n)
        if count is None or count <= 0:
            return None
        sig = types.UniTuple(types.float32, count)(n)

        def codegen(context, builder, sig, args):
            zero = ir.Constant(_F32, 0.0)
            return context.make_tuple(builder, sig.return_type, [zero] * count)

        return sig, codegen

    @intrinsic
    def wgmma_bf16(typingctx, d, addr_a, addr_b, hi_a, hi_b, n, trans_a, trans_b):
        lits = [_literal(x) for x in (hi_a, hi_b, n, trans_a, trans_b)]
        if any(v is None for v in lits):
            return None
        ha, hb, nn, ta, tb = lits
        if nn not in WGMMA_N or ta not in (0, 1) or tb not in (0, 1):
            return None
        regs = nn // 2
        if not (isinstance(d, types.UniTuple) and d.count == regs and d.dtype == types.float32):
            return None
        if not (isinstance(addr_a, types.Integer) and isinstance(addr_b, types.Integer)):
            return None
        sig = d(d, addr_a, addr_b, hi_a, hi_b, n, trans_a, trans_b)

        def codegen(context, builder, sig, args):
            def desc(addr, addr_ty, hi):
                a32 = context.cast(builder, addr, addr_ty, types.uint32)
                low = builder.and_(builder.lshr(a32, ir.Constant(_I32, 4)), ir.Constant(_I32, 0x3FFF))
                return builder.or_(builder.zext(low, _I64), ir.Constant(_I64, hi))

            da = desc(args[1], sig.args[1], ha)
            db = desc(args[2], sig.args[2], hb)
            acc = [builder.extract_value(args[0], i) for i in range(regs)]
            outs = ", ".join(f"${i}" for i in range(regs))
            text = ("{\n.reg .pred p;\n"
                    f"setp.ne.b32 p, ${regs + 2}, 0;\n"
                    f"wgmma.mma_async.sync.aligned.m64n{nn}k16.f32.bf16.bf16 {{{outs}}}, ${regs}, ${regs + 1}, "
                    f"p, 1, 1, {ta}, {tb};\n}}")
            cons = ",".join(["=f"] * regs + ["l", "l", "r"] + [str(i) for i in range(regs)]) + ",~{memory}"
            fty = ir.FunctionType(ir.LiteralStructType([_F32] * regs), [_I64, _I64, _I32] + [_F32] * regs)
            out = builder.asm(fty, text, cons, [da, db, ir.Constant(_I32, 1)] + acc, side_effect=True)
            return context.make_tuple(builder, sig.return_type, [builder.extract_value(out, i) for i in range(regs)])

        return sig, codegen

    @intrinsic
    def wgmma_pin(typingctx, d):
        if not (isinstance(d, types.UniTuple) and d.dtype == types.float32):
            return None
        regs = d.count
        sig = d(d)

        def codegen(context, builder, sig, args):
            acc = [builder.extract_value(args[0], i) for i in range(regs)]
            cons = ",".join(["=f"] * regs + [str(i) for i in range(regs)]) + ",~{memory}"
            fty = ir.FunctionType(ir.LiteralStructType([_F32] * regs), [_F32] * regs)
            out = builder.asm(fty, "", cons, acc, side_effect=True)
            return context.make_tuple(builder, sig.return_type, [builder.extract_value(out, i) for i in range(regs)])

        return sig, codegen

    def _fixed(name: str, text: str):
        def typer(typingctx):
            def codegen(context, builder, sig, args):
                _void_asm(builder, text)
                return context.get_dummy_value()

            return types.void(), codegen

        typer.__name__ = name
        return intrinsic(typer)

    @intrinsic
    def wgmma_wait(typingctx, n):
        pending = _literal(n)
        if pending is None or not 0 <= pending <= 7:
            return None

        def codegen(context, builder, sig, args):
            _void_asm(builder, f"wgmma.wait_group.sync.aligned {pending};")
            return context.get_dummy_value()

        return types.void(n), codegen

    return {"shared_addr": shared_addr, "wgmma_zeros": wgmma_zeros, "wgmma_bf16": wgmma_bf16,
            "wgmma_pin": wgmma_pin, "wgmma_wait": wgmma_wait,
            "wgmma_fence": _fixed("wgmma_fence", "wgmma.fence.sync.aligned;"),
            "wgmma_commit": _fixed("wgmma_commit", "wgmma.commit_group.sync.aligned;"),
            "fence_proxy_async": _fixed("fence_proxy_async", "fence.proxy.async.shared::cta;")}


SIM_BASE = 0x4010  # the shared address a simulated block's array starts at: 16-byte aligned, not 1024


def _make_sim():
    """Simulator twins: ``wgmma_bf16`` reads its operands from the block's shared array through
    :func:`.wgmma_layout.reads` (the descriptor model the CPU layout tests check) at the address
    it is given, and returns the calling thread's fragment of D += A B by
    :func:`.wgmma_layout.accumulator_owner`; the fences and waits do nothing (a twin's MMA is
    complete when it returns). So the simulator runs the generated kernel's fetch, stage
    rotation, addresses and epilogue; what it cannot check is the hardware's own reading of a
    descriptor, and the asynchrony."""
    import functools
    import threading

    import numpy as np

    from . import mma_layout
    from . import wgmma_layout as WL

    arrays: dict = {}  # block -> its shared array (one per block: the kernel names one)
    lock = threading.Lock()

    def shared_addr(smem, index):
        me = threading.current_thread()
        with lock:
            arrays[tuple(me.blockIdx)] = smem
        return SIM_BASE + 2 * int(index)  # a Python int: the kernel's arithmetic on it is int64 on the GPU too

    def wgmma_zeros(n):
        return (np.float32(0.0),) * int(n)

    @functools.lru_cache(maxsize=4096)
    def _indices(desc, rows, mn_major):
        return (WL.reads(desc, rows, mn_major) - SIM_BASE) // 2

    _owner = functools.lru_cache(maxsize=None)(WL.accumulator_owner)

    def _operand(smem, addr, hi, rows, mn_major):
        idx = _indices(int(hi) | ((int(addr) >> 4) & 0x3FFF), rows, bool(mn_major))
        return mma_layout.bf16_value(np.asarray(smem)[idx]).astype(np.float64)  # (rows, 16)

    def wgmma_bf16(d, addr_a, addr_b, hi_a, hi_b, n, trans_a, trans_b):
        me = threading.current_thread()
        smem = arrays[tuple(me.blockIdx)]
        a = _operand(smem, addr_a, hi_a, 64, trans_a)  # (64, 16)
        b = _operand(smem, addr_b, hi_b, int(n), trans_b)  # (n, 16)
        prod = a @ b.T  # (64, n)
        own = _owner(int(n))[me.thread_id % WL.WARPGROUP]
        return tuple(np.float32(np.float64(x) + prod[r, c]) for x, (r, c) in zip(d, own))

    def nothing(*args):
        pass

    return {"shared_addr": shared_addr, "wgmma_zeros": wgmma_zeros, "wgmma_bf16": wgmma_bf16,
            "wgmma_pin": lambda d: d, "wgmma_wait": nothing, "wgmma_fence": nothing, "wgmma_commit": nothing,
            "fence_proxy_async": nothing}


_IMPL = _make_sim() if simulating() else _make()
shared_addr = _IMPL["shared_addr"]
wgmma_zeros = _IMPL["wgmma_zeros"]
wgmma_bf16 = _IMPL["wgmma_bf16"]
wgmma_pin = _IMPL["wgmma_pin"]
wgmma_wait = _IMPL["wgmma_wait"]
wgmma_fence = _IMPL["wgmma_fence"]
wgmma_commit = _IMPL["wgmma_commit"]
fence_proxy_async = _IMPL["fence_proxy_async"]

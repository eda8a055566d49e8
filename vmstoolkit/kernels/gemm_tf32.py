"""float32 GEMMs of ``nn.Linear`` and its backward on the tensor cores (``mma.sync`` m16n8k8 with tf32
operands, fp32 accumulate), in the three layouts of :mod:`.gemm` and :mod:`.gemm_bf16`:

- ``gemm_tf32``: ``y = [acc +] x @ w.T``: x (M, K), w (N, K), y (M, N) ("nn");
- ``linear_dx_tf32``: ``dx = [acc +] dy @ w``: dy (M, N), w (N, K), dx (M, K) ("nt");
- ``linear_dw_tf32``: ``dw = [acc +] dy.T @ x``: dy (M, N), x (M, K), dw (N, K) ("tt").

Every array is float32. ``precision``:

- ``"tf32"``: each operand rounded to tf32 (``cvt.rna.tf32.f32``: 10 mantissa bits, nearest, ties
  away) and one mma per product: relative error per product up to 2^-10, like cuBLAS's TF32
  (``torch.backends.cuda.matmul.allow_tf32 = True``) at 3 products per 2 of the bf16 GEMM's
  time (half the tensor-core rate of bf16, twice the bytes);
- ``"3xtf32"``: each operand split as big = tf32(x), small = tf32(x - big) (x = big + small to
  about 2^-22) and ``D += a_big b_small + a_small b_big + a_big b_big``, the small terms first:
  only a_small b_small (about 2^-22 of a product) is dropped, so the result is about as accurate
  as an fp32 GEMM's (CUTLASS's "3xTF32"; cuBLAS's fp32 GEMM with TF32 off runs the CUDA cores),
  at three mmas and three conversions a product.

The kernel is :func:`.gemm_bf16.pipeline_source`'s (the same cp.async pipeline, stage rotation,
split k, epilogue and launch rule, :func:`.gemm_bf16.choose`) with this module's operand format
(:data:`TF32`): float32 shared tiles of 16-byte chunks of 4 elements, and its own fragment loads.

Note [tf32 GEMM tile]
---------------------
"tf32": a block of 4 warps (2 x 2) computes a 128 x 128 tile, each warp 64 x 64 (128 fp32
accumulators a lane), as the bf16 GEMM does; k slices are BK = 16 deep (two m16n8k8 steps) in
STAGES = 3 cp.async buffers: 3 x (128 + 128) x 16 x 4 bytes = 48 KiB, the static limit, the same
bytes and the same mma count per slice (64 a warp) as the bf16 tile's BK = 32, so the same
barrier cost per mma. Per slice and warp: 64 mma, 64 cvt (FSETP + IADD each in SASS) and 16
LDS.128 ("n" operands) or 128 LDS.32 ("t" operands).

"3xtf32" triples the mmas and adds an FADD and a second cvt per value: on 64 x 64 warp tiles
the split operands no longer fit beside the 128 accumulators (255 registers, 212-388 bytes of
spill), so its default is 8 warps of 64 x 32 on the same 128 x 128 x 16 block tile (180-181
registers, no spill: one block of 8 warps per SM, as many warps as tf32's two blocks of 4).

Offline (sm_90, ptxas 13.0, ``python scripts/sass_report.py gemm-tf32 --layout nn tt --tiles
128x128x16/w64x64/s3 128x128x16/w64x32/s3``; instructions of the k loop per HMMA, static):

    tf32   w64x64 nn  240 regs, no spill,         48 KiB smem,  576 instr / 64 HMMA (9.0)
    tf32   w64x64 tt  255 regs, 4 B spill,        48 KiB smem,  845 instr / 64 HMMA (13.2)
    3xtf32 w64x64 nn  255 regs, 388/212 B spill,  48 KiB smem,  927 instr / 192 HMMA (4.8)
    3xtf32 w64x32 nn  180 regs, no spill,         48 KiB smem,  573 instr / 96 HMMA (6.0)
    3xtf32 w64x32 tt  181 regs, no spill,         48 KiB smem,  883 instr / 96 HMMA (9.2)

A tf32 HMMA.1688 takes a sub-partition 8 cycles at the dense rate (half bf16's 16-k HMMA's
work in the same time), so up to about 8 other instructions per HMMA issue for free: "3xtf32"
nn is within that, "tf32" and the "t" layouts (one LDS.32 per value, and the register moves that
build the HMMA's operand quads) above it, i.e. issue-bound.

Fragment loads. ``ldmatrix`` moves b16 elements: on 32-bit data its non-transposed form would
give an "n" tile's m16n8k8 A fragment (lane (g, t) gets word t of row g), but its ``.trans``
would split words, so a "t" tile cannot use it. Plain shared loads serve both, and a permutation
of k makes the "n" ones 16 bytes wide: the k sum does not care which mma k slot holds which k,
so within a k16 block lane (g, t) takes k = 4t .. 4t+3, in the order (step 0: slot t, slot
t+4; step 1: slot t, slot t+4), the same for A and B. An "n" row's four values for both steps
are then one ``ld.shared.v4.f32`` (:func:`._mma.lds4`): per k16 a warp tile of 64 x 64 loads 8
of them for A and 8 for B (the bf16 tile's 16 ldmatrix.x4 per k32 move the same bytes); a "t"
tile's values (k rows, m contiguous) are one LDS.32 each. Swizzles (by 16-byte chunk, so that
cp.async can write them): "n" rows of 4 chunks (BK 16) are conflict-free as they are (the 8
lanes of an LDS.128 phase read rows r, r + 1: banks 0-15 and 16-31); rows of 8 (BK 32) swap
chunk c with c ^ ((row & 1) << 2). "t" tiles swap chunk c of k row k with c ^ (((k >> 2) & 3)
<< 1): an LDS.32 of a warp reads 8 consecutive m (2 chunks) of the 4 k rows 4t + e, which this
spreads over the 32 banks.

Expected rate (H200, dense; not measured yet): tf32 mma.sync peaks at half the bf16 rate, so
at the bf16 tile's 36-51% of cuBLAS bf16 (240-420 TFLOP/s) "tf32" would run at 120-210 TFLOP/s,
less where it is issue-bound, and "3xtf32" at a third of that (40-70), against cuBLAS's fp32
GEMM (CUDA cores, about 50 TFLOP/s at these shapes) and cuBLAS TF32 (wgmma, 300-400):
``experiments/gemm_sweep.py --dtype tf32`` measures it.

Note [3xtf32 small products]
----------------------------
The tensor core's fp32 accumulation is not an IEEE add: the addends are aligned to the largest
and the bits below are cut, so a product about 2^-11 of the running sum (a big x small term)
loses most of its bits when it is added into that sum. Accumulating all three products into one
accumulator gave 3xtf32 an error that grows with K, about 10x cuBLAS's fp32 GEMM at K = 4096
(3.3e-5 against 3.6e-6, H100, the sweep above; 1.6e-5 with split k halving K per block): an
fp32 path no more accurate than that is no fp32 path.

A first fix put the two small products into a zero accumulator and added that by FADD, the big
product still going into the running sum (the fix Triton's 3xTF32 took for the same loss,
triton-lang/triton#4603). On the GPU it cut the error about 6.5x but not enough: 5.0e-6 against
cuBLAS fp32's 3.4e-7 at K = 2048 a block (split 2, H100, 2026-12-07, the GPU test below), four
times over its bound. The big products lose bits too: every m16n8k8 step adds eight of them into
a running sum far larger than they are, and the cut is one-signed (towards zero), so it adds up
linearly with K instead of as a random walk.

So now all three products of a step go into the zero accumulator (the small ones first, then
the big one), and that step's sum, about eight products, is added to the running sum by four
FADDs, rounded to nearest like the CUDA cores' FMA chain. The cut is then taken against a sum of
eight products, not of all K so far, and the rounding that grows with K is the FADD's, unbiased.
This is CUTLASS's "promotion" of an FP8 accumulator into a fp32 one, at every step. Cost: the
same as the first fix (four FADDs and four registers a tile and step beside three HMMA). It
passed the GPU test that the first fix failed (``tests/gpu/test_gemm_tf32_gpu.py::
test_split_k_and_acc``, K = 4096 in 1, 2 and 4 splits, within 4x cuBLAS fp32's error plus 2e-6;
H100, 2026-12-07, ``kernels-h200/run13-h100``). Its rate is not measured yet; the first fix's
FADDs cost 1-4 points (88-91% of cuBLAS fp32, ``run12-h100``), and this one issues as many. The
simulator's mma rounds exactly, so only the GPU can show any of this.

Under the simulator the kernel runs the intrinsics' twins (:mod:`._mma`) on one-warp 16 x 16
tiles; ``mma_tf32``'s twin reads its operands as tf32 by truncation, as the tensor core does.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache, partial
from typing import ClassVar

import numpy as np

from vmstoolkit.errors import KernelError

from . import mma_layout
from ._util import check_float32
from ._vector import aligned16
from .gemm import LAYOUTS
from .gemm_bf16 import (MmaLaunch, MmaTiles, OperandFormat, _check, _launch, choose, compile_kernel,
                        pipeline_source, store_name)

PRECISIONS = ("tf32", "3xtf32")


@dataclass(frozen=True)
class Tf32Tiles(MmaTiles):
    """:class:`.gemm_bf16.MmaTiles` of float32 operands (4 bytes, chunks of 4), k slices 16 or 32 deep."""

    ELEM_BYTES: ClassVar[int] = 4
    BKS: ClassVar[tuple[int, ...]] = (16, 32)

    bk: int = 16


GPU_TILES = Tf32Tiles()  # "tf32"
GPU_TILES_3X = Tf32Tiles(wn=32)  # "3xtf32": 8 warps of 64 x 32 (64 x 64 spills: Note [tf32 GEMM tile])
SIM_TILES = Tf32Tiles(bm=16, bn=16, wm=16, wn=16, stages=3)


def _swizzle_n(rows: str, chunk: str, bk: int) -> str:
    """Element offset in an "n" tile (rows x bk) of chunk ``chunk`` of row ``rows``: rows of 4
    chunks as they are, rows of 8 swap chunk c with c ^ ((row & 1) << 2)."""
    if bk == 16:
        return f"(({rows}) * 16 + (({chunk}) << 2))"
    return f"(({rows}) * {bk} + ((({chunk}) ^ ((({rows}) & 1) << 2)) << 2))"


def _t_mask(width: int) -> int:
    """Bits of a "t" tile's chunk index that its swizzle flips: 1 and 2, those the row has."""
    return (width // 4 - 1) & 6


def _swizzle_t(k: str, chunk: str, width: int) -> str:
    """Element offset in a "t" tile (BK x width) of chunk ``chunk`` of k row ``k``."""
    return f"(({k}) * {width} + ((({chunk}) ^ (((({k}) >> 2) & 3) << 1) & {_t_mask(width)}) << 2))"


def _lane_lines(t: MmaTiles, a_trans: bool, b_trans: bool) -> list[str]:
    """Per-lane offsets inside a stage of the first k16 block: an "n" operand's row (g of the warp's
    first tile) at chunk tq; a "t" operand's k row 4 tq at column g, with the XOR mask (``za``,
    ``zb``) that the "t" swizzle applies to each tile's column offset."""
    src = []
    for op, trans, width, base, along in (("a", a_trans, t.bm, f"wy * {t.wm}", "ma"),
                                          ("b", b_trans, t.bn, f"wx * {t.wn}", "na")):
        if trans:
            src += [f"    l{op} = 4 * tq * {width} + g", f"    z{op} = (tq << 3) & {_t_mask(width) << 2}",
                    f"    {along} = {base}"]
        else:
            src.append(f"    l{op} = " + _swizzle_n(f"{base} + g", "tq", t.bk))
    return src


def _slice_lines(t: MmaTiles, a_trans: bool, b_trans: bool, precision: str) -> list[str]:
    """One staged slice: per k16 block, each lane's 4 k values (k = 4 tq .. 4 tq + 3 of the block)
    of its A rows (g, g + 8 of each m16 tile: ``ua{i}_{h}_{e}``) and B columns (g of each n8
    tile: ``ub{j}_{e}``), then two m16n8k8 steps: step s takes e = 2s (mma slot t) and 2s + 1
    (slot t + 4)."""
    MT, NT, BK = t.wm // 16, t.wn // 8, t.bk
    src = []
    for kb in range(BK // 16):
        def at(base: str, off: str) -> str:  # an "n" row's chunk of k16 block kb
            return f"{base} + {off}" if kb == 0 else f"({base} + {off}) ^ 16"

        for i in range(MT):
            for h in range(2):
                if a_trans:
                    for e in range(4):
                        src.append(f"        ua{i}_{h}_{e} = Sm[sa + la + {(16 * kb + e) * t.bm} + "
                                   f"((ma + {16 * i + 8 * h}) ^ za)]")
                else:
                    src.append(f"        ua{i}_{h}_0, ua{i}_{h}_1, ua{i}_{h}_2, ua{i}_{h}_3 = "
                               f"lds4(Sm, {at('sa', f'la + {(16 * i + 8 * h) * BK}')})")
        for j in range(NT):
            if b_trans:
                for e in range(4):
                    src.append(f"        ub{j}_{e} = Sm[sb + lb + {(16 * kb + e) * t.bn} + ((na + {8 * j}) ^ zb)]")
            else:
                src.append(f"        ub{j}_0, ub{j}_1, ub{j}_2, ub{j}_3 = lds4(Sm, {at('sb', f'lb + {8 * j * BK}')})")
        for s in range(2):
            regs_a = [(0, 2 * s), (1, 2 * s), (0, 2 * s + 1), (1, 2 * s + 1)]  # a0..a3: (row half, e)
            for i in range(MT):
                for r, (h, e) in enumerate(regs_a):
                    src += _split(f"a{i}_{r}", f"ua{i}_{h}_{e}", precision)
            for j in range(NT):
                for r in range(2):
                    src += _split(f"b{j}_{r}", f"ub{j}_{2 * s + r}", precision)
            for i in range(MT):
                for j in range(NT):
                    cs = ", ".join(f"c{i}_{j}_{r}" for r in range(4))
                    big = ", ".join(f"aB{i}_{r}" for r in range(4))
                    if precision == "3xtf32":  # Note [3xtf32 small products]
                        small = ", ".join(f"aS{i}_{r}" for r in range(4))
                        src.append(f"        s0, s1, s2, s3 = mma_tf32({big}, bS{j}_0, bS{j}_1, "
                                   "float32(0.0), float32(0.0), float32(0.0), float32(0.0))")
                        src.append(f"        s0, s1, s2, s3 = mma_tf32({small}, bB{j}_0, bB{j}_1, s0, s1, s2, s3)")
                    if precision == "3xtf32":
                        src.append(f"        s0, s1, s2, s3 = mma_tf32({big}, bB{j}_0, bB{j}_1, s0, s1, s2, s3)")
                        src += [f"        c{i}_{j}_{r} += s{r}" for r in range(4)]
                    else:
                        src.append(f"        {cs} = mma_tf32({big}, bB{j}_0, bB{j}_1, {cs})")
    return src


def _split(name: str, value: str, precision: str) -> list[str]:
    """``{x}B{n}`` = tf32(value) (the big part; ``name`` = "a0_1" -> "aB0_1"), and with 3xtf32
    ``{x}S{n}`` = tf32(value - big): the big part an exact tf32 there (``cvt_tf32``), the parts
    that only feed an mma left with the cvt's low bits (``cvt_tf32_mma``)."""
    big, small = f"{name[0]}B{name[1:]}", f"{name[0]}S{name[1:]}"
    if precision == "tf32":
        return [f"        {big} = cvt_tf32_mma({value})"]
    return [f"        {big} = cvt_tf32({value})", f"        {small} = cvt_tf32_mma({value} - {big})"]


def _format(precision: str) -> OperandFormat:
    return OperandFormat("float32", _swizzle_n, _swizzle_t, _lane_lines,
                         partial(_slice_lines, precision=precision))


def _precision(precision) -> str:
    if precision not in PRECISIONS:
        raise KernelError(f"precision must be one of {', '.join(map(repr, PRECISIONS))}, got {precision!r}")
    return precision


def kernel_source(t: MmaTiles = GPU_TILES, layout: str = "nn", precision: str = "tf32", accumulate: bool = False,
                  atomic: bool = False, cp_async: bool = True) -> str:
    """The generated source of one build (for reading and for ``scripts/sass_report.py``)."""
    a_trans, b_trans = LAYOUTS[layout]
    return pipeline_source(t, _format(_precision(precision)), a_trans, b_trans,
                           store_name(False, accumulate, atomic), cp_async)


@lru_cache(maxsize=None)
def make_gemm_tf32(t: Tf32Tiles, a_trans: bool, b_trans: bool, precision: str = "tf32", accumulate: bool = False,
                   atomic: bool = False, cp_async: bool = True):
    """The kernel ``kernel(a, b, acc, c, per)``: ``c = [acc +] A @ B`` of float32 arrays for the
    layouts above, ``per`` k slices per block along grid z (``atomic``: added into c).
    ``cp_async``: 16-byte global fetches (operands must pass :func:`._vector.aligned16`)."""
    if not isinstance(t, Tf32Tiles):
        raise KernelError(f"tiles {t}: the tf32 GEMM takes Tf32Tiles (float32 operands in shared memory)")
    t.check()
    layout = f"{'t' if a_trans else 'n'}{'t' if b_trans else 'n'}"
    source = kernel_source(t, layout, precision, accumulate, atomic, cp_async)
    return compile_kernel(source, f"<gemm_tf32 {precision} {t.label()} {layout}>",
                          ("mma_tf32", "cvt_tf32", "cvt_tf32_mma", "lds4", "cp_async16_at", "cp_async_commit", "cp_async_wait"),
                          elem_bytes=4)


def choose_tf32(m: int, n: int, k: int, splits: int | None = None, out_bf16: bool = False,
                sms: int | None = None, precision: str = "tf32") -> MmaLaunch:
    """:func:`.gemm_bf16.choose`'s rule (split k) on this module's tiles for ``precision``."""
    gpu = GPU_TILES_3X if _precision(precision) == "3xtf32" else GPU_TILES
    return choose(m, n, k, splits, False, sms, gpu=gpu, sim=SIM_TILES)


def _run(op: str, layout: str, names, a, b, out, acc, shapes, k: int, stream, precision, tiles, splits) -> None:
    precision = _precision(precision)
    _check(op, names, (a, b, out, acc), shapes, operand=check_float32, output=check_float32)

    def build(t, a_trans, b_trans, out_bf16, accumulate, atomic, async_):
        return make_gemm_tf32(t, a_trans, b_trans, precision, accumulate, atomic, async_)

    _launch(layout, a, b, acc, out, k, stream, tiles, splits, build=build, aligned=aligned16,
            choose_fn=partial(choose_tf32, precision=precision))


def gemm_tf32(x, w, y, stream=0, acc=None, precision: str = "tf32", tiles: Tf32Tiles | None = None,
              splits: int | None = None):
    """Enqueue ``y = [acc +] x @ w.T``: x (M, K), w (N, K), y (M, N), all float32."""
    m, k = x.shape
    n = w.shape[0]
    _run("gemm_tf32", "nn", ("x", "w", "y", "acc"), x, w, y, acc, ((m, k), (n, k), (m, n), (m, n)), k,
         stream, precision, tiles, splits)


def linear_dx_tf32(dy, w, dx, stream=0, acc=None, precision: str = "tf32", tiles: Tf32Tiles | None = None,
                   splits: int | None = None):
    """Enqueue ``dx = [acc +] dy @ w``: dy (M, N), w (N, K), dx (M, K), all float32."""
    m, n = dy.shape
    k = w.shape[1]
    _run("linear_dx_tf32", "nt", ("dy", "w", "dx", "acc"), dy, w, dx, acc, ((m, n), (n, k), (m, k), (m, k)), n,
         stream, precision, tiles, splits)


def linear_dw_tf32(dy, x, dw, stream=0, acc=None, precision: str = "tf32", tiles: Tf32Tiles | None = None,
                   splits: int | None = None):
    """Enqueue ``dw = [acc +] dy.T @ x``: dy (M, N), x (M, K), dw (N, K), all float32."""
    m, n = dy.shape
    k = x.shape[1]
    _run("linear_dw_tf32", "tt", ("dy", "x", "dw", "acc"), dy, x, dw, acc, ((m, n), (m, k), (n, k), (n, k)), m,
         stream, precision, tiles, splits)


def split_tf32(x) -> tuple[np.ndarray, np.ndarray]:
    """(big, small) = (tf32(x), tf32(x - big)) as float32, the 3xTF32 split."""
    x = np.asarray(x, np.float32)
    big = mma_layout.tf32_round(x)
    return big, mma_layout.tf32_round(x - big)


def reference(layout: str, a, b, acc=None, precision: str = "tf32") -> np.ndarray:
    """numpy float64 ``[acc +] A @ B`` of float32 operands in ``layout`` (stored as the launchers
    take them) with the kernel's roundings: "tf32": tf32(A) tf32(B); "3xtf32": the three products
    of the split operands; "fp32": the exact product."""
    a_trans, b_trans = LAYOUTS[layout]
    a = np.asarray(a, np.float32)
    b = np.asarray(b, np.float32)
    a, b = (a.T if a_trans else a), (b if b_trans else b.T)

    def mul(p, q):
        return p.astype(np.float64) @ q.astype(np.float64)

    if precision == "fp32":
        out = mul(a, b)
    elif precision == "tf32":
        out = mul(mma_layout.tf32_round(a), mma_layout.tf32_round(b))
    elif precision == "3xtf32":
        (ab, as_), (bb, bs) = split_tf32(a), split_tf32(b)
        out = mul(ab, bs) + mul(as_, bb) + mul(ab, bb)
    else:
        raise KernelError(f"reference: precision must be 'tf32', '3xtf32' or 'fp32', got {precision!r}")
    return out if acc is None else out + acc

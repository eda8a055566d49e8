"""bf16 GEMMs of ``nn.Linear`` and its backward on the tensor cores (``mma.sync`` m16n8k16, fp32
accumulate), in the three layouts of :mod:`.gemm`:

- ``gemm_bf16``: ``y = x @ w.T``: x (M, K), w (N, K), y (M, N) ("nn");
- ``linear_dx_bf16``: ``dx = dy @ w`` (+ ``acc``): dy (M, N), w (N, K), dx (M, K) ("nt");
- ``linear_dw_bf16``: ``dw = dy.T @ x`` (+ ``acc``): dy (M, N), x (M, K), dw (N, K) ("tt").

bf16 arrays are uint16 (or int16: a torch bf16 tensor ``.view(torch.int16)``) holding bf16 bits.
The output is float32, or bf16 (uint16/int16, rounded to nearest even once, from the fp32 sums);
``acc`` (float32) needs a float32 output.

One kernel computes ``C (R, C) = [acc +] A @ B`` with A stored (R, K) ("n") or (K, R) ("t") and
B (C, K) ("n") or (K, C) ("t"). mma's A is row major and its B "col" (k contiguous): an "n"
operand's fragments come from ``ldmatrix.x4``, a "t" operand's from ``ldmatrix.x4.trans``; that is
the only difference between the layouts besides the global fetch.

Note [bf16 GEMM tile]
---------------------
A block of 4 warps (2 x 2) computes a 128 x 128 tile, each warp 64 x 64: per k step of 16 a warp
issues 4 ldmatrix.x4 for A (four m16 tiles), 4 for B (eight n8 tiles) and 32 mma, and holds 128
fp32 accumulators per lane. k slices of BK = 32 are staged in shared memory by ``cp.async`` (16
bytes per instruction, bypassing registers and L1) in STAGES = 3 buffers: slices s+1 and s+2 are
in flight while slice s is multiplied, one barrier per slice. 3 x (128 + 128) x 32 bf16 = 48 KiB,
the static shared-memory limit. Shared tiles are XOR-swizzled by 16-byte chunk so that the 8
rows one ldmatrix phase reads, and the cp.async writes, hit 8 distinct chunks of the 128-byte
bank window: "n" tiles (rows x 32 k: 4 chunks a row) swap chunk c with c ^ ((row >> 1) & 3),
"t" tiles (32 k x rows) chunk c with c ^ (k & 7).

H200 (``experiments/results/gemm-bf16-h200/``, held timing against cuBLAS bf16 at the 7B block's 15
shapes): this tile 35.8-50.6% of cuBLAS (240-420 TFLOP/s against cuBLAS's wgmma at 640-830); 4 stages
(64 KiB, dynamic) +0 to +1.9 points at 13 shapes, bk 64 lower at 14, 8 warps of 64 x 32 30-37%, 2
stages 30-43%, 128 x 256 (8 warps) 22-43%. Offline, sm_90: 236-241 registers (two blocks per SM), no
spill, 237 instructions per 64 HMMA in the main loop. The issue's 70% is not reached on mma.sync;
Hopper's wgmma (asynchronous warpgroup MMA from shared-memory descriptors) is what cuBLAS runs.

Global fetches by ``cp.async`` need 16-byte-aligned operands: base address a multiple of 16
bytes, unit column stride, row stride a multiple of 8 elements (:func:`aligned_b16`). Other
operands (a ragged row length, a view starting mid-row) take the same kernel with element-wise
loads into the same shared layout (``cp_async=False``). Partial tiles are zero-filled (cp.async
with 0 source bytes, or fewer than 16 for a chunk that K ends inside), so the mma loop has no
bounds checks; the epilogue checks each output.

Split k (fp32 output only): ``splits`` blocks share an output tile's k slices and add their
partial tiles atomically into C, zeroed (or set to ``acc``) first; the launch rule is
:func:`choose`.

Under the simulator the kernel runs the intrinsics' twins (:mod:`._mma`) on one-warp 16 x 16 tiles.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, ClassVar

import numpy as np
from numba import cuda, float32, uint16

from vmstoolkit.errors import KernelError

from . import _cuda_cache, _mma, gemm_wgmma as GW, mma_layout
from ._launch import fast as fast_launch
from ._util import check_ndim, generated_function, simulating, sm_count
from .gemm import LAYOUTS, copy_fill, zero_fill
from .gemm_staging import (CHUNK, CHUNK_BYTES, aligned_b16, chunk_bytes, fetch_lines, fetch_setup, row_bytes, store_acc,
                           store_add, store_bf16, store_f32, swizzle_n, swizzle_t)

# CHUNK, aligned_b16 and chunk_bytes live in gemm_staging; callers (flash_bf16, the tests) import them from here
__all__ = ["CHUNK", "GPU_TILES", "MmaTiles", "aligned_b16", "choose", "chunk_bytes", "gemm_bf16", "linear_dw_bf16",
           "linear_dx_bf16", "reference"]

BK = 32  # the default k depth of a staged slice (two mma k steps)
STATIC_SMEM = 48 * 1024  # a kernel's static shared memory at most
MAX_SMEM = 227 * 1024  # the H200's (sm_90) dynamic shared memory per block at most


@dataclass(frozen=True)
class MmaTiles:
    """``bm x bn`` outputs per block, ``wm x wn`` per warp, ``stages`` shared k slices in flight."""

    ELEM_BYTES: ClassVar[int] = 2  # bytes of an operand element (bf16)
    BKS: ClassVar[tuple[int, ...]] = (32, 64)  # the slice depths the kernel's swizzles take

    bm: int = 128
    bn: int = 128
    wm: int = 64
    wn: int = 64
    stages: int = 3
    bk: int = 32  # k depth of a staged slice: 32 or 64

    @property
    def chunk(self) -> int:
        """Operand elements per 16-byte chunk (one cp.async)."""
        return 16 // self.ELEM_BYTES

    @property
    def smem_bytes(self) -> int:
        return self.stages * (self.bm + self.bn) * self.bk * self.ELEM_BYTES

    @property
    def dynamic(self) -> bool:
        """Over the 48 KiB of static shared memory: dynamic, with the kernel's limit raised."""
        return self.smem_bytes > STATIC_SMEM

    @property
    def warps(self) -> int:
        return (self.bm // self.wm) * (self.bn // self.wn)

    @property
    def threads(self) -> int:
        return 32 * self.warps

    def label(self) -> str:
        return f"{self.bm}x{self.bn}x{self.bk}/w{self.wm}x{self.wn}/s{self.stages}"

    def check(self) -> None:
        if self.bm % self.wm or self.bn % self.wn or self.wm % 16 or self.wn % 16:
            raise KernelError(f"tiles {self}: warp tiles must divide the block tile and be multiples of 16")
        if self.bk not in self.BKS:
            raise KernelError(f"tiles {self}: bk must be {' or '.join(map(str, self.BKS))}")
        c = self.chunk
        if self.bm % c or self.bn % c or (self.bm * self.bk // c) % self.threads \
                or (self.bn * self.bk // c) % self.threads:
            raise KernelError(f"tiles {self}: each thread must fetch whole 16-byte chunks of both operands")
        if self.stages < 2:
            raise KernelError(f"tiles {self}: stages must be at least 2")
        if self.smem_bytes > MAX_SMEM:
            raise KernelError(f"tiles {self}: {self.smem_bytes} bytes of shared memory (limit {MAX_SMEM})")


GPU_TILES = MmaTiles()
SIM_TILES = MmaTiles(bm=16, bn=16, wm=16, wn=16, stages=3)


@dataclass(frozen=True)
class OperandFormat:
    """What differs between the tensor-core GEMMs that share :func:`pipeline_source`'s cp.async
    pipeline, k loop and epilogue: the shared array's element type, the swizzles of "n" tiles
    (``swizzle_n(row, chunk, bk)``) and "t" tiles (``swizzle_t(k, chunk, width)``: element offset of
    a 16-byte chunk, as source text), the source lines of the per-lane fragment offsets before the
    k loop (``lane_lines(t, a_trans, b_trans)``, indented) and of one staged slice's fragment loads
    and mmas (``slice_lines(t, a_trans, b_trans)``: stage ``sa`` of A and ``sb`` of B, into the
    accumulators ``c{i}_{j}_{r}`` of m16 tile i and n8 tile j)."""

    dtype: str
    swizzle_n: Callable[[str, str, int], str]
    swizzle_t: Callable[[str, str, int], str]
    lane_lines: Callable[[MmaTiles, bool, bool], list]
    slice_lines: Callable[[MmaTiles, bool, bool], list]


def _bf16_lane_lines(t: MmaTiles, a_trans: bool, b_trans: bool) -> list[str]:
    MT, NT = t.wm // 16, t.wn // 8  # m16 tiles and n8 tiles per warp
    BK = t.bk
    src = []
    # per-lane ldmatrix offsets inside a stage at k step 0, per A tile and B tile pair; at k step
    # kk an "n" tile's offset is that one with chunk bits XORed with kk / 8 (the stage and row
    # parts of an offset have no bits there), a "t" tile's is kk rows further
    for i in range(MT):
        if a_trans:  # ldmatrix.trans of the (K, rows) tile: k = l%8 + (j//2)*8, m chunk + j%2
            src.append(f"    oa_{i} = " + swizzle_t("(lane & 7) + ((lane >> 4) << 3)",
                                                  f"((wy * {t.wm} + {i * 16}) >> 3) + ((lane >> 3) & 1)", t.bm))
        else:  # rows wy*wm + 16i + l%16, chunk l/16
            src.append(f"    oa_{i} = " + swizzle_n(f"wy * {t.wm} + {i * 16} + (lane & 15)", "(lane >> 4)", BK))
    for p in range(NT // 2):
        if b_trans:  # (K, cols) tile: k = l%8 + ((l//8)%2)*8, n chunk + l//16
            src.append(f"    ob_{p} = " + swizzle_t("(lane & 7) + (((lane >> 3) & 1) << 3)",
                                                  f"((wx * {t.wn} + {p * 16}) >> 3) + (lane >> 4)", t.bn))
        else:  # rows (n) wx*wn + 16p + l%8 + (l//16)*8, chunk (l//8)%2
            src.append(f"    ob_{p} = " + swizzle_n(f"wx * {t.wn} + {p * 16} + (lane & 7) + ((lane >> 4) << 3)",
                                                  "((lane >> 3) & 1)", BK))
    return src


def _bf16_slice_lines(t: MmaTiles, a_trans: bool, b_trans: bool) -> list[str]:
    MT, NT = t.wm // 16, t.wn // 8
    BK = t.bk
    src = []
    lda = "ldmatrix_x4_trans" if a_trans else "ldmatrix_x4"
    ldb = "ldmatrix_x4_trans" if b_trans else "ldmatrix_x4"

    def at(base: str, off: str, trans: bool, width: int, kk: int) -> str:
        if kk == 0:
            return f"{base} + {off}"
        return f"{base} + {off} + {kk * width}" if trans else f"({base} + {off}) ^ {(kk // 8) << 3}"

    for kk in range(0, BK, 16):
        for i in range(MT):
            src.append(f"        a{i}_0, a{i}_1, a{i}_2, a{i}_3 = {lda}(Sm, {at('sa', f'oa_{i}', a_trans, t.bm, kk)})")
        for p in range(NT // 2):
            # registers: b0, b1 of n tile 2p, then b0, b1 of n tile 2p + 1 (both layouts' lane maps)
            src.append(f"        b{2 * p}_0, b{2 * p}_1, b{2 * p + 1}_0, b{2 * p + 1}_1 = "
                       f"{ldb}(Sm, {at('sb', f'ob_{p}', b_trans, t.bn, kk)})")
        for i in range(MT):
            for j in range(NT):
                cs = ", ".join(f"c{i}_{j}_{r}" for r in range(4))
                src.append(f"        {cs} = mma_bf16(a{i}_0, a{i}_1, a{i}_2, a{i}_3, b{j}_0, b{j}_1, {cs})")
    return src


BF16 = OperandFormat("uint16", swizzle_n, swizzle_t, _bf16_lane_lines, _bf16_slice_lines)


def pipeline_source(t: MmaTiles, fmt: OperandFormat, a_trans: bool, b_trans: bool, store: str,
                    async_: bool) -> str:
    """Source of ``kernel(a, b, acc, c, per)``: stage k slices of A and B in shared memory by
    cp.async (or element-wise loads), ``t.stages`` deep, run ``fmt``'s fragment loads and mmas on
    each, and hand each lane's pairs of adjacent outputs to the device function ``store``."""
    MT, NT = t.wm // 16, t.wn // 8  # m16 tiles and n8 tiles per warp
    BK = t.bk
    BOFF = t.stages * t.bm * BK  # where B's stages start in the shared array
    WN_WARPS = t.bn // t.wn
    S = t.stages
    src = ["def kernel(a, b, acc, c, per):",
           f"    Sm = cuda.shared.array({0 if t.dynamic else t.smem_bytes // t.ELEM_BYTES}, {fmt.dtype})",
           "    tid = cuda.threadIdx.x", "    lane = tid & 31", "    warp = tid >> 5",
           "    g = lane >> 2", "    tq = lane & 3",
           f"    wy = warp // {WN_WARPS}", f"    wx = warp % {WN_WARPS}",
           "    M = c.shape[0]", "    N = c.shape[1]",
           f"    K = a.shape[{0 if a_trans else 1}]",
           f"    r0_a = cuda.blockIdx.y * {t.bm}", f"    r0_b = cuda.blockIdx.x * {t.bn}",
           f"    ksteps = (K + {BK - 1}) // {BK}",
           "    kbeg = cuda.blockIdx.z * per", "    nk = min(ksteps, kbeg + per) - kbeg"]
    src += fmt.lane_lines(t, a_trans, b_trans)
    for i in range(MT):
        for j in range(NT):
            src.append(f"    " + ", ".join(f"c{i}_{j}_{r}" for r in range(4)) + " = "
                       + ", ".join(["float32(0.0)"] * 4))
    if async_:
        src += ["    " + line for line in fetch_setup(fmt, t, "a", a_trans, t.bm, "M")
                + fetch_setup(fmt, t, "b", b_trans, t.bn, "N")]
    fetch = (fetch_lines(fmt, t, "a", a_trans, t.bm, "M", async_, 0)
             + fetch_lines(fmt, t, "b", b_trans, t.bn, "N", async_, BOFF))

    def emit_fetch(indent: str):
        return [indent + line for line in fetch]

    # prologue: slices 0 .. S-2
    for s in range(S - 1):
        src += [f"    if {s} < nk:", f"        st = {s}", f"        k0 = (kbeg + {s}) * {BK}"]
        src += emit_fetch("        ")
        src.append("    cp_async_commit()")
    # stage rotation by counters: st (next written), sr (read)
    src += [f"    st = {S - 1}", "    sr = 0", f"    k0 = (kbeg + {S - 1}) * {BK}",
            "    for it in range(nk):",
            f"        cp_async_wait({S - 2})",
            "        cuda.syncthreads()",
            f"        if it + {S - 1} < nk:"]
    src += emit_fetch("            ")
    src += ["        cp_async_commit()",
            f"        k0 += {BK}",
            "        st += 1",
            f"        if st == {S}:",
            "            st = 0",
            f"        sa = sr * {t.bm * BK}",
            f"        sb = {BOFF} + sr * {t.bn * BK}",
            "        sr += 1",
            f"        if sr == {S}:",
            "            sr = 0"]
    src += fmt.slice_lines(t, a_trans, b_trans)
    src.append("    cp_async_wait(0)")
    # epilogue: lane owns rows g, g + 8 and columns 2tq, 2tq + 1 of each m16 x n8 tile
    src += [f"    rw = r0_a + wy * {t.wm} + g", f"    cl = r0_b + wx * {t.wn} + 2 * tq"]
    for i in range(MT):
        for j in range(NT):
            for h in range(2):
                v0, v1 = f"c{i}_{j}_{2 * h}", f"c{i}_{j}_{2 * h + 1}"
                src.append(f"    {store}(c, acc, rw + {i * 16 + 8 * h}, cl + {j * 8}, M, N, {v0}, {v1})")
    return "\n".join(src) + "\n"


def store_name(out_bf16: bool, accumulate: bool, atomic: bool) -> str:
    """The epilogue's device function: a bf16 output, split k's atomic add, ``acc +``, or a plain store."""
    return "store_bf16" if out_bf16 else "store_add" if atomic else "store_acc" if accumulate else "store_f32"


def _kernel_source(t: MmaTiles, a_trans: bool, b_trans: bool, out_bf16: bool, accumulate: bool,
                   atomic: bool, async_: bool) -> str:
    return pipeline_source(t, BF16, a_trans, b_trans, store_name(out_bf16, accumulate, atomic), async_)


def compile_kernel(source: str, label: str, intrinsics: tuple[str, ...], elem_bytes: int = 2):
    """``cuda.jit`` of the generated ``kernel`` in ``source``, with the names it calls: the store
    functions, ``chunk_bytes`` (for operands of ``elem_bytes``) and the :mod:`._mma` ``intrinsics``."""
    names = {"cuda": cuda, "uint16": uint16, "float32": float32, "min": min,
             "chunk_bytes": CHUNK_BYTES[elem_bytes], "row_bytes": row_bytes,
             "store_f32": store_f32, "store_acc": store_acc, "store_add": store_add, "store_bf16": store_bf16}
    for name in intrinsics:
        names[name] = getattr(_mma, name)
    fn = generated_function(source, label, names)
    opts = {} if simulating() else {"max_registers": 255}
    return fast_launch(_cuda_cache.cached(cuda.jit(**opts)(fn)))


@lru_cache(maxsize=None)
def make_gemm_bf16(t: MmaTiles, a_trans: bool, b_trans: bool, out_bf16: bool = False, accumulate: bool = False,
                   atomic: bool = False, cp_async: bool = True):
    """The kernel ``kernel(a, b, acc, c, per)``: ``c = [acc +] A @ B`` for the layouts above,
    ``per`` k slices per block along grid z (``atomic``: added into c). ``cp_async``: 16-byte
    global fetches (operands must pass :func:`aligned_b16`)."""
    t.check()
    source = _kernel_source(t, a_trans, b_trans, out_bf16, accumulate, atomic, cp_async)
    label = f"<gemm_bf16 {t.label()} {'t' if a_trans else 'n'}{'t' if b_trans else 'n'}>"
    return compile_kernel(source, label, ("mma_bf16", "ldmatrix_x4", "ldmatrix_x4_trans", "cp_async16_at",
                                          "cp_async_commit", "cp_async_wait", "pack_bf16x2"))


def kernel_source(t: MmaTiles = GPU_TILES, layout: str = "nn", out_bf16: bool = False, accumulate: bool = False,
                  atomic: bool = False, cp_async: bool = True) -> str:
    """The generated source of one build (for reading and for ``scripts/sass_report.py``)."""
    a_trans, b_trans = LAYOUTS[layout]
    return _kernel_source(t, a_trans, b_trans, out_bf16, accumulate, atomic, cp_async)


def _b16(name: str, a) -> None:
    if np.dtype(a.dtype) not in (np.dtype(np.uint16), np.dtype(np.int16)):
        raise KernelError(f"{name} must hold bf16 bits as uint16 or int16, got dtype={np.dtype(a.dtype)} "
                          f"(shape={tuple(a.shape)})")


MIN_SPLIT_SLICES = 8  # each split at least this many BK slices deep
MAX_SPLITS = 4


@dataclass(frozen=True)
class MmaLaunch:
    tiles: MmaTiles
    splits: int = 1


def choose(m: int, n: int, k: int, splits: int | None = None, out_bf16: bool = False,
           sms: int | None = None, gpu: MmaTiles = GPU_TILES, sim: MmaTiles = SIM_TILES) -> MmaLaunch:
    """The launch of an (m, n, k) problem: ``gpu`` tiles, 128 x 128 (``sim``, one-warp 16 x 16, under
    the simulator); k split (fp32 output only) while a launch of whole tiles fills under one wave
    of ``sms`` SMs (default: the device's) at about 2 blocks per SM, each split at least
    MIN_SPLIT_SLICES deep."""
    t = sim if simulating() else gpu
    if splits is not None:
        return MmaLaunch(t, splits)
    sms = sms or sm_count()
    blocks = -(-m // t.bm) * -(-n // t.bn)
    slices = -(-k // t.bk)
    s = 1
    if not out_bf16:
        while s < MAX_SPLITS and blocks * s < sms and slices // (2 * s) >= MIN_SPLIT_SLICES:
            s *= 2
    return MmaLaunch(t, s)


def _launch(layout: str, a, b, acc, c, k: int, stream, tiles, splits, build=make_gemm_bf16,
            aligned=None, choose_fn=choose) -> None:
    """Enqueue ``c = [acc +] A @ B`` (``layout``): ``build(tiles, a_trans, b_trans, out_bf16,
    accumulate, atomic, cp_async)`` makes the kernel, ``aligned(x)`` says whether an operand takes
    cp.async (default :func:`aligned_b16`), ``choose_fn`` is the launch rule."""
    aligned = aligned or aligned_b16
    m, n = c.shape
    if m == 0 or n == 0:
        return
    out_bf16 = np.dtype(c.dtype) != np.dtype(np.float32)
    if out_bf16 and acc is not None:
        raise KernelError("acc needs a float32 output; got a bf16 output")
    if out_bf16 and splits not in (None, 1):
        raise KernelError(f"split k adds float32 partial tiles: splits={splits} needs a float32 output")
    if k == 0:  # an empty sum
        if out_bf16:
            raise KernelError("K=0 with a bf16 output: nothing to multiply")
        (copy_fill(acc, c, stream) if acc is not None else zero_fill(c, stream))
        return
    a_trans, b_trans = LAYOUTS[layout]
    async_ = aligned(a) and aligned(b)
    wgmma = build is make_gemm_bf16 and GW.usable(tiles, async_)
    if isinstance(tiles, GW.WgmmaTiles) and not wgmma:
        raise KernelError(f"tiles {tiles.label()}: the wgmma GEMM needs a GPU, bf16 operands and 16-byte aligned ones "
                          f"(unit column stride, row stride a multiple of 8); got a {tuple(a.shape)} and b {tuple(b.shape)}")
    if wgmma and tiles is None:  # Note [wgmma tiles by shape]; split k decided on those tiles
        tiles = GW.choose_tiles(m, n)
        launch = choose(m, n, k, splits, out_bf16, gpu=tiles)
    else:
        launch = choose_fn(m, n, k, splits, out_bf16)
    tiles = tiles or launch.tiles
    slices = -(-k // tiles.bk)
    s = launch.splits
    if not 1 <= s <= slices:
        raise KernelError(f"splits={s} must be between 1 and the {slices} k slices of K={k}")
    per = -(-slices // s)
    s = -(-slices // per)  # no empty split
    if s > 1:
        (copy_fill(acc, c, stream) if acc is not None else zero_fill(c, stream))
    if wgmma:
        kernel = GW.make_gemm_wgmma(tiles, a_trans, b_trans, out_bf16, acc is not None and s == 1, s > 1)
    else:
        kernel = build(tiles, a_trans, b_trans, out_bf16, acc is not None and s == 1, s > 1, async_)
    grid = (-(-n // tiles.bn), -(-m // tiles.bm), s)
    args = (a, b, c if acc is None else acc, c, per)
    if tiles.dynamic:
        _allow_dynamic_smem(kernel, args, tiles.smem_bytes)
        kernel[grid, tiles.threads, stream, tiles.smem_bytes](*args)
    else:
        kernel[grid, tiles.threads, stream](*args)


_DYNAMIC_DONE: set = set()


def _allow_dynamic_smem(kernel, args, nbytes: int) -> None:
    """Raise the compiled kernel's dynamic shared-memory limit (48 KiB by default) to ``nbytes``:
    ``cuKernelSetAttribute(CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES)``, once per build and
    device (numba-cuda has no launch option for it)."""
    if simulating():
        return
    from numba.cuda.cudadrv.driver import binding, driver

    argtypes = tuple(kernel.typeof_pyval(x) for x in args)
    compiled = kernel.compile(argtypes)
    cufunc = compiled._codelibrary.get_cufunc()
    key = (id(kernel), argtypes, cufunc.device.id)
    if key in _DYNAMIC_DONE:
        return
    attr = binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    driver.cuKernelSetAttribute(attr, nbytes, cufunc.handle, cufunc.device.id)
    _DYNAMIC_DONE.add(key)


def _f32_or_b16(name: str, a) -> None:
    if np.dtype(a.dtype) != np.dtype(np.float32):
        _b16(name, a)


def _check(op: str, names, arrays, shapes, operand=_b16, output=_f32_or_b16) -> None:
    """Raise a one-line KernelError naming the first bad one of ``arrays`` (the two operands, the
    output, ``acc`` or None): not 2-D, an operand failing ``operand(name, array)``, an output
    failing ``output``, a non-float32 ``acc``, or a shape other than ``shapes``."""
    for name, a in zip(names, arrays):
        if a is None:
            continue
        check_ndim(name, a, 2)
    for name, a in zip(names[:2], arrays[:2]):
        operand(name, a)
    out, acc = arrays[2], arrays[3]
    output(names[2], out)
    if acc is not None and np.dtype(acc.dtype) != np.dtype(np.float32):
        raise KernelError(f"{op}: acc must be float32, got dtype={np.dtype(acc.dtype)}")
    for name, a, want in zip(names, arrays, shapes):
        if a is not None and tuple(a.shape) != want:
            raise KernelError(f"{op}: {name} has shape {tuple(a.shape)}, expected {want} "
                              f"(the others: {', '.join(f'{nm} {tuple(x.shape)}' for nm, x in zip(names, arrays) if x is not None)})")


def gemm_bf16(x, w, y, stream=0, acc=None, tiles: MmaTiles | None = None, splits: int | None = None):
    """Enqueue ``y = [acc +] x @ w.T``: x (M, K), w (N, K) bf16 bits; y (M, N) float32 or bf16."""
    m, k = x.shape
    n = w.shape[0]
    _check("gemm_bf16", ("x", "w", "y", "acc"), (x, w, y, acc), ((m, k), (n, k), (m, n), (m, n)))
    _launch("nn", x, w, acc, y, k, stream, tiles, splits)


def linear_dx_bf16(dy, w, dx, stream=0, acc=None, tiles: MmaTiles | None = None, splits: int | None = None):
    """Enqueue ``dx = [acc +] dy @ w``: dy (M, N), w (N, K) bf16 bits; dx (M, K) float32 or bf16."""
    m, n = dy.shape
    k = w.shape[1]
    _check("linear_dx_bf16", ("dy", "w", "dx", "acc"), (dy, w, dx, acc), ((m, n), (n, k), (m, k), (m, k)))
    _launch("nt", dy, w, acc, dx, n, stream, tiles, splits)


def linear_dw_bf16(dy, x, dw, stream=0, acc=None, tiles: MmaTiles | None = None, splits: int | None = None):
    """Enqueue ``dw = [acc +] dy.T @ x``: dy (M, N), x (M, K) bf16 bits; dw (N, K) float32 or bf16."""
    m, n = dy.shape
    k = x.shape[1]
    _check("linear_dw_bf16", ("dy", "x", "dw", "acc"), (dy, x, dw, acc), ((m, n), (m, k), (n, k), (n, k)))
    _launch("tt", dy, x, acc, dw, m, stream, tiles, splits)


def reference(layout: str, a_bits, b_bits, acc=None) -> np.ndarray:
    """numpy float64 ``[acc +] A @ B`` of bf16 operands in ``layout`` (stored as the launchers take them)."""
    a = mma_layout.bf16_value(a_bits).astype(np.float64)
    b = mma_layout.bf16_value(b_bits).astype(np.float64)
    a_trans, b_trans = LAYOUTS[layout]
    out = (a.T if a_trans else a) @ (b if b_trans else b.T)
    return out if acc is None else out + acc

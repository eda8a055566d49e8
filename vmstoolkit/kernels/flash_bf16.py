"""Causal GQA flash attention in bf16 on the tensor cores (``mma.sync`` m16n8k16, fp32 accumulate):
the kernel that :mod:`.flash_model` models lane for lane.

q (B, T, nh, D), k and v (B, T, nkv, D), o (B, T, nh, D): bf16 bits as uint16 (or int16: a torch
bf16 tensor ``.view(torch.int16)``), scale ``1/sqrt(D)``, query head ``h`` reads key/value head
``h // (nh // nkv)``; with ``lse`` (B, nh, T) float32 also each row's natural-log log-sum-exp of
the scaled scores (the statistics a backward recomputes P from, as :mod:`.attention` writes them).
D a multiple of 16 (64 and 128 are the tuned ones), T any.

One block per (query tile of ``16 * warps`` rows, query head, batch); query tiles run longest
first. Each warp owns 16 query rows (:func:`.flash_model.warp_forward`): its Q fragments (A, ``D/16``
k steps) are loaded once by ``ldmatrix`` and stay in registers; the block walks the key tiles of
``bkv`` keys up to its diagonal:

1. K and V of tile ``j + 1`` are fetched by ``cp.async`` (16 bytes each, zero-filled past T) into
   the other of two shared stages while tile ``j`` is computed (one commit group per tile, one
   ``wait_group 1`` and one barrier before it is read, one barrier after);
2. ``S = Q K^T``: ``bkv / 8`` n8 accumulator tiles per warp, K's B fragments by ``ldmatrix``
   (keys are rows, head-dim contiguous: no ``.trans``);
3. online softmax in fp32, base 2 (log2(e) folded into the scale, one ``ex2.approx`` per score):
   lane ``l`` owns rows ``g = l >> 2`` and ``g + 8``; row maxima over the lane's registers, then
   the quad (two ``shfl.xor``); the running sum stays a per-lane partial until the end; masking
   (key > row, key >= T) only on the tiles that cross the block's diagonal or T;
4. ``O += P V``: P's accumulators packed to bf16 pairs *are* the A fragments (no shared memory),
   V's B fragments by ``ldmatrix.trans`` (keys are rows);
5. the end: the quad's sums added, ``O / l`` rounded once to bf16 and stored, ``lse = m ln 2 + ln l``.

Shared layout: a stage holds K (bkv x D) then V (bkv x D), Q (16 warps x D) follows the two
stages; rows of D elements in 16-byte chunks, chunk ``c`` of row ``r`` stored at chunk
``c ^ (r & 7)`` (:func:`swizzle_mask`) so that the 8 rows of an ``ldmatrix`` phase and the
``cp.async`` writes hit distinct bank groups. Operands that cp.async cannot fetch (head-dim stride
not 1, a row stride or base not 16-byte aligned) take the same kernel with element-wise loads
into the same layout (``cp_async=False``).

Note [bf16 flash tile]
----------------------
4 warps x 16 rows = 64 query rows per block and 64 keys per tile: per tile and warp, ``D/16 x 4``
ldmatrix.x4 of K and as many of V (each feeding 2 mma), ``D/2`` mma for S and ``D/2`` for PV, 64
exponentials per lane. Registers at D = 128: 64 accumulators of O, 32 of S, 32 Q fragments; a
thread's fetch chunks share one column and swizzle, so one row/offset pair serves all of them
(ptxas sm_90 offline: 131 registers at D = 64, 174 at D = 128, no spill; 168 and 253 with a
register set per chunk). Shared memory: 2 x 2 x 64 x D + 64 x D elements: 40 KiB at D = 64
(static), 80 KiB at D = 128 (dynamic, two blocks per SM). Not yet timed on the H200 (``experiments/kernels_bench.py --only
attention_bf16`` times these tiles beside 32-key tiles and 8 warps).

The backward (:func:`flash_attention_bf16_backward`, section below) reuses the tiles, fetches and
fragment patterns: a dQ kernel (the forward's walk) and a dK/dV kernel (its transpose).

Under the simulator the kernels run the intrinsics' twins (:mod:`._mma`): one warp, 16 keys a tile.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from numba import cuda, float32, uint16

from vmstoolkit.errors import KernelError

from . import _cuda_cache, _launch as fastlaunch, _mma
from ._util import check_float32, check_ndim, current_device_ordinal, generated_function, simulating
from .bf16 import as_u16, check_bf16
from .gemm_bf16 import CHUNK, MAX_SMEM, STATIC_SMEM, _allow_dynamic_smem

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
ROWS = 16  # query rows per warp (mma's m)


@dataclass(frozen=True)
class FlashBf16Tiles:
    """``warps`` x 16 query rows per block, ``bkv`` keys per tile (a multiple of 16)."""

    warps: int = 4
    bkv: int = 64

    @property
    def bq(self) -> int:
        return ROWS * self.warps

    @property
    def threads(self) -> int:
        return 32 * self.warps

    def smem_elems(self, d: int) -> int:
        return 4 * self.bkv * d + self.bq * d

    def smem_bytes(self, d: int) -> int:
        return 2 * self.smem_elems(d)

    def dynamic(self, d: int) -> bool:
        return self.smem_bytes(d) > STATIC_SMEM

    def label(self) -> str:
        return f"w{self.warps}/kv{self.bkv}"

    def check(self, d: int) -> None:
        if d <= 0 or d % 16:
            raise KernelError(f"flash_attention_bf16: head_dim must be a positive multiple of 16, got {d}")
        if self.bkv <= 0 or self.bkv % 16:
            raise KernelError(f"flash tiles {self}: bkv must be a positive multiple of 16")
        if not 1 <= self.warps <= 16:
            raise KernelError(f"flash tiles {self}: warps must be 1 to 16")
        chunks = d // CHUNK
        if (self.bkv * chunks) % self.threads or (self.bq * chunks) % self.threads:
            raise KernelError(f"flash tiles {self} with head_dim={d}: each thread must fetch whole 16-byte "
                              f"chunks of K, V and Q ({self.bkv}x{d} and {self.bq}x{d} over {self.threads} threads)")
        if self.smem_bytes(d) > MAX_SMEM:
            raise KernelError(f"flash tiles {self} with head_dim={d}: {self.smem_bytes(d)} bytes of shared "
                              f"memory (limit {MAX_SMEM})")


GPU_TILES = FlashBf16Tiles()
SIM_TILES = FlashBf16Tiles(warps=1, bkv=16)


# ---- device helpers (NVVM inlines them; as kernel statements their branches would multiply the
# kernel's basic blocks, which Numba's SSA passes pay for superlinearly) ---------------------------

@cuda.jit(device=True)
def chunk_bytes(ok):
    return 16 if ok else 0


@cuda.jit(device=True)
def load_chunk(sm, i, g, row, col, ok):
    """Element-wise twin of one zero-filling 16-byte ``cp.async``: ``sm[i:i+8] = g[row, col:col+8]``."""
    for e in range(8):
        sm[i + e] = g[row, col + e] if ok else 0


@cuda.jit(device=True)
def masked(x, key, row, t):
    """A score of (row, key), already scaled: -inf where the key is after the row or past T."""
    return float32(-math.inf) if key > row or key >= t else x


@cuda.jit(device=True)
def finite_or_zero(m):
    """The running max to subtract: 0 for a row with no live key yet (all -inf), so exp2 gives 0."""
    return float32(0.0) if m == float32(-math.inf) else m


@cuda.jit(device=True)
def reciprocal_or_zero(s):
    return float32(1.0) / s if s > float32(0.0) else float32(0.0)


@cuda.jit(device=True)
def store_pair(og, row, col, t, v0, v1):
    """Two adjacent outputs of a row, rounded to bf16, if the row is inside T."""
    if row < t:
        pk = _mma.pack_bf16x2(v0, v1)
        og[row, col] = pk & 0xFFFF
        og[row, col + 1] = pk >> 16


@cuda.jit(device=True)
def store_lse(lse, b, h, row, t, tq, m, s):
    """Lane tq == 0 of a quad writes its row's lse = m ln 2 + ln(s) (m in base-2 units)."""
    if tq == 0 and row < t:
        lse[b, h, row] = m * float32(LN2) + math.log(s)


# ---- the kernel, generated from the tile constants ------------------------------------------------


def _fetch(tile: str, origin: str, src: str, base: str, rows: int, threads: int, d: int, async_: bool) -> list[str]:
    """Source lines fetching ``rows`` x d of the 2-D global view ``src`` (T, d), from its row
    ``origin``, into shared memory at ``base``: per thread chunk ``i`` its precomputed tile row
    ``{tile}r{i}``, column ``{tile}c{i}`` and swizzled shared offset ``{tile}s{i}``
    (:func:`_fetch_setup`). Rows past T are zero-filled (their source row clamped to 0)."""
    out = []
    step = _uniform_step(threads, d)
    for i in range(rows * (d // CHUNK) // threads):
        if step:  # one set of registers, constant offsets
            r, c, s = f"{tile}r0 + {i * step}", f"{tile}c0", f"{tile}s0 + {i * step * d}"
        else:
            r, c, s = f"{tile}r{i}", f"{tile}c{i}", f"{tile}s{i}"
        out += [f"gr = {origin} + {r}", "ok = gr < T", "gr = gr if ok else 0"]
        if async_:
            out.append(f"cp_async16(Sm, {base} + {s}, {src}, gr, {c}, chunk_bytes(ok))")
        else:
            out.append(f"load_chunk(Sm, {base} + {s}, {src}, gr, {c}, ok)")
    return out


def swizzle_mask(d: int) -> int:
    """Chunk ``c`` of a row ``r`` of D elements is stored at chunk ``c ^ (r & mask)``: the largest
    power of two dividing the row's chunk count, at most 8, minus one (so the XOR stays in the row)."""
    cpr = d // CHUNK
    return min(8, cpr & -cpr) - 1


def _uniform_step(threads: int, d: int) -> int:
    """Rows between a thread's successive chunks when they all share its column and swizzle (the
    thread count a multiple of the row's chunks, the row step a multiple of the swizzle period):
    then one row, column and shared offset serve every chunk, plus constants. 0 otherwise."""
    cpr = d // CHUNK
    step = threads // cpr
    return step if threads % cpr == 0 and step % (swizzle_mask(d) + 1) == 0 else 0


def _fetch_setup(tile: str, rows: int, threads: int, d: int) -> list[str]:
    cpr = d // CHUNK
    mask = swizzle_mask(d)
    out = []
    n = rows * cpr // threads
    for i in range(1 if _uniform_step(threads, d) else n):
        q = f"(tid + {i * threads})"
        out += [f"{tile}r{i} = {q} // {cpr}", f"cc = {q} % {cpr}", f"{tile}c{i} = cc * {CHUNK}",
                f"{tile}s{i} = {tile}r{i} * {d} + ((cc ^ ({tile}r{i} & {mask})) << 3)"]
    return out


def _kernel_source(d: int, t: FlashBf16Tiles, with_lse: bool, async_: bool) -> str:
    W, BKV, BQ, TH = t.warps, t.bkv, t.bq, t.threads
    KD = d // 16  # k steps of S = Q K^T
    NS = BKV // 8  # n8 tiles of S
    NO = d // 8  # n8 tiles of O
    KP = BKV // 16  # k steps of P V (16 keys each)
    mask = swizzle_mask(d)
    STAGE = 2 * BKV * d  # K then V
    QOFF = 2 * STAGE
    regs = lambda p: ", ".join(f"{p}_{r}" for r in range(4))  # noqa: E731
    src = ["def kernel(q, k, v, o, lse, scale2, group):",
           # 16-byte aligned for cp.async and ldmatrix (the simulator takes no alignment)
           f"    Sm = cuda.shared.array({0 if t.dynamic(d) else t.smem_elems(d)}, uint16"
           f"{'' if simulating() else ', alignment=16'})",
           "    tid = cuda.threadIdx.x", "    lane = tid & 31", "    warp = tid >> 5",
           "    g = lane >> 2", "    tq = lane & 3",
           "    T = q.shape[1]",
           f"    qt = (T + {BQ - 1}) // {BQ} - 1 - cuda.blockIdx.x",  # longest tiles first
           "    h = cuda.blockIdx.y", "    b = cuda.blockIdx.z", "    hk = h // group",
           "    qg = q[b, :, h, :]", "    kg = k[b, :, hk, :]", "    vg = v[b, :, hk, :]", "    og = o[b, :, h, :]",
           f"    q0 = qt * {BQ}",
           f"    nkt = (min(T, q0 + {BQ}) + {BKV - 1}) // {BKV}",
           "    row0 = q0 + warp * 16 + g", "    row1 = row0 + 8"]
    src += ["    " + x for x in _fetch_setup("q", BQ, TH, d) + _fetch_setup("k", BKV, TH, d)]
    # per-lane ldmatrix offsets (elements, inside a region) at k step kd:
    #   Q (A): rows warp*16 + l%16, chunk 2kd + l//16
    #   K (B, no trans): keys l%8 + (l//16)*8 (+16 per key pair), chunk 2kd + (l//8)%2
    #   V (B, trans): keys l%8 + ((l//8)%2)*8 (+16 per key step), chunk 2c + l//16 (d tiles 2c, 2c+1)
    src += ["    rq = warp * 16 + (lane & 15)", "    rk = (lane & 7) + ((lane >> 4) << 3)",
            "    rv = (lane & 7) + (((lane >> 3) & 1) << 3)", f"    sw = lane & 7 & {mask}"]
    for kd in range(KD):
        src += [f"    ok_{kd} = rk * {d} + (({2 * kd} + ((lane >> 3) & 1)) ^ sw) * 8"]
    for c in range(d // 16):
        src += [f"    ov_{c} = {BKV * d} + rv * {d} + (({2 * c} + (lane >> 4)) ^ sw) * 8"]
    # prologue: Q (group 0), tile 0 (group 1)
    src += ["    " + x for x in _fetch("q", "q0", "qg", str(QOFF), BQ, TH, d, async_)]
    src += ["    cp_async_commit()"]
    src += ["    " + x for x in _fetch("k", "0", "kg", "0", BKV, TH, d, async_)]
    src += ["    " + x for x in _fetch("k", "0", "vg", str(BKV * d), BKV, TH, d, async_)]
    src += ["    cp_async_commit()", "    cp_async_wait(1)", "    cuda.syncthreads()"]
    for kd in range(KD):
        src.append(f"    {regs(f'qa{kd}')} = ldmatrix_x4(Sm, {QOFF} + rq * {d} + "
                   f"(({2 * kd} + (lane >> 4)) ^ (rq & {mask})) * 8)")
    src += ["    m0 = float32(-math.inf)", "    m1 = float32(-math.inf)",
            "    l0 = float32(0.0)", "    l1 = float32(0.0)"]
    for n in range(NO):
        src.append(f"    {regs(f'o{n}')} = " + ", ".join(["float32(0.0)"] * 4))
    src += ["    for it in range(nkt):",
            "        if it + 1 < nkt:",
            f"            k0r = (it + 1) * {BKV}",
            f"            sn = ((it + 1) & 1) * {STAGE}"]
    src += ["            " + x for x in _fetch("k", "k0r", "kg", "sn", BKV, TH, d, async_)
            + _fetch("k", "k0r", "vg", f"sn + {BKV * d}", BKV, TH, d, async_)]
    src += ["        cp_async_commit()", "        cp_async_wait(1)", "        cuda.syncthreads()",
            f"        sb = (it & 1) * {STAGE}", f"        k0 = it * {BKV}"]
    # S = Q K^T
    for j in range(NS):
        src.append(f"        {regs(f's{j}')} = " + ", ".join(["float32(0.0)"] * 4))
    for p in range(KP):
        for kd in range(KD):
            src.append(f"        kb0, kb1, kb2, kb3 = ldmatrix_x4(Sm, sb + ok_{kd} + {16 * p * d})")
            src.append(f"        {regs(f's{2 * p}')} = mma_bf16({regs(f'qa{kd}')}, kb0, kb1, {regs(f's{2 * p}')})")
            src.append(f"        {regs(f's{2 * p + 1}')} = mma_bf16({regs(f'qa{kd}')}, kb2, kb3, "
                       f"{regs(f's{2 * p + 1}')})")
    for j in range(NS):
        for r in range(4):
            src.append(f"        s{j}_{r} *= scale2")
    # masking on the tiles that cross the block's first row (or T, which only such tiles reach)
    src.append(f"        if k0 + {BKV - 1} > q0:")
    src.append("            kc = k0 + 2 * tq")
    for j in range(NS):
        for r in range(4):
            src.append(f"            s{j}_{r} = masked(s{j}_{r}, kc + {8 * j + (r & 1)}, row{r >> 1}, T)")
    # online softmax (base 2)
    for half, rr in ((0, (0, 1)), (1, (2, 3))):
        vals = ", ".join(f"s{j}_{r}" for j in range(NS) for r in rr)
        src += [f"        x{half} = max({vals})",
                f"        x{half} = max(x{half}, shfl_xor_f32(x{half}, 1))",
                f"        x{half} = max(x{half}, shfl_xor_f32(x{half}, 2))",
                f"        x{half} = max(m{half}, x{half})",
                f"        f{half} = finite_or_zero(x{half})",
                f"        a{half} = exp2_approx(m{half} - f{half})",
                f"        m{half} = x{half}"]
    for j in range(NS):
        for r in range(4):
            src.append(f"        s{j}_{r} = exp2_approx(s{j}_{r} - f{r >> 1})")
    for half, rr in ((0, (0, 1)), (1, (2, 3))):
        src.append(f"        l{half} = l{half} * a{half} + " + " + ".join(f"s{j}_{r}" for j in range(NS) for r in rr))
    for n in range(NO):
        src += [f"        o{n}_0 *= a0", f"        o{n}_1 *= a0", f"        o{n}_2 *= a1", f"        o{n}_3 *= a1"]
    # O += P V: S tiles 2p, 2p+1 packed are the A fragment of key step p
    for p in range(KP):
        a, c = 2 * p, 2 * p + 1
        src += [f"        pa0 = pack_bf16x2(s{a}_0, s{a}_1)", f"        pa1 = pack_bf16x2(s{a}_2, s{a}_3)",
                f"        pa2 = pack_bf16x2(s{c}_0, s{c}_1)", f"        pa3 = pack_bf16x2(s{c}_2, s{c}_3)"]
        for cc in range(d // 16):
            src.append(f"        vb0, vb1, vb2, vb3 = ldmatrix_x4_trans(Sm, sb + ov_{cc} + {16 * p * d})")
            src.append(f"        {regs(f'o{2 * cc}')} = mma_bf16(pa0, pa1, pa2, pa3, vb0, vb1, {regs(f'o{2 * cc}')})")
            src.append(f"        {regs(f'o{2 * cc + 1}')} = mma_bf16(pa0, pa1, pa2, pa3, vb2, vb3, "
                       f"{regs(f'o{2 * cc + 1}')})")
    src.append("        cuda.syncthreads()")
    src.append("    cp_async_wait(0)")
    # the end: quad sums, O / l, lse
    for half in (0, 1):
        src += [f"    l{half} += shfl_xor_f32(l{half}, 1)", f"    l{half} += shfl_xor_f32(l{half}, 2)",
                f"    i{half} = reciprocal_or_zero(l{half})"]
    src.append("    cl = 2 * tq")
    for n in range(NO):
        src.append(f"    store_pair(og, row0, cl + {8 * n}, T, o{n}_0 * i0, o{n}_1 * i0)")
        src.append(f"    store_pair(og, row1, cl + {8 * n}, T, o{n}_2 * i1, o{n}_3 * i1)")
    if with_lse:
        src += ["    store_lse(lse, b, h, row0, T, tq, m0, l0)", "    store_lse(lse, b, h, row1, T, tq, m1, l1)"]
    return "\n".join(src) + "\n"


_NAMES = ("mma_bf16", "ldmatrix_x4", "ldmatrix_x4_trans", "cp_async16", "cp_async4", "cp_async_commit", "cp_async_wait",
          "pack_bf16x2", "shfl_xor_f32", "exp2_approx")


def kernel_namespace() -> dict:
    names = {"cuda": cuda, "uint16": uint16, "float32": float32, "math": math, "min": min, "max": max,
             "chunk_bytes": chunk_bytes, "load_chunk": load_chunk, "masked": masked, "finite_or_zero": finite_or_zero,
             "reciprocal_or_zero": reciprocal_or_zero, "store_pair": store_pair, "store_lse": store_lse}
    names.update({n: getattr(_mma, n) for n in _NAMES})
    return names


def python_kernel(d: int, tiles: FlashBf16Tiles, with_lse: bool = True, cp_async: bool = True):
    """The generated kernel as a plain Python function (before ``cuda.jit``): for reading, for
    ``cuda.compile_ptx`` and for ``scripts/sass_report.py``-style inspection."""
    tiles.check(d)
    source = _kernel_source(d, tiles, with_lse, cp_async)
    names = kernel_namespace()
    return generated_function(source, f"<flash_bf16 d{d} {tiles.label()}{'' if cp_async else ' elementwise'}>", names)


@lru_cache(maxsize=None)
def make_flash_bf16(d: int, tiles: FlashBf16Tiles, with_lse: bool = True, cp_async: bool = True):
    """The kernel ``kernel(q, k, v, o, lse, scale2, group)`` for head_dim ``d``; grid
    ``(ceil(T / bq), nh, B)``, ``tiles.threads`` threads, ``tiles.smem_bytes(d)`` of shared memory
    (dynamic when over 48 KiB)."""
    fn = python_kernel(d, tiles, with_lse, cp_async)
    opts = {} if simulating() else {"max_registers": 255}
    return fastlaunch.fast(_cuda_cache.cached(cuda.jit(**opts)(fn)))


def kernel_source(d: int = 128, tiles: FlashBf16Tiles = GPU_TILES, with_lse: bool = True, cp_async: bool = True) -> str:
    return _kernel_source(d, tiles, with_lse, cp_async)


# ---- launcher -------------------------------------------------------------------------------------


def _aligned_rows(a) -> bool:
    """True if cp.async can fetch 16-byte chunks of the last axis of a 4-D 2-byte array: unit
    element stride, every other stride a multiple of 8 elements, base 16-byte aligned (device
    arrays by ``__cuda_array_interface__``, the simulator's by ``__array_interface__``)."""
    iface = getattr(a, "__cuda_array_interface__", None) or a.__array_interface__
    shape = tuple(iface["shape"])
    strides = iface.get("strides")
    if strides is None:  # C-contiguous
        strides, acc = [], 2
        for n in reversed(shape):
            strides.insert(0, acc)
            acc *= n
    if iface["data"][0] % 16:
        return False
    if shape[-1] > 1 and strides[-1] != 2:
        return False
    return all(n <= 1 or s % 16 == 0 for n, s in zip(shape[:-1], strides[:-1]))


def check_args(q, k, v, o, lse=None) -> tuple[int, int, int, int, int]:
    for name, a in (("q", q), ("k", k), ("v", v), ("output o", o)):
        check_bf16(f"flash_attention_bf16: {name}", a)
        check_ndim(f"flash_attention_bf16: {name}", a, 4)
    b, t, nh, d = q.shape
    bk, tk, nkv, dk = k.shape
    if (bk, tk, dk) != (b, t, d) or tuple(v.shape) != tuple(k.shape):
        raise KernelError(f"flash_attention_bf16: q {tuple(q.shape)} (B, T, nh, D), k {tuple(k.shape)} and v "
                          f"{tuple(v.shape)} (B, T, nkv, D) disagree")
    if nkv == 0 or nh % nkv:
        raise KernelError(f"flash_attention_bf16: n_heads={nh} is not a multiple of n_kv_heads={nkv}")
    if tuple(o.shape) != tuple(q.shape):
        raise KernelError(f"flash_attention_bf16: output {tuple(o.shape)} != q {tuple(q.shape)}")
    if lse is not None:
        check_float32("flash_attention_bf16: lse", lse)
        if tuple(lse.shape) != (b, nh, t):
            raise KernelError(f"flash_attention_bf16: lse has shape {tuple(lse.shape)}, expected (B, nh, T) = "
                              f"{(b, nh, t)}")
    return b, t, nh, nkv, d


def default_tiles() -> FlashBf16Tiles:
    return SIM_TILES if simulating() else GPU_TILES


def flash_attention_bf16(q, k, v, o, lse=None, stream=0, tiles: FlashBf16Tiles | None = None,
                         cp_async: bool | None = None) -> None:
    """Enqueue causal GQA attention of q (B, T, nh, D) over k, v (B, T, nkv, D), bf16 bits, into
    o (B, T, nh, D) bf16; with ``lse`` (B, nh, T) float32 also the rows' log-sum-exps. Views with
    any strides are accepted (16-byte-aligned rows take cp.async, others element-wise loads;
    ``cp_async=False`` forces the latter)."""
    b, t, nh, nkv, d = check_args(q, k, v, o, lse)
    tiles = tiles or default_tiles()
    tiles.check(d)
    if b * t * nh == 0:
        return
    q, k, v, o = (as_u16(x) for x in (q, k, v, o))
    fits = all(_aligned_rows(x) for x in (q, k, v))
    if cp_async and not fits:
        raise KernelError("flash_attention_bf16: cp_async=True needs q, k, v with unit head-dim stride, "
                          "other strides multiples of 8 elements and 16-byte-aligned bases")
    async_ = fits if cp_async is None else cp_async
    kernel = make_flash_bf16(d, tiles, lse is not None, async_)
    lse_arg = lse if lse is not None else _dummy_lse()
    args = (q, k, v, o, lse_arg, np.float32(LOG2E / math.sqrt(d)), np.int64(nh // nkv))
    grid = (-(-t // tiles.bq), nh, b)
    if tiles.dynamic(d):
        _allow_dynamic_smem(kernel, args, tiles.smem_bytes(d))
        kernel[grid, tiles.threads, stream, tiles.smem_bytes(d)](*args)
    else:
        kernel[grid, tiles.threads, stream](*args)


_DUMMY: dict = {}


def _dummy_lse(ndim: int = 3):
    """A (1,) * ndim float32 device array standing in for ``lse`` (or another float32 argument) when
    none is asked (never written)."""
    if simulating():
        return cuda.device_array((1,) * ndim, np.float32)
    dev = current_device_ordinal()  # not get_current_device(): 15-30 us a call
    if dev is None:
        dev = cuda.get_current_device().id
    if (dev, ndim) not in _DUMMY:
        _DUMMY[dev, ndim] = cuda.device_array((1,) * ndim, np.float32)
    return _DUMMY[dev, ndim]


# ---- backward (FlashAttention-2's algorithm, two kernels, no atomics) -------------------------------
#
# With D = rowsum(dO o O) and P recomputed from the forward's lse (P = exp2(S scale2 - lse log2 e)):
#   dV = P^T dO,  dP = dO V^T,  dS = P o (dP - D),  dQ = dS K / sqrt(d),  dK = dS^T Q / sqrt(d).
# The dQ kernel is the forward's walk (a warp per 16 query rows, K and V tiles streamed, P and dS
# as A fragments from the accumulators); the dK/dV kernel is its transpose (a warp per 16 keys,
# K and V fragments in registers, Q and dO tiles of the query heads of its GQA group streamed),
# so every gradient is summed in registers and written once.


@cuda.jit(device=True)
def masked_t(x, key, query, t):
    """A transposed score (key row, query column): -inf where the key is after the query or the query past T."""
    return float32(-math.inf) if key > query or query >= t else x


@cuda.jit(device=True)
def row_stat(a, b, h, row, t):
    """``a[b, h, row]`` (a (B, nh, T) float32 statistic), 0 past T."""
    return a[b, h, row] if row < t else float32(0.0)


@fastlaunch.jit
def _dsum_kernel(o, do, dsum, dqa, zero):
    """dsum[b, h, t] = sum_d o[b, t, h, d] * do[b, t, h, d] (bf16 values, fp32 sum), and with ``zero``
    also ``dqa[b, t, h, :] = 0`` (the fused backward's dQ accumulator). Eight threads a row, thread
    ``p`` taking elements p, p + 8, ... (each step reads 16 adjacent bytes a row and writes 32), the
    eight partial sums added by shuffles. Every thread of a block runs the same iterations (the
    shuffles need the whole warp)."""
    b_, t_, nh, d = o.shape
    n = b_ * t_ * nh
    for base in range(cuda.blockIdx.x * cuda.blockDim.x, n * 8, cuda.gridsize(1)):
        e = base + cuda.threadIdx.x
        r = e >> 3
        p = e & 7
        s = float32(0.0)
        if r < n:
            h = r % nh
            t = (r // nh) % t_
            b = r // (nh * t_)
            for i in range(p, d, 8):
                s += _mma.bf16_to_f32(o[b, t, h, i]) * _mma.bf16_to_f32(do[b, t, h, i])
                if zero:
                    dqa[b, t, h, i] = float32(0.0)
        s += _mma.shfl_xor_f32(s, 1)
        s += _mma.shfl_xor_f32(s, 2)
        s += _mma.shfl_xor_f32(s, 4)
        if r < n and p == 0:
            dsum[b, h, t] = s


def _offsets(d: int) -> list[str]:
    """Per-lane ldmatrix offsets inside a (rows x d) region at k step ``kd`` / d pair ``c``:
    ``ra`` (A, rows warp*16 + l%16, chunk 2kd + l//16: add per kd), ``bc_{kd}`` (B from rows that
    are mma's n: rows l%8 + (l//16)*8 (+16 per pair), chunk 2kd + (l//8)%2) and ``bt_{c}`` (B
    from rows that are mma's k, with .trans: rows l%8 + ((l//8)%2)*8 (+16 per step), chunk 2c + l//16)."""
    mask = swizzle_mask(d)
    src = ["rq = warp * 16 + (lane & 15)", "rk = (lane & 7) + ((lane >> 4) << 3)",
           "rv = (lane & 7) + (((lane >> 3) & 1) << 3)", f"sw = lane & 7 & {mask}"]
    src += [f"bc_{kd} = rk * {d} + (({2 * kd} + ((lane >> 3) & 1)) ^ sw) * 8" for kd in range(d // 16)]
    src += [f"bt_{c} = rv * {d} + (({2 * c} + (lane >> 4)) ^ sw) * 8" for c in range(d // 16)]
    return src


def _a_frags(name: str, base: str, d: int) -> list[str]:
    mask = swizzle_mask(d)
    regs = lambda p: ", ".join(f"{p}_{r}" for r in range(4))  # noqa: E731
    return [f"{regs(f'{name}{kd}')} = ldmatrix_x4(Sm, {base} + rq * {d} + (({2 * kd} + (lane >> 4)) ^ (rq & {mask})) * 8)"
            for kd in range(d // 16)]


def _mma_nt(out: str, a: str, base: str, n8: int, d: int) -> list[str]:
    """``out`` tiles (n8 of them) = A (fragments ``{a}{kd}``) times the region at ``base`` (rows = n) transposed."""
    regs = lambda p: ", ".join(f"{p}_{r}" for r in range(4))  # noqa: E731
    src = [f"{regs(f'{out}{j}')} = " + ", ".join(["float32(0.0)"] * 4) for j in range(n8)]
    for p in range(n8 // 2):
        for kd in range(d // 16):
            src += [f"b0, b1, b2, b3 = ldmatrix_x4(Sm, {base} + bc_{kd} + {16 * p * d})",
                    f"{regs(f'{out}{2 * p}')} = mma_bf16({regs(f'{a}{kd}')}, b0, b1, {regs(f'{out}{2 * p}')})",
                    f"{regs(f'{out}{2 * p + 1}')} = mma_bf16({regs(f'{a}{kd}')}, b2, b3, {regs(f'{out}{2 * p + 1}')})"]
    return src


def _mma_nn(acc: str, p: str, base: str, n8: int, d: int) -> list[str]:
    """``acc`` (d/8 tiles) += the packed accumulator tiles ``{p}{j}`` (16 rows x 8 n8 columns) times the
    region at ``base`` (rows = those columns, .trans)."""
    regs = lambda x: ", ".join(f"{x}_{r}" for r in range(4))  # noqa: E731
    src = []
    for s in range(n8 // 2):
        a, c = 2 * s, 2 * s + 1
        src += [f"pa0 = pack_bf16x2({p}{a}_0, {p}{a}_1)", f"pa1 = pack_bf16x2({p}{a}_2, {p}{a}_3)",
                f"pa2 = pack_bf16x2({p}{c}_0, {p}{c}_1)", f"pa3 = pack_bf16x2({p}{c}_2, {p}{c}_3)"]
        for cc in range(d // 16):
            src += [f"v0, v1, v2, v3 = ldmatrix_x4_trans(Sm, {base} + bt_{cc} + {16 * s * d})",
                    f"{regs(f'{acc}{2 * cc}')} = mma_bf16(pa0, pa1, pa2, pa3, v0, v1, {regs(f'{acc}{2 * cc}')})",
                    f"{regs(f'{acc}{2 * cc + 1}')} = mma_bf16(pa0, pa1, pa2, pa3, v2, v3, {regs(f'{acc}{2 * cc + 1}')})"]
    return src


def _store_rows(out: str, acc: str, d: int, r0: str, r1: str, scale: str) -> list[str]:
    src = ["cl = 2 * tq"]
    for n in range(d // 8):
        src += [f"store_pair({out}, {r0}, cl + {8 * n}, T, {acc}{n}_0 * {scale}, {acc}{n}_1 * {scale})",
                f"store_pair({out}, {r1}, cl + {8 * n}, T, {acc}{n}_2 * {scale}, {acc}{n}_3 * {scale})"]
    return src


def _indent(lines: list[str], n: int) -> list[str]:
    return [" " * n + x for x in lines]


def _dq_source(d: int, t: FlashBf16Tiles, async_: bool) -> str:
    BKV, BQ, TH = t.bkv, t.bq, t.threads
    NS = BKV // 8
    STAGE = 2 * BKV * d
    QOFF = 2 * STAGE
    DOFF = QOFF + BQ * d
    elems = 4 * BKV * d + 2 * BQ * d
    dyn = 2 * elems > STATIC_SMEM
    src = ["def kernel(q, k, v, do, lse, dsum, dq, scale2, scale, group):",
           f"    Sm = cuda.shared.array({0 if dyn else elems}, uint16{'' if simulating() else ', alignment=16'})",
           "    tid = cuda.threadIdx.x", "    lane = tid & 31", "    warp = tid >> 5", "    g = lane >> 2",
           "    tq = lane & 3", "    T = q.shape[1]",
           f"    qt = (T + {BQ - 1}) // {BQ} - 1 - cuda.blockIdx.x",
           "    h = cuda.blockIdx.y", "    b = cuda.blockIdx.z", "    hk = h // group",
           "    qg = q[b, :, h, :]", "    dog = do[b, :, h, :]", "    kg = k[b, :, hk, :]", "    vg = v[b, :, hk, :]",
           "    dqg = dq[b, :, h, :]", f"    q0 = qt * {BQ}", f"    nkt = (min(T, q0 + {BQ}) + {BKV - 1}) // {BKV}",
           "    row0 = q0 + warp * 16 + g", "    row1 = row0 + 8"]
    src += _indent(_fetch_setup("q", BQ, TH, d) + _fetch_setup("k", BKV, TH, d) + _offsets(d), 4)
    src += _indent(_fetch("q", "q0", "qg", str(QOFF), BQ, TH, d, async_)
                   + _fetch("q", "q0", "dog", str(DOFF), BQ, TH, d, async_) + ["cp_async_commit()"]
                   + _fetch("k", "0", "kg", "0", BKV, TH, d, async_) + _fetch("k", "0", "vg", str(BKV * d), BKV, TH, d, async_)
                   + ["cp_async_commit()", "cp_async_wait(1)", "cuda.syncthreads()"]
                   + _a_frags("qa", str(QOFF), d) + _a_frags("da", str(DOFF), d)
                   + [f"e0 = row_stat(lse, b, h, row0, T) * float32({LOG2E})",
                      f"e1 = row_stat(lse, b, h, row1, T) * float32({LOG2E})",
                      "D0 = row_stat(dsum, b, h, row0, T)", "D1 = row_stat(dsum, b, h, row1, T)"]
                   + [f"dq{n}_0, dq{n}_1, dq{n}_2, dq{n}_3 = " + ", ".join(["float32(0.0)"] * 4) for n in range(d // 8)], 4)
    body = ["if it + 1 < nkt:", f"    k0r = (it + 1) * {BKV}", f"    sn = ((it + 1) & 1) * {STAGE}"]
    body += _indent(_fetch("k", "k0r", "kg", "sn", BKV, TH, d, async_)
                    + _fetch("k", "k0r", "vg", f"sn + {BKV * d}", BKV, TH, d, async_), 4)
    body += ["cp_async_commit()", "cp_async_wait(1)", "cuda.syncthreads()",
             f"sb = (it & 1) * {STAGE}", f"k0 = it * {BKV}"]
    body += _mma_nt("s", "qa", "sb", NS, d)
    body += [f"s{j}_{r} *= scale2" for j in range(NS) for r in range(4)]
    body += [f"if k0 + {BKV - 1} > q0:", "    kc = k0 + 2 * tq"]
    body += [f"    s{j}_{r} = masked(s{j}_{r}, kc + {8 * j + (r & 1)}, row{r >> 1}, T)" for j in range(NS) for r in range(4)]
    body += [f"s{j}_{r} = exp2_approx(s{j}_{r} - e{r >> 1})" for j in range(NS) for r in range(4)]
    body += _mma_nt("t", "da", f"sb + {BKV * d}", NS, d)
    body += [f"s{j}_{r} = s{j}_{r} * (t{j}_{r} - D{r >> 1})" for j in range(NS) for r in range(4)]
    body += _mma_nn("dq", "s", "sb", NS, d)
    body += ["cuda.syncthreads()"]
    src += ["    for it in range(nkt):"] + _indent(body, 8)
    src += _indent(["cp_async_wait(0)"] + _store_rows("dqg", "dq", d, "row0", "row1", "scale"), 4)
    return "\n".join(src) + "\n"


def _dkv_source(d: int, t: FlashBf16Tiles, async_: bool, extra: int = 0) -> str:
    """The dK/dV kernel; ``extra``: b16 elements of shared memory after its own (the fused kernel's dS^T)."""
    BK, BQI, TH = t.bq, t.bkv, t.threads  # keys per block (16 per warp), queries per streamed tile
    NS = BQI // 8
    VOFF = BK * d
    SOFF = 2 * BK * d
    STAGE = 2 * BQI * d  # Q then dO
    elems = SOFF + 2 * STAGE + extra
    # the streamed query tile's row statistics (lse, then rowsum(dO o O)), two stages of
    # 2 x BQI float32 after Sm: loaded once a tile, not per n8 column and lane. Static beside Sm
    # while both fit the 48 KiB of static shared memory, else in the dynamic allocation after Sm
    # (the kernel's dynamic arrays alias one another): :func:`backward_smem_bytes` counts them
    dyn = 2 * elems + 16 * BQI > STATIC_SMEM
    sto = elems // 2 if dyn else 0  # St's first float
    # by 4-byte cp.async in the same commit group as the tile's Q and dO (a plain load here made
    # the loading warps wait for it before the barrier, every tile), zero past T
    stats = lambda st, h, q0: [f"for i_ in range(tid, {BQI}, {TH}):",  # noqa: E731
                               f"    gq_ = {q0} + i_", "    okq = gq_ < T", "    gq_ = gq_ if okq else 0",
                               "    nq_ = 4 if okq else 0",
                               f"    cp_async4(St, {sto} + {st} + i_, lsb, {h}, gq_, nq_)",
                               f"    cp_async4(St, {sto} + {st} + {BQI} + i_, dsb, {h}, gq_, nq_)"]
    src = ["def kernel(q, k, v, do, lse, dsum, dk, dv, scale2, scale, group):",
           f"    Sm = cuda.shared.array({0 if dyn else elems}, uint16{'' if simulating() else ', alignment=16'})",
           f"    St = cuda.shared.array({0 if dyn else 4 * BQI}, float32)",
           "    tid = cuda.threadIdx.x", "    lane = tid & 31", "    warp = tid >> 5", "    g = lane >> 2",
           "    tq = lane & 3", "    T = q.shape[1]",
           "    hk = cuda.blockIdx.y", "    b = cuda.blockIdx.z", "    hq0 = hk * group", "    gq = group",
           f"    k0 = cuda.blockIdx.x * {BK}",  # the first key tiles have the most queries: they start first
           "    kg = k[b, :, hk, :]", "    vg = v[b, :, hk, :]", "    dkg = dk[b, :, hk, :]", "    dvg = dv[b, :, hk, :]",
           "    lsb = lse[b]", "    dsb = dsum[b]",
           "    key0 = k0 + warp * 16 + g", "    key1 = key0 + 8",
           f"    qi0 = k0 // {BQI}", f"    nit = (T + {BQI - 1}) // {BQI} - qi0", "    total = gq * nit"]
    src += _indent(_fetch_setup("k", BK, TH, d) + _fetch_setup("q", BQI, TH, d) + _offsets(d), 4)
    src += _indent(_fetch("k", "k0", "kg", "0", BK, TH, d, async_) + _fetch("k", "k0", "vg", str(VOFF), BK, TH, d, async_)
                   + ["cp_async_commit()"]
                   + ["qgn = q[b, :, hq0, :]", "dgn = do[b, :, hq0, :]", f"q0r = qi0 * {BQI}"]
                   + _fetch("q", "q0r", "qgn", str(SOFF), BQI, TH, d, async_)
                   + _fetch("q", "q0r", "dgn", str(SOFF + BQI * d), BQI, TH, d, async_)
                   + stats("0", "hq0", "q0r") + ["cp_async_commit()", "cp_async_wait(1)", "cuda.syncthreads()"]
                   + ["ch = hq0", "cq = q0r"]

                   + [f"{a}{n}_0, {a}{n}_1, {a}{n}_2, {a}{n}_3 = " + ", ".join(["float32(0.0)"] * 4)
                      for a in ("dk", "dv") for n in range(d // 8)], 4)
    # (head, query tile) of this step (ch, cq) and the next (hn, q0r), stepped by adds: the walk is
    # every query tile from qi0 of head hq0, then of the next head (an int64 // and % by nit, four
    # a step, were most of the loop's integer instructions: scripts/sass_report.py flash-bf16-backward)
    body = [f"q0r = cq + {BQI}", "hn = ch", "if q0r >= T:", f"    q0r = qi0 * {BQI}", "    hn = ch + 1",
            "if it + 1 < total:", "    qgn = q[b, :, hn, :]", "    dgn = do[b, :, hn, :]",
            f"    sn = {SOFF} + ((it + 1) & 1) * {STAGE}"]
    body += _indent(_fetch("q", "q0r", "qgn", "sn", BQI, TH, d, async_)
                    + _fetch("q", "q0r", "dgn", f"sn + {BQI * d}", BQI, TH, d, async_)
                    + stats(f"((it + 1) & 1) * {2 * BQI}", "hn", "q0r"), 4)
    body += ["cp_async_commit()", "cp_async_wait(1)", "cuda.syncthreads()",
             "hq = ch", "qs = cq", "ch = hn", "cq = q0r", f"sb = {SOFF} + (it & 1) * {STAGE}",
             "qc = qs + 2 * tq", f"ss = {sto} + (it & 1) * {2 * BQI} + 2 * tq"]
    body += _a_frags("ka", "0", d)  # re-read each tile, as V's below
    body += _mma_nt("s", "ka", "sb", NS, d)  # S^T: rows keys, columns queries
    body += [f"s{j}_{r} *= scale2" for j in range(NS) for r in range(4)]
    body += [f"if qs < k0 + {BK - 1} or qs + {BQI} > T:"]
    body += [f"    s{j}_{r} = masked_t(s{j}_{r}, key{r >> 1}, qc + {8 * j + (r & 1)}, T)" for j in range(NS) for r in range(4)]
    # the columns' statistics, from the tile's copy in St
    for j in range(NS):
        body += [f"l0 = St[ss + {8 * j}] * float32({LOG2E})", f"l1 = St[ss + {8 * j + 1}] * float32({LOG2E})"]
        body += [f"s{j}_{r} = exp2_approx(s{j}_{r} - l{r & 1})" for r in range(4)]
    body += _mma_nn("dv", "s", f"sb + {BQI * d}", NS, d)  # dV += P^T dO
    # K's and V's fragments re-read from shared memory each tile (D/16 ldmatrix each): held in
    # registers beside the two accumulators they spilled at D = 128 (ptxas sm_90: 432 bytes)
    body += _a_frags("va", str(VOFF), d)
    body += _mma_nt("t", "va", f"sb + {BQI * d}", NS, d)  # dP^T = V dO^T
    for j in range(NS):
        body += [f"D0 = St[ss + {BQI + 8 * j}]", f"D1 = St[ss + {BQI + 8 * j + 1}]"]
        body += [f"s{j}_{r} = s{j}_{r} * (t{j}_{r} - D{r & 1})" for r in range(4)]
    body += _mma_nn("dk", "s", "sb", NS, d)  # dK += dS^T Q
    body += ["cuda.syncthreads()"]
    src += ["    for it in range(total):"] + _indent(body, 8)
    src += _indent(["cp_async_wait(0)"] + _store_rows("dkg", "dk", d, "key0", "key1", "scale")
                   + _store_rows("dvg", "dv", d, "key0", "key1", "float32(1.0)"), 4)
    return "\n".join(src) + "\n"


def _dq_split(d: int, t: FlashBf16Tiles) -> tuple[int, int, int]:
    """How the fused kernel's warps share a tile's dQ (``bkv`` queries x d): (row groups of 16 a warp,
    column parts a row group is cut into, n8-pair columns a part); refused unless the warps and the
    row groups divide one another and a part is whole n8 pairs."""
    rows, w = t.bkv // ROWS, t.warps
    if rows >= w and rows % w == 0:
        return rows // w, 1, d // 16
    if w % rows == 0 and (d // 16) % (w // rows) == 0:
        return 1, w // rows, d // 16 // (w // rows)
    raise KernelError(f"flash tiles {t} with head_dim={d}: the fused backward needs the warps ({w}) and the dQ tile's "
                      f"{rows} row groups of 16 to divide one another, and whole n8 pairs of the {d} columns a warp")


def _dkvq_source(d: int, t: FlashBf16Tiles, async_: bool, split: bool = False) -> str:
    """The dK/dV kernel with dQ fused in (FlashAttention-2's backward): after dK += dS^T Q, each warp
    stores its dS^T rows (bf16) in shared memory, and the block computes this query tile's dQ
    partial, dS K, from there (A by ldmatrix.trans of dS^T, B by ldmatrix.trans of K, already in
    shared memory), added atomically into the fp32 ``dqa`` (B, T, nh, D) unscaled; the convert
    kernel scales and rounds it. Two of the two-kernel backward's seven products (the dQ kernel's
    S and dP) are not computed again. ``split``: a block per query head instead of per GQA group
    (``group`` times the blocks), each block's dK and dV partials added atomically, once at its
    end, into the fp32 ``dka`` and ``dva`` (B, T, nkv, D), scaled and rounded after."""
    BK, BQI, TH = t.bq, t.bkv, t.threads
    W = t.warps
    per_warp, parts, npc = _dq_split(d, t)
    rows = BQI // ROWS
    DSOFF = 2 * BK * d + 4 * BQI * d
    mq = min(7, BQI // 8 - 1)  # dS^T's rows are BQI elements: chunk c of row r is stored at c ^ (r & mq)
    src = _dkv_source(d, t, async_, extra=BK * BQI).splitlines()
    src[0] = "def kernel(q, k, v, do, lse, dsum, dk, dv, dqa, dka, dva, scale2, scale, group):"
    if split:
        swap = {"    hk = cuda.blockIdx.y": "    hk = cuda.blockIdx.y // group", "    hq0 = hk * group": "    hq0 = cuda.blockIdx.y",
                "    gq = group": "    gq = 1"}
        src = [swap.get(x, x) for x in src]
        tail = src.index("    cp_async_wait(0)")
        src[tail + 1:] = []
        for acc, out in (("dk", "dka"), ("dv", "dva")):
            src += ["    cl = 2 * tq"]
            for n in range(d // 8):
                src += [f"    add_pair({out}, b, key0, hk, cl + {8 * n}, T, {acc}{n}_0, {acc}{n}_1)",
                        f"    add_pair({out}, b, key1, hk, cl + {8 * n}, T, {acc}{n}_2, {acc}{n}_3)"]
    setup = ["swq = lane & " + str(mq),
             "dsa = " + str(DSOFF) + f" + rk * {BQI}"]  # dS^T rows of a key step (rk: ldmatrix's row per lane)
    if parts > 1:
        setup += [f"dqr = warp % {rows}", f"cpart = warp // {rows}"]
    else:
        setup += ["dqr = warp", "cpart = 0"]
    setup += [f"kb_{c} = rv * {d} + ((2 * (cpart * {npc} + {c}) + (lane >> 4)) ^ sw) * 8" for c in range(npc)]
    loop = src.index("    for it in range(total):")
    src[loop:loop] = _indent(setup, 4)
    loop += len(setup)
    end = next(i for i in range(loop + 1, len(src)) if src[i].startswith("    cp_async_wait(0)"))
    assert src[end - 1].strip() == "cuda.syncthreads()", src[end - 1]
    body = []
    for j in range(BQI // 8):  # dS^T (rows: this warp's keys; columns: the tile's queries) as bf16
        for half, r in ((0, "key0 - k0"), (1, "key1 - k0")):
            body += [f"pk = pack_bf16x2(s{j}_{2 * half}, s{j}_{2 * half + 1})",
                     f"o_ = {DSOFF} + ({r}) * {BQI} + (({j} ^ (g & {mq})) << 3) + 2 * tq",
                     "Sm[o_] = uint16(pk & 0xFFFF)", "Sm[o_ + 1] = uint16(pk >> 16)"]
    body += ["cuda.syncthreads()"]
    for u in range(per_warp):
        qr = f"dqr + {u * W}" if u else "dqr"
        body += [f"dch = ((2 * ({qr}) + ((lane >> 3) & 1)) ^ swq) << 3",
                 f"qrow0 = qs + ({qr}) * 16 + g", "qrow1 = qrow0 + 8"]
        for ks in range(BK // 16):
            body += [f"da{ks}_0, da{ks}_1, da{ks}_2, da{ks}_3 = ldmatrix_x4_trans(Sm, dsa + {16 * ks * BQI} + dch)"]
        for c in range(npc):
            body += ["x0, x1, x2, x3 = " + ", ".join(["float32(0.0)"] * 4),
                     "y0, y1, y2, y3 = " + ", ".join(["float32(0.0)"] * 4)]
            for ks in range(BK // 16):
                a = f"da{ks}_0, da{ks}_1, da{ks}_2, da{ks}_3"
                body += [f"v0, v1, v2, v3 = ldmatrix_x4_trans(Sm, kb_{c} + {16 * ks * d})",
                         f"x0, x1, x2, x3 = mma_bf16({a}, v0, v1, x0, x1, x2, x3)",
                         f"y0, y1, y2, y3 = mma_bf16({a}, v2, v3, y0, y1, y2, y3)"]
            body += [f"cl = (cpart * {npc} + {c}) * 16 + 2 * tq",
                     "add_pair(dqa, b, qrow0, hq, cl, T, x0, x1)", "add_pair(dqa, b, qrow1, hq, cl, T, x2, x3)",
                     "add_pair(dqa, b, qrow0, hq, cl + 8, T, y0, y1)", "add_pair(dqa, b, qrow1, hq, cl + 8, T, y2, y3)"]
    src[end - 1:end - 1] = _indent(body, 8)
    return "\n".join(src) + "\n"


@cuda.jit(device=True)
def add_pair(a, b, row, h, col, t, v0, v1):
    """``a[b, row, h, col:col+2] += (v0, v1)`` atomically (one vector ``red``), if the row is inside T."""
    if row < t:
        _mma.red_add_f32x2(a, b, row, h, col, v0, v1)


@fastlaunch.jit
def _zero_kernel(a):
    for e in range(cuda.grid(1), a.size, cuda.gridsize(1)):
        a[e] = float32(0.0)


@fastlaunch.jit
def _convert_kernel(src, dst, scale):
    """dst = bf16(src * scale), element by element (src: a fused backward's fp32 sums; 4-D arrays)."""
    b_, t_, nh, d = src.shape
    for e in range(cuda.grid(1), b_ * t_ * nh * d, cuda.gridsize(1)):
        i = e % d
        h = (e // d) % nh
        t = (e // (d * nh)) % t_
        b = e // (d * nh * t_)
        dst[b, t, h, i] = uint16(_mma.pack_bf16x2(src[b, t, h, i] * scale, float32(0.0)) & 0xFFFF)


@fastlaunch.jit
def _convert_flat_kernel(src, dst, scale):
    """:func:`_convert_kernel` on 1-D views of C-contiguous arrays, two elements a thread."""
    for e in range(cuda.grid(1), dst.size // 2, cuda.gridsize(1)):
        pk = _mma.pack_bf16x2(src[2 * e] * scale, src[2 * e + 1] * scale)
        dst[2 * e] = uint16(pk & 0xFFFF)
        dst[2 * e + 1] = uint16(pk >> 16)
    if cuda.grid(1) == 0 and dst.size % 2:
        dst[dst.size - 1] = uint16(_mma.pack_bf16x2(src[dst.size - 1] * scale, float32(0.0)) & 0xFFFF)


def _converter(src, dst, scale, grid: int, threads: int, stream):
    """A launch of dst = bf16(src * scale): flat when both are C-contiguous."""
    if src.is_c_contiguous() and dst.is_c_contiguous():
        fs, fd = src.reshape(src.size), dst.reshape(dst.size)
        return lambda: _convert_flat_kernel[grid, threads, stream](fs, fd, scale)
    return lambda: _convert_kernel[grid, threads, stream](src, dst, scale)


def _build(source: str, label: str):
    names = kernel_namespace()
    names.update({"masked_t": masked_t, "row_stat": row_stat, "add_pair": add_pair})
    return generated_function(source, label, names)


def python_backward_kernels(d: int, tiles: FlashBf16Tiles, cp_async: bool = True):
    """(dq kernel, dk/dv kernel) as plain Python functions (before ``cuda.jit``)."""
    tiles.check(d)
    tag = f"d{d} {tiles.label()}{'' if cp_async else ' elementwise'}"
    return (_build(_dq_source(d, tiles, cp_async), f"<flash_bf16 dq {tag}>"),
            _build(_dkv_source(d, tiles, cp_async), f"<flash_bf16 dkv {tag}>"))


@lru_cache(maxsize=None)
def make_flash_bf16_backward(d: int, tiles: FlashBf16Tiles, cp_async: bool = True):
    opts = {} if simulating() else {"max_registers": 255}
    return tuple(fastlaunch.fast(_cuda_cache.cached(cuda.jit(**opts)(fn))) for fn in python_backward_kernels(d, tiles, cp_async))


@lru_cache(maxsize=None)
def make_flash_bf16_fused_backward(d: int, tiles: FlashBf16Tiles, cp_async: bool = True, split: bool = False):
    """The fused dK/dV/dQ kernel (:func:`_dkvq_source`) for head_dim ``d``."""
    tiles.check(d)
    _dq_split(d, tiles)
    tag = f"d{d} {tiles.label()}{'' if cp_async else ' elementwise'}{' split' if split else ''}"
    fn = _build(_dkvq_source(d, tiles, cp_async, split), f"<flash_bf16 dkvq {tag}>")
    opts = {} if simulating() else {"max_registers": 255}
    return fastlaunch.fast(_cuda_cache.cached(cuda.jit(**opts)(fn)))


def backward_smem_bytes(d: int, tiles: FlashBf16Tiles) -> tuple[int, int]:
    """Shared bytes of the dq kernel and of the dk/dv kernel (its operands, then two stages of the
    query tile's statistics: 16 bytes a query)."""
    return 2 * (4 * tiles.bkv * d + 2 * tiles.bq * d), 2 * (2 * tiles.bq * d + 4 * tiles.bkv * d) + 16 * tiles.bkv


def fused_smem_bytes(d: int, tiles: FlashBf16Tiles) -> int:
    """Shared bytes of the fused dK/dV/dQ kernel: the dK/dV kernel's and a tile of dS^T."""
    return backward_smem_bytes(d, tiles)[1] + 2 * tiles.bq * tiles.bkv


def _launcher(kernel, args, grid, threads: int, nbytes: int, stream):
    """A launch of ``kernel`` with ``nbytes`` of shared memory (dynamic when over the static limit)."""
    def launch():
        if nbytes > STATIC_SMEM:
            _allow_dynamic_smem(kernel, args, nbytes)
            kernel[grid, threads, stream, nbytes](*args)
        else:
            kernel[grid, threads, stream](*args)
    return launch


def flash_attention_bf16_backward(q, k, v, o, lse, do, dq, dk, dv, stream=0, tiles: FlashBf16Tiles | None = None,
                                  cp_async: bool | None = None, dsum=None, dkv_tiles: FlashBf16Tiles | None = None,
                                  fused: bool = False, dq_accum=None, split_heads: bool = False) -> None:
    """Enqueue the gradients of :func:`flash_attention_bf16`: q, o, do, dq (B, T, nh, D) and k, v,
    dk, dv (B, T, nkv, D) bf16 bits, ``lse`` (B, nh, T) float32 from the forward. ``dsum``: a
    (B, nh, T) float32 scratch for ``rowsum(do * o)`` (allocated when not given). dk and dv sum
    the query heads of each GQA group in registers; every output is written once. ``tiles`` is the
    dQ kernel's (``warps`` x 16 query rows a block, ``bkv`` keys streamed), ``dkv_tiles`` the dK/dV
    kernel's (``warps`` x 16 keys a block, ``bkv`` queries streamed; ``tiles`` when not given).

    ``fused=True``: one kernel computes dK, dV and dQ (dQ added atomically into ``dq_accum``, a
    (B, T, nh, D) float32 scratch allocated when not given, then scaled and rounded into ``dq``), on
    ``dkv_tiles`` (or ``tiles``); ``tiles`` is then not used for a dQ kernel. Its sums' order
    varies from run to run (the atomics), by fp32 noise before dQ's bf16 rounding.
    ``split_heads=True`` (fused only): a block per query head rather than per GQA group, dK and dV
    added atomically into fp32 scratch too (for GQA at short T, where a block per group leaves
    SMs idle)."""
    for _name, launch in backward_launches(q, k, v, o, lse, do, dq, dk, dv, stream, tiles, cp_async, dsum, dkv_tiles,
                                           fused, dq_accum, split_heads):
        launch()


def backward_launches(q, k, v, o, lse, do, dq, dk, dv, stream=0, tiles: FlashBf16Tiles | None = None,
                      cp_async: bool | None = None, dsum=None, dkv_tiles: FlashBf16Tiles | None = None,
                      fused: bool = False, dq_accum=None, split_heads: bool = False) -> list:
    """The backward's launches, checked and ready, as ``[(name, launch), ...]`` in the order they must
    run ("dsum", "dq", "dkv"; fused: "dsum" (which zeroes ``dq_accum``), "dkvq", "dq", and with
    ``split_heads`` "zero" before "dkvq" and "dk", "dv" after it; none when the
    inputs are empty): :func:`flash_attention_bf16_backward` runs them all; a benchmark can time each."""
    b, t, nh, nkv, d = check_args(q, k, v, o, lse)
    if lse is None:
        raise KernelError("flash_attention_bf16_backward: lse (B, nh, T) from the forward is required")
    for name, a, want in (("do", do, q.shape), ("dq", dq, q.shape), ("dk", dk, k.shape), ("dv", dv, k.shape)):
        check_bf16(f"flash_attention_bf16_backward: {name}", a)
        if tuple(a.shape) != tuple(want):
            raise KernelError(f"flash_attention_bf16_backward: {name} has shape {tuple(a.shape)}, expected {tuple(want)}")
    tiles = tiles or default_tiles()
    dkv_tiles = dkv_tiles or tiles
    for tl in (tiles, dkv_tiles):
        tl.check(d)
    if split_heads and not fused:
        raise KernelError("flash_attention_bf16_backward: split_heads=True needs fused=True")
    if fused:
        _dq_split(d, dkv_tiles)
        need = {"dkvq": fused_smem_bytes(d, dkv_tiles)}
        parts = ((dkv_tiles, need["dkvq"]),)
    else:
        need = {"dq": backward_smem_bytes(d, tiles)[0], "dkv": backward_smem_bytes(d, dkv_tiles)[1]}
        parts = ((tiles, need["dq"]), (dkv_tiles, need["dkv"]))
    for part, (tl, nbytes) in zip(need, parts):
        if nbytes > MAX_SMEM:
            raise KernelError(f"flash tiles {tl} with head_dim={d}: the backward's {part} kernel needs {nbytes} bytes "
                              f"of shared memory (limit {MAX_SMEM})")
    if b * t * nh == 0:
        return []
    if dsum is None:
        dsum = cuda.device_array((b, nh, t), np.float32, stream=stream)
    check_float32("flash_attention_bf16_backward: dsum", dsum)
    if tuple(dsum.shape) != (b, nh, t):
        raise KernelError(f"flash_attention_bf16_backward: dsum has shape {tuple(dsum.shape)}, expected {(b, nh, t)}")
    q, k, v, o, do, dq, dk, dv = (as_u16(x) for x in (q, k, v, o, do, dq, dk, dv))
    fits = all(_aligned_rows(x) for x in (q, k, v, do))
    if cp_async and not fits:
        raise KernelError("flash_attention_bf16_backward: cp_async=True needs q, k, v, do with unit head-dim stride, "
                          "other strides multiples of 8 elements and 16-byte-aligned bases")
    async_ = fits if cp_async is None else cp_async
    n = b * t * nh
    threads = 32 if simulating() else 256
    dsum_grid = max(1, min(-(-8 * n // threads), 2 if simulating() else 132 * 16))
    scale2, scale, group = np.float32(LOG2E / math.sqrt(d)), np.float32(1.0 / math.sqrt(d)), np.int64(nh // nkv)
    if fused:
        if dq_accum is None:
            dq_accum = cuda.device_array((b, t, nh, d), np.float32, stream=stream)
        check_float32("flash_attention_bf16_backward: dq_accum", dq_accum)
        if not dq_accum.is_c_contiguous():
            raise KernelError("flash_attention_bf16_backward: dq_accum must be C-contiguous (its pairs are added "
                              f"8 bytes at a time), got strides {dq_accum.strides}")
        base = 0 if simulating() else dq_accum.__cuda_array_interface__["data"][0]
        if base % 8:
            raise KernelError(f"flash_attention_bf16_backward: dq_accum must start on 8 bytes (its pairs are added "
                              f"8 bytes at a time), got address {base:#x}")
        if tuple(dq_accum.shape) != (b, t, nh, d):
            raise KernelError(f"flash_attention_bf16_backward: dq_accum has shape {tuple(dq_accum.shape)}, "
                              f"expected {(b, t, nh, d)}")
        k_f = make_flash_bf16_fused_backward(d, dkv_tiles, async_, split_heads)
        dkva = cuda.device_array((2, b, t, nkv, d), np.float32, stream=stream) if split_heads else None
        dka, dva = (dkva[0], dkva[1]) if split_heads else (dq_accum, dq_accum)  # unused unless split
        args = (q, k, v, do, lse, dsum, dk, dv, dq_accum, dka, dva, scale2, scale, group)
        grid = (-(-t // dkv_tiles.bq), nh if split_heads else nkv, b)
        fused_launch = _launcher(k_f, args, grid, dkv_tiles.threads, need["dkvq"], stream)
        conv_grid = max(1, min(-(-n * d // threads), 2 if simulating() else 132 * 16))
        launches = [("dsum", lambda: _dsum_kernel[dsum_grid, threads, stream](o, do, dsum, dq_accum, True))]
        if split_heads:
            flat = dkva.reshape(dkva.size)
            launches += [("zero", lambda: _zero_kernel[conv_grid, threads, stream](flat))]
        launches += [("dkvq", fused_launch), ("dq", _converter(dq_accum, dq, scale, conv_grid, threads, stream))]
        if split_heads:
            launches += [("dk", _converter(dka, dk, scale, conv_grid, threads, stream)),
                         ("dv", _converter(dva, dv, np.float32(1.0), conv_grid, threads, stream))]
        return launches
    k_dq = make_flash_bf16_backward(d, tiles, async_)[0]
    k_dkv = make_flash_bf16_backward(d, dkv_tiles, async_)[1]
    return [("dsum", lambda: _dsum_kernel[dsum_grid, threads, stream](o, do, dsum, _dummy_lse(4), False)),
            ("dq", _launcher(k_dq, (q, k, v, do, lse, dsum, dq, scale2, scale, group), (-(-t // tiles.bq), nh, b),
                             tiles.threads, need["dq"], stream)),
            ("dkv", _launcher(k_dkv, (q, k, v, do, lse, dsum, dk, dv, scale2, scale, group),
                              (-(-t // dkv_tiles.bq), nkv, b), dkv_tiles.threads, need["dkv"], stream))]

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

Under the simulator the kernel runs the intrinsics' twins (:mod:`._mma`): one warp, 16 keys a tile.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from numba import cuda, float32, uint16

from vmstoolkit.errors import KernelError

from . import _mma
from ._util import check_float32, check_ndim, simulating
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


_NAMES = ("mma_bf16", "ldmatrix_x4", "ldmatrix_x4_trans", "cp_async16", "cp_async_commit", "cp_async_wait",
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
    code = compile(source, f"<flash_bf16 d{d} {tiles.label()}{'' if cp_async else ' elementwise'}>", "exec")
    exec(code, names)  # noqa: S102 - the source is generated above from the tile constants alone
    fn = names["kernel"]
    fn.__doc__ = source
    return fn


@lru_cache(maxsize=None)
def make_flash_bf16(d: int, tiles: FlashBf16Tiles, with_lse: bool = True, cp_async: bool = True):
    """The kernel ``kernel(q, k, v, o, lse, scale2, group)`` for head_dim ``d``; grid
    ``(ceil(T / bq), nh, B)``, ``tiles.threads`` threads, ``tiles.smem_bytes(d)`` of shared memory
    (dynamic when over 48 KiB)."""
    fn = python_kernel(d, tiles, with_lse, cp_async)
    opts = {} if simulating() else {"max_registers": 255}
    return cuda.jit(**opts)(fn)


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
    lse_arg = lse if lse is not None else cuda.device_array((1, 1, 1), np.float32) if simulating() else _dummy_lse()
    args = (q, k, v, o, lse_arg, np.float32(LOG2E / math.sqrt(d)), np.int64(nh // nkv))
    grid = (-(-t // tiles.bq), nh, b)
    if tiles.dynamic(d):
        _allow_dynamic_smem(kernel, args, tiles.smem_bytes(d))
        kernel[grid, tiles.threads, stream, tiles.smem_bytes(d)](*args)
    else:
        kernel[grid, tiles.threads, stream](*args)


_DUMMY: dict = {}


def _dummy_lse():
    """A (1, 1, 1) float32 device array standing in for ``lse`` when none is asked (never written)."""
    dev = cuda.get_current_device().id
    if dev not in _DUMMY:
        _DUMMY[dev] = cuda.device_array((1, 1, 1), np.float32)
    return _DUMMY[dev]

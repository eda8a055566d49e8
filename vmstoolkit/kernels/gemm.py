"""GEMMs of ``nn.Linear`` and its backward, float32, one register-blocked kernel for all three.

- ``gemm``: ``y = x @ w.T`` (forward): x (M, K), w (N, K), y (M, N);
- ``linear_dx``: ``dx = dy @ w`` (+ ``acc``): dy (M, N), w (N, K), dx (M, K);
- ``linear_dw``: ``dw = dy.T @ x`` (+ ``acc``, an existing gradient): dy (M, N), x (M, K), dw (N, K).

Recipe: the numpy references (``reference.linear``, ``reference.linear_backward_x`` / ``_w``), one
kernel factory (:func:`make_gemm`), a launch rule (:func:`choose`), three launchers and
``validate()`` / ``validate_backward()`` against the references over ragged shapes.

One kernel computes ``C (R, C) = [acc +] A @ B`` where A is stored (R, K) ("n") or (K, R) ("t")
and B (C, K) ("n") or (K, C) ("t"): the forward is n/n, ``linear_dx`` n/t, ``linear_dw`` t/t.
Only the global loads differ per layout; shared slices are k-major in every case, so the inner
loop is the same.

Register blocking: a block of ``(bm // tm) * (bn // tn)`` threads computes a ``bm x bn`` tile of C.
Each k step stages a ``bk``-deep slice of A and of B in shared memory (k-major) and every thread
accumulates a ``tm x tn`` micro-tile in registers: ``tm + tn`` shared loads per ``tm * tn`` FMAs.

Pipeline (issue 5's measured winner, kept by every variant since):

* two shared buffers; the next k slice is fetched from global memory into registers while the
  current one is multiplied, then stored into the other buffer: one barrier per k step and the
  global-load latency hidden behind the FMAs;
* indices are ``uint64``: Numba adds no negative-index wraparound code for unsigned indices (in
  the signed first version the inner loop cost 1.9-2.2 SASS instructions per FFMA), and they are
  never mixed with signed integers, which Numba would promote to float64;
* the k slice is multiplied 4 columns per trip by an inlined device function called 4 times (an
  explicit unroll: NVVM does not unroll a loop whose body is 64 FMAs), and the two shared buffers
  are indexed by constants (two slices per trip of the outer loop), so a shared address is a base
  register plus an immediate;
* a thread's rows (columns) come in runs of ``VEC`` = 4 adjacent ones in 16-byte-aligned shared
  arrays, so every shared load of the inner loop is one ``LDS.128``;
* a thread fetches vectors of up to 4 adjacent elements on 4-aligned indices (along k for an "n"
  operand, along rows for a "t" one), consecutive threads on consecutive vectors; tiles wholly
  inside the matrices skip the bounds checks (a block-uniform branch). NVVM keeps each element
  its own 4-byte ``LDG.E`` (a Numba array's row stride is a run-time value, so it cannot prove a
  vector aligned): variant 11 reads each vector of an interior slice with one ``LDG.E.128``
  (``_vector.load4``) where both operands are 16-byte aligned;
* ``max_registers`` caps registers so that ``blocks_per_sm`` blocks fit on an SM.

At 128x128x8/8x8 (v3) the inner loop is 256 FFMA + 16 LDS.128 + 12 others (1.11 instructions
per FFMA), 126 registers, no spills: two 256-thread blocks per SM. (The FMA loop runs column-major
over the micro-tile: with row-major order the same PTX needs 128 registers and spills 128 bytes
under ptxas 13.0; offline, sm_90.)

Variants: one row each in :data:`VARIANTS` (its flags, its scalar twin), explained and measured
in its own ``Note [GEMM variant N]`` beside the table. The launch rules that pick a variant
and tile shape, with the measurements behind them, are :mod:`.gemm_rules`.

Gone, each slower on the H200 than what stayed (``experiments/results/gemm-h200/``): ``1`` and ``2``
(issue 5's first kernels); ``4`` (``3`` without the register cap, one block per SM: the old rule's
choice for one to three waves); ``6`` (``5`` with whole slices unrolled, bk 8); ``7`` (4 k steps
per fragment-loop trip), ``8`` (interior tiles fetched by flat indices) and ``9`` (both): fewer
instructions per FFMA offline (1.118-1.141 against 1.165), within -2.3 / +1.2 points of ``5`` on
the GPU, so not worth their code; ``10`` (``5`` with the slices of "n" operands stored swizzled,
row r ^ ((k + 1) & 8), so that their transposing stores hit 32 banks instead of 16 twice): below
``5`` at 14 of the 15 7B shapes in sweep 6 (``run6/``: forward 0.5-1.2 points, dx 1.2-2.1, dw
4.2-5.4, where no slice is swizzled but the fragment loop is split in two; +0.3 at q/o forward),
though its stores were conflict-free: the forward's 4-7 point gap to the t/t layout is not the
stores' bank conflicts; ``12`` (``11`` writing whole unsplit tiles with 16-byte stores, one
``STG.E.128`` per 4 outputs, same 232 registers in nt): 80.4 / 78.2 / 74.2% of cuBLAS against
``11``'s 91.6 / 81.8 / 85.1 at dx of 4096^3 / k/v GQA8 / down (``run7/v12/``). Not the stores:
a vector store takes its 4 values from an aligned register quad, ptxas then keeps the
accumulators in quads through the FMA loop, and 635 of its 1024 FFMAs read two sources from one
register bank (``11``: 183; ``scripts/sass_report.py``'s "FFMA bank clashes").

Warp tiling is a property of the tile shape
(``GemmTiles.wm`` / ``wn``): the block's threads are grouped by warp, each warp covering a
``wm x wn`` sub-tile with its 32 threads' micro-tiles strided inside it instead of across the
whole block tile. A warp then reads fewer distinct shared-memory words per load (e.g. 8 + 4
float4 instead of 2 + 16 at 128x128/8x8 with 32x64 warp tiles). ``WARP_TILES`` are candidates
that won on the H200 (the proposed rule's tiles).

Split-K: with ``splits`` > 1 each output tile's k slices are shared among that many blocks, which
add their partial tiles atomically into C (zeroed, or set to ``acc``, by the launcher first).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from numba import cuda, float32, uint64

from vmstoolkit.errors import KernelError

from . import _launch as fastlaunch, reference
from ._util import check_float32, check_ndim, simulating
from ._vector import aligned16, load4, store4
from .gemm_rules import (  # noqa: F401 - the rules' names, also as gemm's (callers use both)
    LAYOUTS, MAX_SPLITS, PROPOSED_TILES, PROPOSED_VARIANT, RULES, SIM_TILES, SKINNY_M_TILES, SKINNY_MAX,
    SKINNY_N_TILES, SKINNY_VARIANT, SMALL_TILES, SPLIT_COST, SPLIT_GAIN, V5_TILES, GemmLaunch, GemmTiles, choose,
    proposed_splits, rule_launch, split_cost, split_target_blocks,
)


# Shared-memory row padding (words): keeps rows 16-byte aligned (LDS.128) and spreads the
# transposed stores of an "n" operand over more banks (with bk = 8 a warp stores 8 k-rows x 4
# columns: 32 distinct banks; 2-way conflicts with bk = 16).
PAD = 4
# A thread's rows (columns) come in runs of VEC adjacent ones, so that NVVM's load/store
# vectoriser turns each run into one 128-bit shared load (ld.shared.v4).
VEC = 4


def max_registers(threads: int, blocks_per_sm: int) -> int:
    """Register cap per thread that lets ``blocks_per_sm`` blocks of ``threads`` share an SM's
    64 Ki registers (allocated per warp in units of 256, i.e. 8 per thread); at most 255."""
    return min(255, 65536 // (blocks_per_sm * threads) // 8 * 8)


def _vector_width(loads: int, run: int) -> int:
    """Largest of 4, 2, 1 dividing both a thread's ``loads`` and the contiguous ``run``."""
    for v in (4, 2, 1):
        if loads % v == 0 and run % v == 0:
            return v
    return 1


def _operand_map(trans: bool, rows: int, bk: int, nt: int):
    """How a thread fetches its share of a (rows x bk) slice of an operand: returns
    ``(V, G, per, stride)``: G vectors of V adjacent elements, contiguous in memory (along k for
    "n", along rows for "t"); ``per`` vectors span one row ("n") or one k ("t"); thread ``tid``
    takes vector ``tid % per`` of row (k) ``tid // per + g * stride``."""
    loads = rows * bk // nt
    run = rows if trans else bk
    v = _vector_width(loads, run)
    per = run // v
    if nt % per:
        raise KernelError(f"{nt} threads cannot share rows of {per} vectors of {v}")
    stride = nt // per
    g = loads // v
    if stride * g != (bk if trans else rows):
        raise KernelError(f"operand slice {rows}x{bk} does not split into {nt} threads x {g} vectors of {v}")
    return v, g, per, stride


def _stage_pitch(n4: int, rows: int, cols: int) -> int:
    """Row pitch (>= ``n4`` words) of variant 13's stage planes with the fewest shared-memory bank
    conflicts when a warp's ``rows x cols`` threads each store one word, at (row, col + const)."""
    def ways(p):
        banks = [(r * p + c) % 32 for r in range(rows) for c in range(cols)]
        return max(banks.count(b) for b in set(banks))
    return min(range(n4, n4 + 32), key=lambda p: (ways(p), p))


@lru_cache(maxsize=None)
def make_gemm(t: GemmTiles, a_trans: bool = False, b_trans: bool = False, accumulate: bool = False,
              blocks_per_sm: int = 2, frag_db: bool = False, edge_checks: bool = True,
              vector_loads: bool = False, staged_stores: bool = False):
    """The kernel ``kernel(a, b, acc_in, c, split_steps)`` computing ``c = [acc_in +] A @ B`` for
    the layouts in the module docstring; ``split_steps`` k slices per block along grid z.
    ``frag_db``: double-buffer the shared-to-register fragments (variant 5, module docstring),
    two k steps per trip of the fragment loop, the slice's remaining steps unrolled after it.
    ``vector_loads``: fetch interior slices with 16-byte loads (``_vector.load4``; variant 11):
    only for operands that pass ``_vector.aligned16``, which the launcher checks.
    ``staged_stores``: a warp-tiled block writes (and reads ``acc_in`` of) a whole unsplit output
    tile row by row through shared memory with 16-byte accesses (variant 13): c and acc_in must
    pass ``aligned16`` too. ``edge_checks=False`` drops the
    bounds-checked fetch: only for ``scripts/sass_report.py``'s interior-tile (hot path) build,
    wrong on any tile not wholly inside the matrices."""
    t.check()
    BM, BN, BK, TM, TN = t.bm, t.bn, t.bk, t.tm, t.tn
    NT = t.threads
    GM, GN = t.group_tile  # rows / columns of one interleaved group of threads
    GTY, GTX = GM // TM, GN // TN  # its threads, by row and by column
    GT = GTY * GTX  # threads per group (a warp, or the whole block)
    GPR = BN // GN  # groups per row of groups
    BMP, BNP = BM + PAD, BN + PAD
    VM = VEC if TM % VEC == 0 else 1  # a thread's rows come in runs of VM adjacent rows
    VN = VEC if TN % VEC == 0 else 1  # and its columns in runs of VN adjacent columns
    SM, SN = GTY * VM, GTX * VN  # distance between two runs of one thread
    AV, AG, APER, ASTR = _operand_map(a_trans, BM, BK, NT)
    BV, BG, BPER, BSTR = _operand_map(b_trans, BN, BK, NT)
    A_LOADS, B_LOADS = AV * AG, BV * BG  # elements of A and of B per thread per slice
    AT, BT, ACC, FDB, EDGE = a_trans, b_trans, accumulate, frag_db, edge_checks
    AVL, BVL = vector_loads and AV == VEC, vector_loads and BV == VEC  # 16-byte fetches of A, of B
    # Variant 13's epilogue (module docstring): per micro-tile row i, each warp stages its GTY
    # rows of GN outputs in shared memory and writes them back as whole rows, one 16-byte store
    # per lane (STAGE_Q per lane per row i). Element e of each run of 4 columns goes to plane e of
    # the stage: 4 adjacent shared words would be merged into one st.shared.v4, whose operands
    # must sit in a register quad, and such a constraint on the accumulators costs the FMA loop
    # (variant 12).
    CST = staged_stores and GT == 32 and VN == VEC and GN % VEC == 0
    NW = NT // 32  # warps per block
    GN4 = GN // VEC  # 16-byte vectors per staged row
    SP = _stage_pitch(GN4, GTY, GTX)  # a plane's row pitch (words)
    STAGE_Q = GTY * GN // (VEC * 32)  # 16-byte vectors per lane per staged row
    # the fragment loop: TRIPS trips of STEPS k steps, then the rest (odd: BK - 1 is) unrolled
    STEPS = 2
    TRIPS = (BK - 1) // STEPS
    LOOP_K = TRIPS * STEPS
    # The simulator accepts neither option; alignment only matters to the vectoriser anyway.
    opts = {} if simulating() else {"max_registers": max_registers(NT, blocks_per_sm)}
    ALIGN = None if simulating() else 16

    if simulating():  # the simulator has no syncwarp
        @cuda.jit(device=True, inline="always")
        def sync_warp():
            cuda.syncthreads()
    else:
        @cuda.jit(device=True, inline="always")
        def sync_warp():
            cuda.syncwarp()

    @cuda.jit(device=True, inline="always")
    def load_frags(As, Bs, buf, kk, ra, cb, a_reg, b_reg):
        """(a_reg, b_reg) <- this thread's rows of A column kk and columns of B row kk."""
        for i in range(TM):
            a_reg[i] = As[buf, kk, ra + uint64((i // VM) * SM + i % VM)]
        for j in range(TN):
            b_reg[j] = Bs[buf, kk, cb + uint64((j // VN) * SN + j % VN)]

    @cuda.jit(device=True, inline="always")
    def fma_frags(acc, a_reg, b_reg):
        """acc += outer(a_reg, b_reg), column by column (see the module docstring)."""
        for j in range(TN):
            for i in range(TM):
                acc[i, j] += a_reg[i] * b_reg[j]

    def unrolled_steps(k: int):
        """Steps k .. BK-2 of a slice as a chain of inlined device functions, each with its k a
        constant (the fragment loop's tail): no loop counter."""
        if k == BK - 1:
            @cuda.jit(device=True, inline="always")
            def done(As, Bs, buf, ra, cb, acc, a0, b0, a1, b1):
                return

            return done
        nxt, kn = unrolled_steps(k + 1), k + 1

        @cuda.jit(device=True, inline="always")
        def step(As, Bs, buf, ra, cb, acc, a0, b0, a1, b1):
            load_frags(As, Bs, buf, uint64(kn), ra, cb, a1, b1)
            fma_frags(acc, a0, b0)
            nxt(As, Bs, buf, ra, cb, acc, a1, b1, a0, b0)

        return step

    tail_steps = unrolled_steps(LOOP_K)

    @cuda.jit(device=True, inline="always")
    def two_steps(As, Bs, buf, kk, ra, cb, acc, a0, b0, a1, b1):
        """Steps kk and kk + 1: (a0, b0) hold kk's fragments on entry and on return kk + 2's."""
        load_frags(As, Bs, buf, kk + uint64(1), ra, cb, a1, b1)
        fma_frags(acc, a0, b0)
        load_frags(As, Bs, buf, kk + uint64(2), ra, cb, a0, b0)
        fma_frags(acc, a1, b1)

    @cuda.jit(device=True, inline="always")
    def multiply_db(As, Bs, buf, ra, cb, acc, a0, b0, a1, b1):
        """Variant 5: k = 0 .. BK-2 of shared buffer ``buf``, each step's FMAs issued after the
        next step's fragment loads, STEPS steps per loop trip and the rest unrolled. On entry
        (a0, b0) hold k = 0's fragments; on return (a1, b1) hold k = BK-1's, whose FMAs the caller
        issues after the barrier (so that the loads of the next slice's first fragments overlap
        them)."""
        for k0 in range(0, LOOP_K, STEPS):
            two_steps(As, Bs, buf, uint64(k0), ra, cb, acc, a0, b0, a1, b1)
        tail_steps(As, Bs, buf, ra, cb, acc, a0, b0, a1, b1)

    @cuda.jit(device=True, inline="always")
    def k_step(As, Bs, buf, kk, ra, cb, acc, a_reg, b_reg):
        """acc += outer(A column kk, B row kk) over this thread's rows and columns."""
        load_frags(As, Bs, buf, kk, ra, cb, a_reg, b_reg)
        fma_frags(acc, a_reg, b_reg)

    @cuda.jit(device=True, inline="always")
    def multiply_plain(As, Bs, buf, ra, cb, acc, a_reg, b_reg, a_nx, b_nx):
        """Variant 3: acc += the product of the slices in shared buffer ``buf``, 4 k columns
        per trip (``a_nx``, ``b_nx`` unused)."""
        for k4 in range(0, BK, 4):
            kk = uint64(k4)
            k_step(As, Bs, buf, kk, ra, cb, acc, a_reg, b_reg)
            k_step(As, Bs, buf, kk + uint64(1), ra, cb, acc, a_reg, b_reg)
            k_step(As, Bs, buf, kk + uint64(2), ra, cb, acc, a_reg, b_reg)
            k_step(As, Bs, buf, kk + uint64(3), ra, cb, acc, a_reg, b_reg)

    @cuda.jit(device=True, inline="always")
    def after_barrier_db(As, Bs, nbuf, ra, cb, acc, a0, b0, a1, b1):
        """Variant 5, after a slice's barrier: the next slice's first fragments (stale and
        unused after the last slice) load from buffer ``nbuf`` while the slice's last step
        multiplies: one basic block, no branch between."""
        load_frags(As, Bs, nbuf, uint64(0), ra, cb, a0, b0)
        fma_frags(acc, a1, b1)

    @cuda.jit(device=True, inline="always")
    def after_barrier_plain(As, Bs, nbuf, ra, cb, acc, a0, b0, a1, b1):
        return

    multiply = multiply_db if frag_db else multiply_plain
    after_barrier = after_barrier_db if frag_db else after_barrier_plain

    @cuda.jit(device=True, inline="always")
    def fetch_origin(trans, per, vw, tid):
        """(row, k) of the first element a thread fetches: vector ``tid % per`` of row (of k,
        for "t") ``tid // per``; the vector runs along k ("n") or along rows ("t")."""
        if trans:
            return uint64(tid % per * vw), uint64(tid // per)
        return uint64(tid // per), uint64(tid % per * vw)

    @cuda.jit(device=True, inline="always")
    def fetch_one(src, trans, vw, vl, ng, stride, rows_tile, r0, k0, fr, fk, n_rows, K, reg):
        """reg <- this thread's ng vectors of vw elements of the (rows_tile x BK) slice at
        (r0, k0): row fr (+ g * stride for "n"), k fk (+ g * stride for "t"); zero outside.
        ``vl``: each vector (vw = 4) of a whole slice is one 16-byte load."""
        if not EDGE or (r0 + uint64(rows_tile) <= n_rows and k0 + uint64(BK) <= K):  # whole slice inside
            for g in range(ng):
                if vl:
                    if trans:
                        v = load4(src, k0 + fk + uint64(g * stride), r0 + fr)
                    else:
                        v = load4(src, r0 + fr + uint64(g * stride), k0 + fk)
                    reg[g * 4] = v[0]
                    reg[g * 4 + 1] = v[1]
                    reg[g * 4 + 2] = v[2]
                    reg[g * 4 + 3] = v[3]
                else:
                    for e in range(vw):
                        if trans:
                            reg[g * vw + e] = src[k0 + fk + uint64(g * stride), r0 + fr + uint64(e)]
                        else:
                            reg[g * vw + e] = src[r0 + fr + uint64(g * stride), k0 + fk + uint64(e)]
        else:
            for g in range(ng):
                for e in range(vw):
                    if trans:
                        r = r0 + fr + uint64(e)
                        c = k0 + fk + uint64(g * stride)
                    else:
                        r = r0 + fr + uint64(g * stride)
                        c = k0 + fk + uint64(e)
                    val = float32(0.0)
                    if r < n_rows and c < K:
                        val = src[c, r] if trans else src[r, c]
                    reg[g * vw + e] = val

    @cuda.jit(device=True, inline="always")
    def stash_one(S, buf, trans, vw, ng, stride, fr, fk, reg):
        """Shared buffer ``buf`` <- the fetched registers, k-major."""
        for g in range(ng):
            for e in range(vw):
                if trans:
                    S[buf, fk + uint64(g * stride), fr + uint64(e)] = reg[g * vw + e]
                else:
                    S[buf, fk + uint64(e), fr + uint64(g * stride)] = reg[g * vw + e]

    @cuda.jit(device=True, inline="always")
    def fetch(a, b, m0, n0, k0, M, N, K, fa, ka, fb, kb, a_pf, b_pf):
        fetch_one(a, AT, AV, AVL, AG, ASTR, BM, m0, k0, fa, ka, M, K, a_pf)
        fetch_one(b, BT, BV, BVL, BG, BSTR, BN, n0, k0, fb, kb, N, K, b_pf)

    @cuda.jit(device=True, inline="always")
    def stash(As, Bs, buf, fa, ka, fb, kb, a_pf, b_pf):
        stash_one(As, buf, AT, AV, AG, ASTR, fa, ka, a_pf)
        stash_one(Bs, buf, BT, BV, BG, BSTR, fb, kb, b_pf)

    @fastlaunch.jit(**opts)
    def gemm_kernel(a, b, acc_in, c, split_steps):
        M = uint64(c.shape[0])  # unsigned throughout: a signed / unsigned mix would be
        N = uint64(c.shape[1])  # compared in float64
        K = uint64(a.shape[0] if AT else a.shape[1])
        As = cuda.shared.array((2, BK, BMP), float32, alignment=ALIGN)  # 2 x (bk, bm) of A
        Bs = cuda.shared.array((2, BK, BNP), float32, alignment=ALIGN)  # 2 x (bk, bn) of B
        acc = cuda.local.array((TM, TN), float32)  # (tm, tn)
        a_reg = cuda.local.array(TM, float32)
        b_reg = cuda.local.array(TN, float32)
        a_nx = cuda.local.array(TM, float32)  # variant 5: the next k's fragments
        b_nx = cuda.local.array(TN, float32)
        a_pf = cuda.local.array(A_LOADS, float32)  # this thread's share of the next A slice
        b_pf = cuda.local.array(B_LOADS, float32)  # and of the next B slice
        tid = cuda.threadIdx.x
        grp = tid // GT  # thread group (warp tile), then the thread within it
        lt = tid % GT
        ra = uint64((grp // GPR) * GM + (lt // GTX) * VM)  # first row of this thread's micro-tile
        cb = uint64((grp % GPR) * GN + (lt % GTX) * VN)  # first column
        fa, ka = fetch_origin(AT, APER, AV, tid)  # row and k of this thread's first vector of A
        fb, kb = fetch_origin(BT, BPER, BV, tid)  # and of B
        m0 = uint64(cuda.blockIdx.y * BM)
        n0 = uint64(cuda.blockIdx.x * BN)
        for i in range(TM):
            for j in range(TN):
                acc[i, j] = float32(0.0)
        n_steps = (K + uint64(BK - 1)) // uint64(BK)
        s0 = uint64(cuda.blockIdx.z) * uint64(split_steps)  # this block's k slices: [s0, s1)
        s1 = min(n_steps, s0 + uint64(split_steps))
        fetch(a, b, m0, n0, s0 * uint64(BK), M, N, K, fa, ka, fb, kb, a_pf, b_pf)
        stash(As, Bs, 0, fa, ka, fb, kb, a_pf, b_pf)
        cuda.syncthreads()
        if FDB:  # variant 5: the first slice's first fragments
            load_frags(As, Bs, 0, uint64(0), ra, cb, a_reg, b_reg)
        # Two k slices per trip so that the buffer indices are constants: slice s0 + i is in
        # buffer i % 2. A buffer is overwritten only after the barrier that ends the step reading it.
        for s in range(s0, s1, uint64(2)):
            if s + uint64(1) < s1:
                fetch(a, b, m0, n0, (s + uint64(1)) * uint64(BK), M, N, K, fa, ka, fb, kb, a_pf, b_pf)
            multiply(As, Bs, 0, ra, cb, acc, a_reg, b_reg, a_nx, b_nx)
            if s + uint64(1) < s1:
                stash(As, Bs, 1, fa, ka, fb, kb, a_pf, b_pf)
            cuda.syncthreads()
            after_barrier(As, Bs, 1, ra, cb, acc, a_reg, b_reg, a_nx, b_nx)
            if s + uint64(1) < s1:
                if s + uint64(2) < s1:
                    fetch(a, b, m0, n0, (s + uint64(2)) * uint64(BK), M, N, K, fa, ka, fb, kb, a_pf, b_pf)
                multiply(As, Bs, 1, ra, cb, acc, a_reg, b_reg, a_nx, b_nx)
                if s + uint64(2) < s1:
                    stash(As, Bs, 0, fa, ka, fb, kb, a_pf, b_pf)
                cuda.syncthreads()
                after_barrier(As, Bs, 0, ra, cb, acc, a_reg, b_reg, a_nx, b_nx)
        split = cuda.gridDim.z > 1
        if CST and not split and m0 + uint64(BM) <= M and n0 + uint64(BN) <= N:  # a whole tile
            stage = cuda.shared.array((NW, VEC, GTY, SP), float32)
            ty = uint64(lt // GTX)  # this thread's row in the stage
            tx = uint64(lt % GTX)  # and its first run of 4 columns
            wr = m0 + uint64((grp // GPR) * GM)  # the warp tile's first row and column in c
            wc = n0 + uint64((grp % GPR) * GN)
            for i in range(TM):
                for j in range(TN):
                    stage[grp, j % VN, ty, tx + uint64((j // VN) * GTX)] = acc[i, j]
                sync_warp()
                for q in range(STAGE_Q):
                    f = uint64(q * 32 + lt)
                    sr = f // uint64(GN4)
                    c4 = f % uint64(GN4)
                    r = wr + sr * uint64(VM) + uint64((i // VM) * SM + i % VM)
                    col = wc + c4 * uint64(VEC)
                    x0 = stage[grp, 0, sr, c4]
                    x1 = stage[grp, 1, sr, c4]
                    x2 = stage[grp, 2, sr, c4]
                    x3 = stage[grp, 3, sr, c4]
                    if ACC:
                        p = load4(acc_in, r, col)
                        x0 += p[0]
                        x1 += p[1]
                        x2 += p[2]
                        x3 += p[3]
                    store4(c, r, col, x0, x1, x2, x3)
                sync_warp()
        else:
            for i in range(TM):
                r = m0 + ra + uint64((i // VM) * SM + i % VM)
                if r < M:
                    for j in range(TN):
                        col = n0 + cb + uint64((j // VN) * SN + j % VN)
                        if col < N:
                            if split:
                                cuda.atomic.add(c, (r, col), acc[i, j])
                            elif ACC:
                                c[r, col] = acc_in[r, col] + acc[i, j]
                            else:
                                c[r, col] = acc[i, j]

    return gemm_kernel


@dataclass(frozen=True)
class Variant:
    """One row of the variant table: how :func:`make_gemm` builds variant ``number``."""

    number: int
    frag_db: bool = False  # shared-to-register fragments double-buffered (Note [GEMM variant 5])
    vector_loads: bool = False  # 16-byte global loads of interior slices (Note [GEMM variant 11])
    staged_stores: bool = False  # whole output tiles through a shared stage (Note [GEMM variant 13])
    blocks_per_sm: int = 2  # the register cap lets this many blocks share an SM
    # the variant run instead when an array this one touches 16 bytes at a time is not 16-byte
    # aligned (_vector.aligned16): the operands for 11; also the output and acc for 13
    scalar_twin: int | None = None

    def build(self, t: GemmTiles, a_trans: bool, b_trans: bool, accumulate: bool, edge_checks: bool = True):
        return make_gemm(t, a_trans, b_trans, accumulate, self.blocks_per_sm, frag_db=self.frag_db,
                         edge_checks=edge_checks, vector_loads=self.vector_loads,
                         staged_stores=self.staged_stores)


# Note [GEMM variant 3]
# ---------------------
# ``3`` caps registers for two blocks per SM (the small-tile path: outputs under half an SM's worth
# of 128 x 128 tiles).

# Note [GEMM variant 5]
# ---------------------
# ``5`` is ``3`` with the shared-to-register fragments double-buffered: k step ``k + 1``'s fragments
# load into a second set of registers before step ``k``'s FMAs issue, and a slice's last step
# multiplies after the barrier, while the next slice's first fragments load. Why: ncu on the H200 at
# 4096^3 (``experiments/results/kernels-h200/run3-ncu/``) shows variant 3's best shape (4 warps of
# 64x64, two blocks per SM: two warps per scheduler) executing as many instructions as cuBLAS but
# with no warp ready 28% of cycles against cuBLAS's 10%; in its SASS the first LDS of each 4-step
# trip is read 5 instructions after it issues, so the warp waits for shared memory at every trip. In
# variant 5 every LDS is read at least 33 instructions later (median 79 / 70 / 86 in the nn / nt /
# tt layouts), at the cost of 24 registers (246 / 236 / 223 at that shape, no spill) and 1.086
# instead of 1.072 instructions per FFMA in the FMA loop (``scripts/sass_report.py``). H200, sweep 6
# (``experiments/results/gemm-h200/run6/``): 79.2-82.5% of cuBLAS fp32 at the 7B block's forward
# shapes, 78.9-88.7% at its backward ones.

# Note [GEMM variant 11]
# ----------------------
# ``11`` is ``5`` with 16-byte global loads: 16 ``LDG.E.128`` where ``5`` issues 64 ``LDG.E`` per
# thread per two k slices (offline, sm_90, the interior path: 1.153 instead of 1.165 instructions
# per FFMA in the nn layout, 1.121 instead of 1.133 in tt; 241 registers in nn), and a quarter of
# the L1 requests. H200, sweep 7 (``experiments/results/gemm-h200/run7/``): 85.2-92.9% forward (82
# -> 90 at 4096^3), 83.0-93.6% backward, +2.8 to +11.1 points over ``5`` at every shape: the rules
# run it. On operands that are not 16-byte aligned (a row length not a multiple of 4, a view
# starting mid row) the launcher runs its scalar twin ``5`` instead (:func:`loaded_variant`).

# Note [GEMM variant 13]
# ----------------------
# ``13`` (the rules' since sweep 8) is ``11`` writing each whole, unsplit output tile through a
# per-warp shared stage: per micro-tile row a warp stores its outputs there with scalar ``STS`` and
# writes them back as whole rows, one ``STG.E.128`` per lane (32 full-sector stores per thread where
# ``11`` issues 128 ``STG.E`` that each fill 8 of a sector's 32 bytes). Edge tiles and split k keep
# ``11``'s epilogue. ncu at dx of k/v GQA8 (K = 1024, ``run8/ncu-dx/``): ``11`` spent 8.7% of its
# warp samples in that epilogue (store-queue throttle, store-address reuse), 1.6% at 4096^3, and
# both blocks of an SM reach it together. The stage keeps element e of each run of 4 columns in
# plane e, so no two stored words are adjacent: NVVM would merge adjacent ones into one
# ``st.shared.v4``, whose register quad would pin the accumulators (see ``12`` below). H200, sweep 8
# (``run8/rule/``, the GPU's time alone): 86.3-94.2% at the 15 shapes, dx of k/v GQA8 85.0 -> 92.6,
# at least ``11``'s speed at 14; the forward gate/up 92.9 against ``11``'s 96.5 (nn: 250 registers
# against 241). On an output or accumulator that is not 16-byte aligned the launcher runs ``11``.
VARIANTS = {v.number: v for v in (
    Variant(3),  # Note [GEMM variant 3]
    Variant(5, frag_db=True),  # Note [GEMM variant 5]
    Variant(11, frag_db=True, vector_loads=True, scalar_twin=5),  # Note [GEMM variant 11]
    Variant(13, frag_db=True, vector_loads=True, staged_stores=True, scalar_twin=11),  # Note [GEMM variant 13]
)}


@lru_cache(maxsize=None)
def get_kernel(variant: int, tiles: GemmTiles, layout: str = "nn", accumulate: bool = False,
               edge_checks: bool = True):
    """The compiled-on-first-launch kernel of ``variant`` for ``tiles`` and ``layout``
    (``edge_checks=False``: :func:`make_gemm`'s interior-only build, for SASS reports only)."""
    if variant not in VARIANTS:
        raise KernelError(f"unknown GEMM variant {variant}; known: {sorted(VARIANTS)}")
    a_trans, b_trans = LAYOUTS[layout]
    return VARIANTS[variant].build(tiles, a_trans, b_trans, accumulate, edge_checks)


def check_args(x, w, y) -> tuple[int, int, int]:
    for name, a in (("x", x), ("w", w), ("y", y)):
        check_ndim(name, a, 2)
        check_float32(name, a)
    m, k = x.shape
    n, kw = w.shape
    if kw != k:
        raise KernelError(f"linear: x is (M={m}, K={k}) but w is (N={n}, K={kw}); K must match")
    if tuple(y.shape) != (m, n):
        raise KernelError(f"linear: output has shape {tuple(y.shape)}, expected (M={m}, N={n})")
    return m, n, k


def plan(m: int, n: int, k: int, layout: str = "nn", tiles: GemmTiles | None = None, variant: int | None = None,
         splits: int | None = None, rule: str | None = None) -> GemmLaunch:
    """The launch of an (m, n, k) problem of ``layout``: ``rule``'s choice (:func:`choose`) filling
    whatever of ``tiles`` / ``variant`` / ``splits`` is None, the split count without empty splits.
    On operands that are not 16-byte aligned the launcher then runs :func:`loaded_variant`."""
    auto = choose(m, n, k, splits, rule=rule, layout=layout)
    tiles = tiles or auto.tiles
    variant = auto.variant if variant is None else variant
    if variant not in VARIANTS:  # before loaded_variant reads its row
        raise KernelError(f"unknown GEMM variant {variant}; known: {sorted(VARIANTS)}")
    splits = auto.splits if splits is None else splits
    k_steps = max(1, -(-k // tiles.bk))
    if not 1 <= splits <= k_steps:
        raise KernelError(f"splits={splits} must be between 1 and the {k_steps} k slices of K={k}")
    per = -(-k_steps // splits)
    return GemmLaunch(variant, tiles, -(-k_steps // per))  # no empty split


def _launch(layout: str, a, b, acc, c, k: int, stream, tiles, variant, splits) -> None:
    """Enqueue ``c = [acc +] A @ B`` (reduction length ``k``) as :func:`plan` says."""
    m, n = c.shape
    if m == 0 or n == 0:
        return
    launch = plan(m, n, k, layout, tiles, variant, splits)
    tiles, splits = launch.tiles, launch.splits
    per = -(-max(1, -(-k // tiles.bk)) // splits)  # k slices per split
    grid = (-(-n // tiles.bn), -(-m // tiles.bm), splits)
    if splits > 1:  # the blocks add into c: start it at acc, or zero
        if acc is None:
            zero_fill(c, stream)
        else:
            copy_fill(acc, c, stream)
    kernel = get_kernel(loaded_variant(launch.variant, a, b, c, acc), tiles, layout, acc is not None and splits == 1)
    kernel[grid, tiles.threads, stream](a, b, c if acc is None else acc, c, per)


def loaded_variant(variant: int, a, b, c=None, acc=None) -> int:
    """The variant whose kernel runs on operands ``a`` and ``b`` into ``c`` (+ ``acc``): a variant
    with 16-byte accesses (a ``scalar_twin`` in its row) runs its twin without them unless every array it
    reads or writes that way passes ``_vector.aligned16`` (not so: a row length that is not a
    multiple of 4, a view starting mid-row), down the chain 13 -> 11 -> 5 (``Variant.scalar_twin``)."""
    while VARIANTS[variant].scalar_twin is not None:
        arrays = (a, b) + ((c, acc) if VARIANTS[variant].staged_stores else ())
        if all(x is None or aligned16(x) for x in arrays):
            return variant
        variant = VARIANTS[variant].scalar_twin
    return variant


def gemm(x, w, y, stream=0, tiles: GemmTiles | None = None, variant: int | None = None,
         splits: int | None = None):
    """Enqueue ``y = x @ w.T`` on ``stream``. x (M, K), w (N, K), y (M, N): device arrays.
    Without ``tiles`` / ``variant`` the launcher picks (:func:`choose`); ``splits`` > 1 shares each
    tile's k slices among that many blocks, which add into a zeroed y."""
    m, n, k = check_args(x, w, y)
    _launch("nn", x, w, None, y, k, stream, tiles, variant, splits)


def _backward(op: str, names: tuple, layout: str, axis: int, dy, b, out, acc, stream, tiles, variant, splits):
    """Check and launch one backward GEMM: the reduction runs over ``dy``'s ``axis`` (N for
    dx = dy w, M for dw = dy^T x), which is ``b``'s first; the output is (dy's other axis, K)."""
    for name, a in zip(names + ("acc",), (dy, b, out, acc)):
        if a is not None:
            check_ndim(name, a, 2)
            check_float32(name, a)
    red = dy.shape[axis]
    want = (dy.shape[1 - axis], b.shape[1])
    if b.shape[0] != red or tuple(out.shape) != want or (acc is not None and tuple(acc.shape) != want):
        rows, other = ("N", "M") if axis else ("M", "N")
        raise KernelError(f"{op}: dy {tuple(dy.shape)} (M, N), {names[1]} {tuple(b.shape)} ({rows}, K), {names[2]} "
                         f"{tuple(out.shape)} and acc {None if acc is None else tuple(acc.shape)} ({other}, K) disagree")
    _launch(layout, dy, b, acc, out, red, stream, tiles, variant, splits)


def linear_dx(dy, w, dx, stream=0, acc=None, tiles: GemmTiles | None = None, variant: int | None = None,
              splits: int | None = None):
    """Enqueue ``dx = dy @ w`` (+ ``acc``): dy (M, N), w (N, K), dx and acc (M, K). ``acc`` may be
    dx itself (accumulate in place) or another array."""
    _backward("linear_dx", ("dy", "w", "dx"), "nt", 1, dy, w, dx, acc, stream, tiles, variant, splits)


def linear_dw(dy, x, dw, stream=0, acc=None, tiles: GemmTiles | None = None, variant: int | None = None,
              splits: int | None = None):
    """Enqueue ``dw = dy.T @ x`` (+ ``acc``): dy (M, N), x (M, K), dw and acc (N, K). ``acc`` may be
    dw itself (accumulate in place) or another array."""
    _backward("linear_dw", ("dy", "x", "dw"), "tt", 0, dy, x, dw, acc, stream, tiles, variant, splits)


@fastlaunch.jit
def _zero2d(y):
    i, j = cuda.grid(2)
    if i < y.shape[0] and j < y.shape[1]:
        y[i, j] = float32(0.0)


@fastlaunch.jit
def _copy2d(src, dst):
    i, j = cuda.grid(2)
    if i < dst.shape[0] and j < dst.shape[1]:
        dst[i, j] = src[i, j]


def _grid2d(y):
    return (-(-y.shape[0] // 16), -(-y.shape[1] // 16)), (16, 16)


def zero_fill(y, stream=0) -> None:
    """``y[...] = 0`` on ``stream`` (the split-K accumulator)."""
    blocks, threads = _grid2d(y)
    _zero2d[blocks, threads, stream](y)


def copy_fill(src, dst, stream=0) -> None:
    """``dst[...] = src`` on ``stream`` (each element read and written by one thread: in place is
    fine): the split-K accumulator when adding to an existing gradient."""
    blocks, threads = _grid2d(dst)
    _copy2d[blocks, threads, stream](src, dst)


def _rel_err(got, want) -> float:
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


def validate(
    shapes=((8, 8, 4), (5, 7, 9), (17, 3, 13), (16, 24, 8)),
    tiles: GemmTiles | None = None,
    variants=tuple(VARIANTS),
    rtol: float = 1e-5,
    seed: int = 0,
    splits: int | None = None,
) -> list[dict]:
    """Run every variant of the forward on each (M, N, K) against ``reference.linear``; returns
    one record per run with the max error relative to the reference's largest magnitude. Raises
    on a mismatch."""
    rng = np.random.default_rng(seed)
    records = []
    for m, n, k in shapes:
        x = rng.standard_normal((m, k), dtype=np.float32)  # (M, K)
        w = rng.standard_normal((n, k), dtype=np.float32)  # (N, K)
        want = reference.linear(x, w)  # (M, N)
        for v in variants:
            d_y = cuda.device_array((m, n), dtype=np.float32)  # (M, N)
            gemm(cuda.to_device(x), cuda.to_device(w), d_y, tiles=tiles, variant=v, splits=splits)
            err = _rel_err(d_y.copy_to_host(), want)
            records.append({"shape": (m, n, k), "variant": v, "max_rel_err": err})
            if not err <= rtol:
                raise AssertionError(f"gemm_v{v} at (M,N,K)={(m, n, k)}: max rel err {err:.3g}")
    return records


def validate_backward(shapes=((8, 8, 4), (5, 7, 9), (17, 3, 13), (16, 24, 8)), tiles: GemmTiles | None = None,
                      rtol: float = 1e-5, seed: int = 0, splits: int | None = None,
                      variant: int | None = None) -> list[dict]:
    """``linear_dx`` and ``linear_dw``, with and without ``acc``, on each (M, N, K) of the forward
    they differentiate, against the references."""
    rng = np.random.default_rng(seed)
    records = []
    for m, n, k in shapes:
        x = rng.standard_normal((m, k), dtype=np.float32)  # (M, K)
        w = rng.standard_normal((n, k), dtype=np.float32)  # (N, K)
        dy = rng.standard_normal((m, n), dtype=np.float32)  # (M, N)
        gx = rng.standard_normal((m, k), dtype=np.float32)  # (M, K) existing gradients
        gw = rng.standard_normal((n, k), dtype=np.float32)  # (N, K)
        cases = (
            ("dx", linear_dx, (dy, w), None, reference.linear_backward_x(dy, w)),
            ("dx+acc", linear_dx, (dy, w), gx, gx + reference.linear_backward_x(dy, w)),
            ("dw", linear_dw, (dy, x), None, reference.linear_backward_w(dy, x)),
            ("dw+acc", linear_dw, (dy, x), gw, reference.linear_backward_w(dy, x, gw)),
        )
        for name, fn, ins, acc, want in cases:
            d_out = cuda.device_array(want.shape, dtype=np.float32)
            red = ins[0].shape[1] if fn is linear_dx else ins[0].shape[0]  # reduction length
            t = tiles or choose(*want.shape, red, splits).tiles
            s = None if splits is None else min(splits, -(-red // t.bk))
            fn(*(cuda.to_device(a) for a in ins), d_out, acc=None if acc is None else cuda.to_device(acc),
               tiles=tiles, variant=variant, splits=s)
            err = _rel_err(d_out.copy_to_host(), want)
            records.append({"shape": (m, n, k), "case": name, "max_rel_err": err})
            if not err <= rtol:
                raise AssertionError(f"linear {name} at (M,N,K)={(m, n, k)}: max rel err {err:.3g}")
    return records

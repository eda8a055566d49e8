"""The bf16 GEMMs of :mod:`.gemm_bf16` on Hopper's warpgroup MMA (``wgmma.mma_async``), for sm_90.

Same contract as :mod:`.gemm_bf16` (``C (R, C) = [acc +] A @ B``, A stored (R, K) "n" or (K, R)
"t", B stored (C, K) "n" or (K, C) "t", fp32 or bf16 output, split k with fp32 output); the
launchers there call this kernel where it applies (:func:`usable`). Layouts and descriptors:
:mod:`.wgmma_layout`; intrinsics: :mod:`._wgmma`.

Note [wgmma GEMM tile]
----------------------
mma.sync reaches 36-51% of cuBLAS on the H200 (``experiments/results/gemm-bf16-h200``): each
warp must load its fragments from shared memory into registers (ldmatrix) before every MMA, and
the issue slots those take bound it. ``wgmma`` reads both operands from shared memory itself,
through descriptors, asynchronously: a warpgroup (4 warps, 128 threads) issues one instruction
for a 64 x n x 16 product, and the registers hold only the accumulators.

- A block of ``bm / 64`` warpgroups (2 by default: 256 threads) computes ``bm x bn``; each
  warpgroup 64 rows x all ``bn`` columns with one m64n{bn}k16 per k step, so B's tile is shared
  by the warpgroups and each accumulates ``bn / 2`` fp32 per thread (64 at bn 128, 128 at 256).
- k slices of BK = 64 (one 128-byte swizzle row of bf16) are staged by ``cp.async`` (16 bytes per
  instruction, as :mod:`.gemm_bf16` does) into ``stages`` buffers of the 128-byte-swizzled
  layouts of :mod:`.wgmma_layout`; the dynamic shared array is aligned to 1024 bytes at run time.
- Per slice: wait for its cp.async group, ``fence.proxy.async`` (cp.async writes through the
  generic proxy, wgmma reads through the async one), a block barrier, then the fetch of a slice
  ahead into a buffer no MMA still reads, then ``wgmma.fence``, 4 MMAs (k steps of 16),
  ``commit`` and ``wait ahead``. With ``ahead = 0`` the slice's MMAs complete before the next
  barrier, and the fetch runs ``stages - 1`` slices ahead; with ``ahead = 1`` one group stays in
  flight across it (the tensor cores are not idle at the barrier), its buffer is rewritten a
  slice later, so the fetch runs ``stages - 2`` ahead. The other way to fill the bubble at each
  barrier is a second resident block (``blocks = 2``: 3 stages at bn 128, 97 KiB, and at most
  128 registers a thread).
- No TMA and no warp specialisation: the fetch is the threads' own cp.async, and every thread
  computes. Operands must be 16-byte aligned (:func:`.gemm_staging.aligned_b16`); other operands
  take the mma.sync kernel.

Under the simulator the kernel runs (asked for with ``WgmmaTiles``) through :mod:`._wgmma`'s
twins, at tiny sizes; the launchers' default there stays the mma.sync kernel.

Measurements: ``experiments/results/gemm-bf16-h200`` (run 3 on).

Note [wgmma tiles by shape]
---------------------------
Rationale. The first GPU sweep (H100, ``gemm-bf16-h200/run3-wgmma-h100``, % of cuBLAS bf16 at
the 7B block's 15 shapes, bf16 output) put the plain 128 x 128 tile that a launch took when it
asked for none (:data:`GPU_WGMMA`) at 33.6-50.9%, below two of its variants at every shape:
128 x 256 with one MMA group in flight across the barrier (``ahead = 1``) at 55-70% wherever
its blocks fill the SMs, 36.5% where they do not (k/v with 8 KV heads, a 2048 x 1024 output:
64 blocks on 132 SMs); 128 x 128 with ``ahead = 1`` at 51.3% there.

Approach. :func:`choose_tiles`: 128 x 256 / a1 (:data:`WIDE`) when its blocks fill 90% of the SMs
at least, else 128 x 128 / a1 (:data:`NARROW`). Against that sweep it takes the better of the two
at all 15 shapes (the 90%: dw of k/v, 128 blocks, is 56.7% wide and 52.2% narrow), 41.5-70.1%
in all, against 32.8-46.9% for the mma.sync rule. A rule read off the shapes it is scored on:
the untuned shapes and the H200 must still check it. Split k is decided on the chosen tiles
(:func:`.gemm_bf16.choose`).

Checked on 13 shapes it was not read off (the 1B set of ``experiments/gemm_sweep.py --set 1b``,
H100, 2026-12-07, ``gemm-bf16-h200/run4-wgmma-1b-h100``): 128 x 128 / a1 ran at 27.7-52.2% of
cuBLAS bf16, 128 x 256 / a1 at 18.6-59.3%, the mma.sync rule at 18.6-42.4%. The rule picks the
better of the two at 11 of the 13 (wrong at gate/up 1024 x 5632, 37.4 against 40.0, and dx of
down, 43.0 against 43.9), 27.7-59.3% in all.

Note [wgmma as the default]
---------------------------
Since 2026-12-07 a launch that asks for no tiles takes this kernel on an sm_90 device when both
operands are 16-byte aligned (``VMSTOOLKIT_WGMMA=0`` keeps mma.sync). The evidence, all H100:
its GPU tests (layouts, tiles, views, split k, the default path) and, with it on, the bf16
block's GPU tests (``tests/gpu/test_block_bf16_gpu.py``, passed, ``kernels-h200/run12-h100``;
the tiny checkpoints run the fp32 kernels and do not reach it); and it is
faster than mma.sync at every one of the 28 shapes timed (the two sweeps above). The H200 has
not run it: no H200 has been lent since it was written. On other devices, under the simulator,
and for unaligned operands the launchers take mma.sync as before.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, ClassVar
from functools import lru_cache

import numpy as np
from numba import cuda, float32, uint16

from vmstoolkit.errors import KernelError

from . import _cuda_cache, _launch as fastlaunch, _mma, _wgmma, gemm_staging as GS, wgmma_layout as WL
from ._util import compute_capability, generated_function, simulating, sm_count

BK = WL.BK
MAX_SMEM = 227 * 1024  # the H200's dynamic shared memory per block at most


@dataclass(frozen=True)
class WgmmaTiles:
    """``bm x bn`` outputs per block (``bm / 64`` warpgroups), ``stages`` k slices of 64 in flight."""

    ELEM_BYTES: ClassVar[int] = 2  # bf16
    chunk: ClassVar[int] = 8  # elements per 16-byte chunk (one cp.async)

    bm: int = 128
    bn: int = 128
    stages: int = 4
    ahead: int = 0  # MMA groups left in flight across the next slice's barrier (0 or 1)
    blocks: int = 1  # blocks an SM is meant to hold: bounds the registers a thread

    @property
    def bk(self) -> int:
        return BK

    @property
    def warpgroups(self) -> int:
        return self.bm // 64

    @property
    def threads(self) -> int:
        return WL.WARPGROUP * self.warpgroups

    @property
    def smem_bytes(self) -> int:
        """Stages of both operands, and 1024 bytes to align the first to an atom."""
        return self.stages * (self.bm + self.bn) * BK * 2 + WL.ATOM_BYTES

    @property
    def dynamic(self) -> bool:
        return True

    @property
    def max_registers(self) -> int:
        return min(255, 65536 // (self.threads * self.blocks) // 8 * 8)

    @property
    def prefetch(self) -> int:
        """Slices fetched ahead of the one multiplied: a buffer is rewritten only once the MMA
        group that read it is complete, ``ahead`` groups back."""
        return self.stages - 1 - self.ahead

    def label(self) -> str:
        return (f"wgmma {self.bm}x{self.bn}x{BK}/s{self.stages}" + (f"/a{self.ahead}" if self.ahead else "")
                + (f"/b{self.blocks}" if self.blocks > 1 else ""))

    def check(self) -> None:
        if self.bm not in (64, 128, 192, 256):
            raise KernelError(f"tiles {self}: bm must be 64, 128, 192 or 256 (a warpgroup per 64 rows)")
        if self.bn % 64 or not 64 <= self.bn <= 256:
            raise KernelError(f"tiles {self}: bn must be 64, 128, 192 or 256 (whole 64-element panels)")
        if (self.bm * BK // 8) % self.threads or (self.bn * BK // 8) % self.threads:
            raise KernelError(f"tiles {self}: each thread must fetch whole 16-byte chunks of both operands")
        if self.ahead not in (0, 1):
            raise KernelError(f"tiles {self}: ahead must be 0 or 1")
        if self.prefetch < 1:
            raise KernelError(f"tiles {self}: stages must be at least {2 + self.ahead} with ahead={self.ahead}")
        if self.blocks * self.smem_bytes > 228 * 1024:
            raise KernelError(f"tiles {self}: {self.blocks} blocks of {self.smem_bytes} bytes of shared memory "
                              "do not fit an SM (228 KiB)")
        if self.smem_bytes > MAX_SMEM:
            raise KernelError(f"tiles {self}: {self.smem_bytes} bytes of shared memory (limit {MAX_SMEM})")


GPU_WGMMA = WgmmaTiles()
WIDE = WgmmaTiles(128, 256, 4, ahead=1)  # Note [wgmma tiles by shape]
NARROW = WgmmaTiles(128, 128, 4, ahead=1)
FULL_WAVE = 0.9  # WIDE when its blocks fill this share of the SMs at least


def choose_tiles(m: int, n: int, sms: int | None = None) -> WgmmaTiles:
    """The tiles of a launch that asked for none (Note [wgmma tiles by shape]): :data:`WIDE`
    when its blocks of the (m, n) output fill about one wave of ``sms`` SMs (default: the
    device's), else :data:`NARROW`, twice the blocks."""
    sms = sms or sm_count()
    blocks = -(-m // WIDE.bm) * -(-n // WIDE.bn)
    return WIDE if blocks >= FULL_WAVE * sms else NARROW


def _swizzle_panel(k: str, chunk: str, width: int) -> str:
    """Element offset in an MN-major tile of chunk ``chunk`` (8 elements along M/N) of k row ``k``:
    :func:`.wgmma_layout.mnmajor_offset` / 2, with 64-element panels of BK rows."""
    return f"(((({chunk}) >> 3) * {BK * WL.PANEL}) + ({k}) * {WL.PANEL} + (((({chunk}) & 7) ^ (({k}) & 7)) << 3))"


@dataclass(frozen=True)
class _Swizzles:
    swizzle_n: Callable[[str, str, int], str]
    swizzle_t: Callable[[str, str, int], str]


# K-major tiles: gemm_staging's "n" swizzle at BK 64 (chunk c of row r at c ^ (r & 7)) is the
# 128-byte swizzle; MN-major ones are 64-element panels (wgmma_layout)
STAGING = _Swizzles(GS.swizzle_n, _swizzle_panel)


def _kernel_source(t: WgmmaTiles, a_trans: bool, b_trans: bool, out_bf16: bool, accumulate: bool,
                   atomic: bool) -> str:
    T, S, N = t.threads, t.stages, t.bn
    regs = N // 2
    a_stage, b_stage = t.bm * BK, t.bn * BK  # elements
    boff = S * a_stage
    hi_a = WL.descriptor_hi(*WL.fields(a_trans))
    hi_b = WL.descriptor_hi(*WL.fields(b_trans))
    wg_bytes = 64 * WL.ROW_BYTES if not a_trans else BK * WL.ROW_BYTES  # a warpgroup's 64 rows of A
    src = ["def kernel(a, b, acc, c, per):",
           "    Sm = cuda.shared.array(0, uint16)",
           "    base = shared_addr(Sm, 0)",
           f"    pad = ((base + {WL.ATOM_BYTES - 1}) & {-WL.ATOM_BYTES}) - base",
           "    e0 = pad >> 1",  # the aligned start, in elements of Sm
           "    s0 = base + pad",  # and as a shared address
           "    tid = cuda.threadIdx.x", "    wg = tid >> 7", "    lt = tid & 127",
           "    M = c.shape[0]", "    N = c.shape[1]",
           f"    K = a.shape[{0 if a_trans else 1}]",
           f"    r0_a = cuda.blockIdx.y * {t.bm}", f"    r0_b = cuda.blockIdx.x * {t.bn}",
           f"    ksteps = (K + {BK - 1}) // {BK}",
           "    kbeg = cuda.blockIdx.z * per", "    nk = min(ksteps, kbeg + per) - kbeg",
           f"    d = wgmma_zeros({regs})"]
    src += ["    " + line for line in GS.fetch_setup(STAGING, t, "a", a_trans, t.bm, "M")
            + GS.fetch_setup(STAGING, t, "b", b_trans, t.bn, "N")]
    fetch = (GS.fetch_lines(STAGING, t, "a", a_trans, t.bm, "M", True, "e0")
             + GS.fetch_lines(STAGING, t, "b", b_trans, t.bn, "N", True, f"e0 + {boff}"))
    P = t.prefetch
    for s in range(P):
        src += [f"    if {s} < nk:", f"        st = {s}", f"        k0 = (kbeg + {s}) * {BK}"]
        src += ["        " + line for line in fetch]
        src.append("    cp_async_commit()")
    src += [f"    st = {P}", "    sr = 0", f"    k0 = (kbeg + {P}) * {BK}",
            "    for it in range(nk):",
            f"        cp_async_wait({P - 1})",
            "        fence_proxy_async()",
            "        cuda.syncthreads()",
            f"        if it + {P} < nk:"]
    src += ["            " + line for line in fetch]
    src += ["        cp_async_commit()",
            f"        k0 += {BK}",
            "        st += 1",
            f"        if st == {S}:",
            "            st = 0",
            f"        sa = s0 + sr * {a_stage * 2} + wg * {wg_bytes}",
            f"        sb = s0 + {boff * 2} + sr * {b_stage * 2}",
            "        sr += 1",
            f"        if sr == {S}:",
            "            sr = 0",
            "        wgmma_fence()"]
    for step in range(BK // WL.K_STEP):
        oa, ob = WL.step_offset(a_trans, step), WL.step_offset(b_trans, step)
        src.append(f"        d = wgmma_bf16(d, sa + {oa}, sb + {ob}, {hi_a}, {hi_b}, {N}, "
                   f"{int(a_trans)}, {int(b_trans)})")
    src += ["        wgmma_commit()", f"        wgmma_wait({t.ahead})"]
    if not t.ahead:  # (with a group in flight, touching its accumulators would serialise the MMAs)
        src.append("        d = wgmma_pin(d)")
    src += ["    wgmma_wait(0)",
            "    d = wgmma_pin(d)",
            "    cp_async_wait(0)",
            # accumulator i = 4j + q: row 16w + l/4 + 8(q/2), column 8j + 2(l%4) + q%2 (wgmma_layout)
            "    rw = r0_a + wg * 64 + (lt >> 5) * 16 + ((lt & 31) >> 2)",
            "    cl = r0_b + 2 * (lt & 3)"]
    store = "store_bf16" if out_bf16 else "store_add" if atomic else "store_acc" if accumulate else "store_f32"
    for j in range(N // 8):
        for h in range(2):
            src.append(f"    {store}(c, acc, rw + {8 * h}, cl + {8 * j}, M, N, d[{4 * j + 2 * h}], d[{4 * j + 2 * h + 1}])")
    return "\n".join(src) + "\n"


def kernel_source(t: WgmmaTiles = GPU_WGMMA, layout: str = "nn", out_bf16: bool = False, accumulate: bool = False,
                  atomic: bool = False) -> str:
    """The generated source of one build (for reading, and for the layout tests)."""
    from .gemm import LAYOUTS

    a_trans, b_trans = LAYOUTS[layout]
    return _kernel_source(t, a_trans, b_trans, out_bf16, accumulate, atomic)


def python_kernel(t: WgmmaTiles = GPU_WGMMA, layout: str = "nn", out_bf16: bool = False, accumulate: bool = False,
                  atomic: bool = False):
    """The generated Python function, not yet compiled (``cuda.compile_ptx`` takes it offline)."""
    from .gemm import LAYOUTS

    a_trans, b_trans = LAYOUTS[layout]
    return _python_kernel(t, a_trans, b_trans, out_bf16, accumulate, atomic)


def _python_kernel(t: WgmmaTiles, a_trans: bool, b_trans: bool, out_bf16: bool, accumulate: bool, atomic: bool):
    t.check()
    source = _kernel_source(t, a_trans, b_trans, out_bf16, accumulate, atomic)
    # the simulator's dynamic shared array takes a numpy dtype (it divides its size by .itemsize)
    names = {"cuda": cuda, "uint16": np.dtype(np.uint16) if simulating() else uint16, "float32": float32,
             "min": min, "max": max,
             "chunk_bytes": GS.chunk_bytes, "row_bytes": GS.row_bytes, "store_f32": GS.store_f32,
             "store_acc": GS.store_acc, "store_add": GS.store_add, "store_bf16": GS.store_bf16}
    for name in ("cp_async16_at", "cp_async_commit", "cp_async_wait"):
        names[name] = getattr(_mma, name)
    for name in ("shared_addr", "wgmma_zeros", "wgmma_bf16", "wgmma_pin", "wgmma_wait", "wgmma_fence",
                 "wgmma_commit", "fence_proxy_async"):
        names[name] = getattr(_wgmma, name)
    return generated_function(source, f"<gemm_wgmma {t.label()} {'t' if a_trans else 'n'}{'t' if b_trans else 'n'}>",
                              names)


@lru_cache(maxsize=None)
def make_gemm_wgmma(t: WgmmaTiles, a_trans: bool, b_trans: bool, out_bf16: bool = False, accumulate: bool = False,
                    atomic: bool = False):
    """The kernel ``kernel(a, b, acc, c, per)`` (as :func:`.gemm_bf16.make_gemm_bf16`'s, cp.async
    operands only)."""
    fn = _python_kernel(t, a_trans, b_trans, out_bf16, accumulate, atomic)
    if simulating():  # the intrinsics' twins (_wgmma): tiny sizes only
        return cuda.jit(fn)
    return fastlaunch.fast(_cuda_cache.cached(cuda.jit(max_registers=t.max_registers)(fn)))


def usable(tiles, aligned: bool) -> bool:
    """Whether a launch takes this kernel: wgmma tiles asked for, or none on an sm_90 device
    (the default there since 2026-12-07, Note [wgmma as the default]; ``VMSTOOLKIT_WGMMA=0``
    keeps mma.sync), and both operands 16-byte aligned."""
    if not aligned:
        return False
    if isinstance(tiles, WgmmaTiles):  # on the simulator too, through the intrinsics' twins
        return True
    if simulating():
        return False
    if tiles is not None or os.environ.get("VMSTOOLKIT_WGMMA", "1").strip() == "0":
        return False
    return compute_capability() == (9, 0)

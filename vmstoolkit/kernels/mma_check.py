"""One-warp kernels that check the tensor-core intrinsics (:mod:`._mma`) against the reference
layouts (:mod:`.mma_layout`) and numpy: :func:`validate` runs them all and raises on a mismatch.

On a GPU this proves the inline-PTX route (``mma.sync``, ``ldmatrix`` with and without ``.trans``,
``cp.async`` with zero fill, ``cvt.rn.bf16x2``, the bf16 widening; for the tf32 GEMM the m16n8k8
tf32 ``mma.sync``, ``cvt.rna.tf32.f32`` in both forms, ``cp.async`` of float32 and ``ld.shared.v4``);
under the simulator the same kernels run the intrinsics' twins, so the check there is of the twins
and of the kernels' indexing.

Cost: seven one-warp launches and O(32 x 16 x 16) numpy per check.
"""

from __future__ import annotations

import numpy as np
from numba import cuda, float32, uint16, uint32

from . import mma_layout as L
from ._mma import (bf16_to_f32, cp_async16, cp_async_commit, cp_async_wait, cvt_tf32, cvt_tf32_mma, ldmatrix_x4,
                   ldmatrix_x4_trans, lds4, mma_bf16, mma_tf32, pack_bf16x2)

LD_WORDS = 512  # the ldmatrix probe's shared array (uint16 elements)


@cuda.jit(device=True)
def _row4(out, row, regs):
    """``out[row, 0:4] = regs`` (a 4-tuple)."""
    out[row, 0] = regs[0]
    out[row, 1] = regs[1]
    out[row, 2] = regs[2]
    out[row, 3] = regs[3]


@cuda.jit
def _mma_probe(a, b, c, d):
    """One warp: A (16, 16), B (16, 8) (k by n) bf16 bits, C (16, 8) fp32 -> D = A B + C, each
    lane loading and storing its own fragments by the layout of ``mma_layout``."""
    lane = cuda.threadIdx.x
    g = lane >> 2
    t = lane & 3
    c2 = 2 * t
    a0 = uint32(a[g, c2]) | (uint32(a[g, c2 + 1]) << 16)
    a1 = uint32(a[g + 8, c2]) | (uint32(a[g + 8, c2 + 1]) << 16)
    a2 = uint32(a[g, c2 + 8]) | (uint32(a[g, c2 + 9]) << 16)
    a3 = uint32(a[g + 8, c2 + 8]) | (uint32(a[g + 8, c2 + 9]) << 16)
    b0 = uint32(b[c2, g]) | (uint32(b[c2 + 1, g]) << 16)
    b1 = uint32(b[c2 + 8, g]) | (uint32(b[c2 + 9, g]) << 16)
    d0, d1, d2, d3 = mma_bf16(a0, a1, a2, a3, b0, b1, c[g, c2], c[g, c2 + 1], c[g + 8, c2], c[g + 8, c2 + 1])
    d[g, c2] = d0
    d[g, c2 + 1] = d1
    d[g + 8, c2] = d2
    d[g + 8, c2 + 1] = d3


@cuda.jit
def _ldmatrix_probe(mem, rows, out, out_t):
    """One warp: ``mem`` copied to shared memory; lane l names row start ``rows[l]``; registers of
    ``ldmatrix.x4`` into ``out[l, :]`` and of ``.x4.trans`` into ``out_t[l, :]``."""
    smem = cuda.shared.array(LD_WORDS, uint16)
    lane = cuda.threadIdx.x
    for i in range(lane, LD_WORDS, 32):
        smem[i] = mem[i]
    cuda.syncthreads()
    _row4(out, lane, ldmatrix_x4(smem, rows[lane]))
    cuda.syncthreads()
    _row4(out_t, lane, ldmatrix_x4_trans(smem, rows[lane]))


@cuda.jit
def _cp_async_probe(g, out, nbytes):
    """One warp: lane l copies the 16 bytes at ``g[l // 2, 8 (l % 2)]`` (reading ``nbytes[l]``,
    zero-filling the rest) into shared memory by ``cp.async``, in two commit groups (lanes' first
    and second halves), waits, and writes shared memory back to ``out`` (32 x 8)."""
    smem = cuda.shared.array(256, uint16)
    lane = cuda.threadIdx.x
    smem[lane * 8] = uint16(0xFFFF)  # cp.async must overwrite this even when reading 0 bytes
    cuda.syncthreads()
    cp_async16(smem, lane * 8, g, lane // 2, 8 * (lane % 2), nbytes[lane])
    cp_async_commit()
    cp_async_wait(0)
    cuda.syncthreads()
    for e in range(8):
        out[lane, e] = smem[lane * 8 + e]


@cuda.jit
def _pack_probe(x, out):
    i = cuda.threadIdx.x
    if i < out.shape[0]:
        out[i] = pack_bf16x2(x[2 * i], x[2 * i + 1])


@cuda.jit
def _unpack_probe(bits, packed, out, out_lo, out_hi):
    """bf16_to_f32 of uint16 (or int16) elements, and of both halves of uint32 pairs."""
    i = cuda.threadIdx.x
    if i < bits.shape[0]:
        out[i] = bf16_to_f32(bits[i])
    if i < packed.shape[0]:
        out_lo[i] = bf16_to_f32(packed[i])
        out_hi[i] = bf16_to_f32(packed[i] >> 16)


@cuda.jit
def _mma_tf32_probe(a, b, c, d, convert):
    """One warp: A (16, 8), B (8, 8) (k by n), C (16, 8) float32 -> D = A B + C by m16n8k8 tf32,
    each lane loading its fragments by ``mma_layout``'s tf32 layout; ``convert``: the operands
    through ``cvt_tf32_mma`` first (else as they are: the tensor core reads their top 19 bits)."""
    lane = cuda.threadIdx.x
    g = lane >> 2
    t = lane & 3
    av = (a[g, t], a[g + 8, t], a[g, t + 4], a[g + 8, t + 4])
    bv = (b[t, g], b[t + 4, g])
    if convert:
        av = (cvt_tf32_mma(av[0]), cvt_tf32_mma(av[1]), cvt_tf32_mma(av[2]), cvt_tf32_mma(av[3]))
        bv = (cvt_tf32_mma(bv[0]), cvt_tf32_mma(bv[1]))
    c2 = 2 * t
    d0, d1, d2, d3 = mma_tf32(av[0], av[1], av[2], av[3], bv[0], bv[1],
                              c[g, c2], c[g, c2 + 1], c[g + 8, c2], c[g + 8, c2 + 1])
    d[g, c2] = d0
    d[g, c2 + 1] = d1
    d[g + 8, c2] = d2
    d[g + 8, c2 + 1] = d3


@cuda.jit
def _cvt_tf32_probe(x, out):
    i = cuda.threadIdx.x
    for j in range(i, x.shape[0], 32):
        out[j] = cvt_tf32(x[j])


@cuda.jit
def _smem_f32_probe(g, out, nbytes):
    """One warp: lane l copies the 16 bytes at ``g[l // 4, 4 (l % 4)]`` (``nbytes[l]`` of them, the
    rest zero-filled) into shared memory by ``cp.async`` on float32 arrays, then reads chunk
    ``31 - l`` back by ``lds4`` into ``out[l, :]``."""
    smem = cuda.shared.array(128, float32)
    lane = cuda.threadIdx.x
    smem[lane * 4] = float32(-1.0)  # cp.async must overwrite this even when reading 0 bytes
    cuda.syncthreads()
    cp_async16(smem, lane * 4, g, lane // 4, 4 * (lane % 4), nbytes[lane])
    cp_async_commit()
    cp_async_wait(0)
    cuda.syncthreads()
    _row4(out, lane, lds4(smem, (31 - lane) * 4))


def _small_ints(rng, shape):
    """bf16 bits of small integers: every product and sum of an m16n8k16 is exact in fp32."""
    return L.bf16_bits(rng.integers(-8, 9, size=shape).astype(np.float32))


def _close(what: str, got, want, tol: float) -> float:
    """max |got - want|, raising AssertionError naming ``what`` if it is not under ``tol``."""
    err = float(np.max(np.abs(got - want)))
    if not err < tol:
        raise AssertionError(f"{what}: max abs err {err:.3g}")
    return err


def check_mma(rng) -> dict:
    a = _small_ints(rng, (16, 16))
    b = _small_ints(rng, (16, 8))
    c = rng.integers(-64, 65, size=(16, 8)).astype(np.float32)
    d = cuda.device_array((16, 8), np.float32)
    _mma_probe[1, 32](cuda.to_device(a), cuda.to_device(b), cuda.to_device(c), d)
    got = d.copy_to_host()
    want = L.bf16_value(a) @ L.bf16_value(b) + c
    layout = L.c_matrix(L.mma(L.a_fragments(a), L.b_fragments(b), L.c_fragments(c)))
    if not (np.array_equal(got, want) and np.array_equal(layout, want)):
        raise AssertionError(f"mma_bf16: {int(np.sum(got != want))} of 128 outputs differ from numpy")
    # random (non-integer) values: fp32 accumulation, compare with a tolerance
    a = L.bf16_bits(rng.standard_normal((16, 16)).astype(np.float32))
    b = L.bf16_bits(rng.standard_normal((16, 8)).astype(np.float32))
    c = rng.standard_normal((16, 8)).astype(np.float32)
    _mma_probe[1, 32](cuda.to_device(a), cuda.to_device(b), cuda.to_device(c), d)
    want = L.bf16_value(a).astype(np.float64) @ L.bf16_value(b).astype(np.float64) + c
    return {"check": "mma", "max_abs_err": _close("mma_bf16 on normal values", d.copy_to_host(), want, 1e-4)}


def check_ldmatrix(rng) -> dict:
    mem = rng.integers(0, 1 << 16, size=LD_WORDS, dtype=np.uint16)
    # 32 distinct 16-byte-aligned row starts, in a shuffled order
    rows = (rng.permutation(LD_WORDS // 8)[:32] * 8).astype(np.int32)
    out = cuda.device_array((32, 4), np.uint32)
    out_t = cuda.device_array((32, 4), np.uint32)
    _ldmatrix_probe[1, 32](cuda.to_device(mem), cuda.to_device(rows), out, out_t)
    for trans, got in ((False, out.copy_to_host()), (True, out_t.copy_to_host())):
        want = L.ldmatrix(mem, rows, trans)
        if not np.array_equal(got, want):
            raise AssertionError(f"ldmatrix_x4{'_trans' if trans else ''}: {int(np.sum(got != want))} "
                                 f"of 128 registers differ from the reference layout")
    return {"check": "ldmatrix"}


def check_cp_async(rng) -> dict:
    g = rng.integers(0, 1 << 16, size=(16, 16), dtype=np.uint16)
    nbytes = np.where(rng.random(32) < 0.7, 16, 0).astype(np.int32)
    out = cuda.device_array((32, 8), np.uint16)
    _cp_async_probe[1, 32](cuda.to_device(g), out, cuda.to_device(nbytes))
    want = g.reshape(32, 8) * (nbytes[:, None] == 16)
    got = out.copy_to_host()
    if not np.array_equal(got, want):
        raise AssertionError(f"cp_async16: {int(np.sum(got != want))} of 256 elements differ")
    return {"check": "cp_async"}


def check_pack(rng) -> dict:
    x = np.concatenate([rng.standard_normal(60).astype(np.float32) * 1e3,
                        np.array([1.00390625, 1.01171875, -0.0, 3.0e38], np.float32)])  # ties, -0, overflow
    out = cuda.device_array(32, np.uint32)
    _pack_probe[1, 32](cuda.to_device(x), out)
    bits = L.bf16_bits(x)
    want = L.pack(bits[0::2], bits[1::2])
    got = out.copy_to_host()
    if not np.array_equal(got, want):
        raise AssertionError(f"pack_bf16x2: {int(np.sum(got != want))} of 32 pairs differ from round-to-nearest-even")
    return {"check": "pack"}


def check_unpack(rng) -> dict:
    """``bf16_to_f32`` (the bf16 path's widening, :mod:`.bf16`) on uint16, int16 and packed pairs;
    apart from :func:`validate`, whose list of checks callers compare."""
    bits = rng.integers(0, 1 << 16, size=32, dtype=np.uint16)
    bits[(bits & 0x7F80) == 0x7F80] &= 0xBFFF  # no NaN or inf: compare values with ==
    packed = L.pack(bits[:16], bits[16:])
    outs = [cuda.device_array(n, np.float32) for n in (32, 16, 16)]
    for b in (bits, bits.view(np.int16)):
        _unpack_probe[1, 32](cuda.to_device(b), cuda.to_device(packed), *outs)
        got, lo, hi = (o.copy_to_host() for o in outs)
        want = L.bf16_value(bits)
        if not (np.array_equal(got, want) and np.array_equal(lo, want[:16]) and np.array_equal(hi, want[16:])):
            raise AssertionError(f"bf16_to_f32 ({b.dtype}): {int(np.sum(got != want))} of 32 values differ")
    return {"check": "unpack"}


def check_mma_tf32(rng) -> dict:
    """m16n8k8 tf32: small integers (exact) with the fragment layout, then normal values through
    ``cvt_tf32_mma`` against a float64 product of tf32-rounded operands."""
    a = rng.integers(-8, 9, size=(16, 8)).astype(np.float32)
    b = rng.integers(-8, 9, size=(8, 8)).astype(np.float32)
    c = rng.integers(-64, 65, size=(16, 8)).astype(np.float32)
    d = cuda.device_array((16, 8), np.float32)
    _mma_tf32_probe[1, 32](cuda.to_device(a), cuda.to_device(b), cuda.to_device(c), d, False)
    got = d.copy_to_host()
    want = a @ b + c
    layout = L.c_matrix(L.mma_tf32(L.a_fragments_tf32(a), L.b_fragments_tf32(b), L.c_fragments(c)))
    if not (np.array_equal(got, want) and np.array_equal(layout, want)):
        raise AssertionError(f"mma_tf32: {int(np.sum(got != want))} of 128 outputs differ from numpy")
    a = rng.standard_normal((16, 8)).astype(np.float32)
    b = rng.standard_normal((8, 8)).astype(np.float32)
    c = rng.standard_normal((16, 8)).astype(np.float32)
    _mma_tf32_probe[1, 32](cuda.to_device(a), cuda.to_device(b), cuda.to_device(c), d, True)
    want = L.tf32_round(a).astype(np.float64) @ L.tf32_round(b).astype(np.float64) + c
    err = _close("mma_tf32 on cvt_tf32_mma-rounded normal values", d.copy_to_host(), want, 1e-5)
    return {"check": "mma_tf32", "max_abs_err": err}


def check_cvt_tf32(rng) -> dict:
    """``cvt_tf32`` bit for bit against ``mma_layout.tf32_round``: normal values at several
    scales, ties (away from zero, both signs), inf, the largest float (rounds to inf), denormals."""
    ulp = 2.0 ** -10
    special = np.array([1 + ulp / 2, -(1 + ulp / 2), 1 + 1.5 * ulp, 1 + ulp / 2 - 2.0 ** -23, np.inf, -np.inf,
                        np.finfo(np.float32).max, 1e-45, -3e-39, 0.0, -0.0], np.float32)
    x = np.concatenate([(rng.standard_normal(53) * 10.0 ** rng.integers(-20, 20, 53)).astype(np.float32), special])
    out = cuda.device_array(x.shape, np.float32)
    _cvt_tf32_probe[1, 32](cuda.to_device(x), out)
    got, want = out.copy_to_host().view(np.uint32), L.tf32_round(x).view(np.uint32)
    if not np.array_equal(got, want):
        bad = np.flatnonzero(got != want)[:4]
        raise AssertionError(f"cvt_tf32: {len(np.flatnonzero(got != want))} of {x.size} differ from round-to-"
                             f"nearest-away with the low 13 bits cleared, e.g. x={x[bad]} got bits "
                             f"{[hex(v) for v in got[bad]]} want {[hex(v) for v in want[bad]]}")
    return {"check": "cvt_tf32"}


def check_smem_f32(rng) -> dict:
    """``cp_async16`` of float32 arrays (4 elements a chunk, zero fill) and ``lds4`` reading back."""
    g = rng.standard_normal((8, 16)).astype(np.float32)
    nbytes = np.where(rng.random(32) < 0.7, 16, 0).astype(np.int32)
    out = cuda.device_array((32, 4), np.float32)
    _smem_f32_probe[1, 32](cuda.to_device(g), out, cuda.to_device(nbytes))
    chunks = g.reshape(32, 4) * (nbytes[:, None] == 16)
    want = chunks[::-1]
    got = out.copy_to_host()
    if not np.array_equal(got, want):
        raise AssertionError(f"cp_async16 (float32) / lds4: {int(np.sum(got != want))} of 128 elements differ")
    return {"check": "smem_f32"}


def validate(seed: int = 0) -> list[dict]:
    """Every check above; raises ``AssertionError`` naming the first mismatch."""
    rng = np.random.default_rng(seed)
    return [check(rng) for check in (check_mma, check_ldmatrix, check_cp_async, check_pack, check_mma_tf32,
                                     check_cvt_tf32, check_smem_f32)]

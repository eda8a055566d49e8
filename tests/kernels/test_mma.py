"""The tensor-core route on the CPU: the reference fragment layouts of mma.m16n8k16 and ldmatrix
(:mod:`vmstoolkit.kernels.mma_layout`), the intrinsics' simulator twins against them
(``mma_check.validate`` under the simulator), and the bf16 GEMM's three layouts at tiny ragged
sizes, by both fetch paths, split k and an accumulator, on the simulator's one-warp tiles."""

import numpy as np
import pytest

from vmstoolkit.errors import KernelError
from vmstoolkit.kernels import mma_layout as L


def test_every_element_has_one_owner():
    """Each element of A, B and C is held by exactly one (lane, register, half)."""
    for coords, shape, regs in ((L.a_coords, (16, 16), 4), (L.b_coords, (16, 8), 2)):
        seen = [rc for lane in range(32) for reg in coords(lane) for rc in reg]
        assert len(seen) == len(set(seen)) == shape[0] * shape[1]
        assert len(coords(0)) == regs
    seen = [rc for lane in range(32) for rc in L.c_coords(lane)]
    assert sorted(seen) == [(r, c) for r in range(16) for c in range(8)]


def test_layout_matches_the_ptx_figures():
    """Spot values from the PTX ISA's fragment figures for m16n8k16 (bf16) and ldmatrix."""
    assert L.a_coords(0)[0] == ((0, 0), (0, 1))  # lane 0, a0: row 0, cols 0-1
    assert L.a_coords(5)[3] == ((9, 10), (9, 11))  # lane 5 = group 1, thread 1: a3 at row 9, cols 10-11
    assert L.b_coords(6)[1] == ((12, 1), (13, 1))  # lane 6: b1 at k 12-13, column 1
    assert L.c_coords(31) == [(7, 6), (7, 7), (15, 6), (15, 7)]


def test_fragments_round_trip_and_mma_is_a_matmul():
    rng = np.random.default_rng(1)
    a = L.bf16_bits(rng.standard_normal((16, 16)).astype(np.float32))
    b = L.bf16_bits(rng.standard_normal((16, 8)).astype(np.float32))
    c = rng.standard_normal((16, 8)).astype(np.float32)
    assert np.array_equal(L.a_matrix(L.a_fragments(a)), a)
    assert np.array_equal(L.b_matrix(L.b_fragments(b)), b)
    assert np.array_equal(L.c_matrix(L.c_fragments(c)), c)
    d = L.c_matrix(L.mma(L.a_fragments(a), L.b_fragments(b), L.c_fragments(c)))
    want = L.bf16_value(a).astype(np.float64) @ L.bf16_value(b).astype(np.float64) + c
    assert np.allclose(d, want, rtol=0, atol=1e-5)
    # a register's low half is the lower column: swapping halves must change the product
    swapped = L.a_fragments(a)
    swapped = (swapped >> 16) | (swapped << 16)
    assert not np.allclose(L.c_matrix(L.mma(swapped, L.b_fragments(b), L.c_fragments(c))), want, atol=1e-3)


def test_ldmatrix_trans_is_the_transpose():
    """ldmatrix.trans of four 8x8 matrices gives what the plain load gives of their transposes."""
    rng = np.random.default_rng(2)
    mats = rng.integers(0, 1 << 16, size=(4, 8, 8), dtype=np.uint16)
    rows = np.arange(32) * 8  # matrix j's row r at element (8 j + r) * 8
    plain = L.ldmatrix(mats.reshape(-1), rows)
    trans_of_t = L.ldmatrix(np.transpose(mats, (0, 2, 1)).reshape(-1), rows, trans=True)
    assert np.array_equal(plain, trans_of_t)
    lo, hi = L.unpack(plain[9])  # lane 9: group 2, thread 1 -> row 2, elements 2 and 3
    assert lo[1] == mats[1, 2, 2] and hi[1] == mats[1, 2, 3]


def test_bf16_rounding():
    x = np.array([1.0, 1.00390625, 1.01171875, -2.5, np.inf, 3.0e38, 1e-40], np.float32)
    bits = L.bf16_bits(x)
    assert list(L.bf16_value(bits)[:5]) == [1.0, 1.0, 1.015625, -2.5, np.inf]  # ties to even
    assert np.isnan(L.bf16_value(L.bf16_bits(np.array([np.nan], np.float32))))[0]
    with pytest.raises(KernelError, match="shape"):
        L.a_fragments(np.zeros((8, 8), np.uint16))


def test_tf32_layout_every_element_has_one_owner_and_matches_the_ptx_figure():
    """m16n8k8 with tf32 operands: one element a register, each of A (16 x 8) and B (8 x 8) held
    once; spot values from the PTX ISA's figure (CUTLASS's SM80_16x8x8_F32TF32TF32F32_TN)."""
    seen = [rc for lane in range(32) for rc in L.a_coords_tf32(lane)]
    assert sorted(seen) == [(r, c) for r in range(16) for c in range(8)]
    seen = [kn for lane in range(32) for kn in L.b_coords_tf32(lane)]
    assert sorted(seen) == [(k, n) for k in range(8) for n in range(8)]
    assert L.a_coords_tf32(0) == [(0, 0), (8, 0), (0, 4), (8, 4)]
    assert L.a_coords_tf32(6) == [(1, 2), (9, 2), (1, 6), (9, 6)]  # group 1, thread 2
    assert L.b_coords_tf32(31) == [(3, 7), (7, 7)]
    assert L.b_coords_tf32(5) == [(1, 1), (5, 1)]


def test_tf32_mma_reference_is_a_matmul_of_tf32_operands():
    rng = np.random.default_rng(5)
    a = rng.standard_normal((16, 8)).astype(np.float32)
    b = rng.standard_normal((8, 8)).astype(np.float32)
    c = rng.standard_normal((16, 8)).astype(np.float32)
    assert np.array_equal(L.a_matrix_tf32(L.a_fragments_tf32(a)), a)
    assert np.array_equal(L.b_matrix_tf32(L.b_fragments_tf32(b)), b)
    d = L.c_matrix(L.mma_tf32(L.a_fragments_tf32(L.tf32_round(a)), L.b_fragments_tf32(L.tf32_round(b)),
                              L.c_fragments(c)))
    want = L.tf32_round(a).astype(np.float64) @ L.tf32_round(b).astype(np.float64) + c
    assert np.allclose(d, want, rtol=0, atol=1e-5)
    # the operands are read as tf32: unrounded fp32 inputs give the truncated product, not the fp32 one
    d = L.c_matrix(L.mma_tf32(L.a_fragments_tf32(a), L.b_fragments_tf32(b), L.c_fragments(c)))
    trunc = L.tf32_truncate(a).astype(np.float64) @ L.tf32_truncate(b).astype(np.float64) + c
    assert np.allclose(d, trunc, rtol=0, atol=1e-5)
    assert not np.allclose(d, a.astype(np.float64) @ b + c, rtol=0, atol=1e-4)
    # swapping A's registers 1 and 2 (rows g+8 and columns t+4) must change the product
    fr = L.a_fragments_tf32(L.tf32_round(a))[:, [0, 2, 1, 3]]
    assert not np.allclose(L.c_matrix(L.mma_tf32(fr, L.b_fragments_tf32(L.tf32_round(b)), L.c_fragments(c))),
                           want, atol=1e-3)
    with pytest.raises(KernelError, match="shape"):
        L.a_fragments_tf32(np.zeros((16, 16), np.float32))


def test_tf32_rounding_is_to_nearest_ties_away():
    one = np.float32(1.0)
    ulp = np.float32(2.0 ** -10)  # a tf32 ulp at 1
    x = np.array([1.0, one + ulp / 2, -(one + ulp / 2), one + ulp * 1.5, one + ulp / 2 - 2.0 ** -23,
                  np.inf, -np.inf, np.finfo(np.float32).max, 1e-45], np.float32)
    got = L.tf32_round(x)
    assert list(got[:7]) == [1.0, one + ulp, -(one + ulp), one + 2 * ulp, 1.0, np.inf, -np.inf]
    assert got[7] == np.inf  # past the largest finite tf32
    assert got[8] == 0.0  # the smallest denormal: its bit is one of the 13 dropped, below half
    assert np.isnan(L.tf32_round(np.array([np.nan], np.float32)))[0]
    assert np.all(L.tf32_round(x[:5]).view(np.uint32) & 0x1FFF == 0)
    r = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    assert np.max(np.abs(L.tf32_round(r) - r) / np.abs(r)) <= 2.0 ** -11  # half an ulp of 10 bits


def test_the_tf32_twins_convert_load_and_multiply():
    """Under the simulator: cvt_tf32 is tf32_round, lds4 wants 16-byte-aligned indices."""
    from vmstoolkit.kernels import _mma

    assert _mma.cvt_tf32(np.float32(1 + 2.0 ** -11)) == np.float32(1 + 2.0 ** -10)
    smem = np.arange(8, dtype=np.float32)
    assert _mma.lds4(smem, 4) == (4.0, 5.0, 6.0, 7.0)
    with pytest.raises(AssertionError, match="aligned"):
        _mma.lds4(smem, 2)


def test_the_gpu_widening_takes_what_kernels_pass_it():
    """``bf16_to_f32`` on the GPU types its argument itself (the simulator twin takes anything):
    ``packed[i] >> 16`` on a uint32 array is an int64, which it refused on the H200 (typing error in
    ``mma_check.check_unpack``'s probe)."""
    from numba import types

    from vmstoolkit.kernels._mma import widens

    for t in (types.uint16, types.int16, types.uint32, types.int32, types.int64, types.uint64):
        assert widens(t), t
    assert not widens(types.float32)


def test_intrinsic_twins_match_the_reference():
    from vmstoolkit.kernels import mma_check

    assert [r["check"] for r in mma_check.validate()] == ["mma", "ldmatrix", "cp_async", "pack", "mma_tf32",
                                                         "cvt_tf32", "smem_f32"]


def _bits(rng, shape):
    return L.bf16_bits(rng.standard_normal(shape).astype(np.float32))


@pytest.mark.parametrize("m, n, k", [(17, 24, 40), (5, 9, 7)])  # cp.async operands; element-wise ones
def test_gemm_bf16_layouts(m, n, k):
    from numba import cuda

    from vmstoolkit.kernels import gemm_bf16 as GB

    from mma_cases import layout_cases

    x, w, dy, cases = layout_cases(np.random.default_rng(m), m, n, k)
    for layout, fn, a, b, shape in cases:
        want = GB.reference(layout, a, b)
        out = cuda.device_array(shape, np.float32)
        fn(cuda.to_device(a), cuda.to_device(b), out)
        got = out.copy_to_host()
        assert np.max(np.abs(got - want)) <= 1e-5 * np.max(np.abs(want)), layout
        out16 = cuda.device_array(shape, np.uint16)
        fn(cuda.to_device(a), cuda.to_device(b), out16)
        # one rounding to bf16 (half an ulp: 2^-9 of the value) of a sum that is right to 1e-5
        assert np.max(np.abs(L.bf16_value(out16.copy_to_host()) - want)) <= 2 ** -8 * np.max(np.abs(want)), layout


def test_gemm_bf16_deep_slices_and_warps():
    """Slices 64 deep (rows of 8 chunks, another swizzle) on 4 warps of 16 x 16, 2 and 3 stages."""
    from numba import cuda

    from vmstoolkit.kernels import gemm_bf16 as GB

    rng = np.random.default_rng(4)
    m, n, k = 17, 24, 136
    x, w, dy = _bits(rng, (m, k)), _bits(rng, (n, k)), _bits(rng, (m, n))
    tiles = GB.MmaTiles(bm=32, bn=32, wm=16, wn=16, stages=3, bk=64)
    for layout, fn, a, b, shape in (("nn", GB.gemm_bf16, x, w, (m, n)), ("tt", GB.linear_dw_bf16, dy, x, (n, k))):
        want = GB.reference(layout, a, b)
        out = cuda.device_array(shape, np.float32)
        fn(cuda.to_device(a), cuda.to_device(b), out, tiles=tiles)
        assert np.max(np.abs(out.copy_to_host() - want)) <= 1e-5 * np.max(np.abs(want)), layout


def test_gemm_bf16_split_and_acc():
    from numba import cuda

    from vmstoolkit.kernels import gemm_bf16 as GB

    rng = np.random.default_rng(3)
    m, n, k = 9, 20, 72  # three k slices
    x, w = _bits(rng, (m, k)), _bits(rng, (n, k))
    acc = rng.standard_normal((m, n)).astype(np.float32)
    want = GB.reference("nn", x, w, acc)
    for splits in (1, 3):
        out = cuda.device_array((m, n), np.float32)
        GB.gemm_bf16(cuda.to_device(x), cuda.to_device(w), out, acc=cuda.to_device(acc), splits=splits)
        assert np.max(np.abs(out.copy_to_host() - want)) <= 1e-5 * np.max(np.abs(want)), splits


def test_gemm_bf16_rejects_bad_input():
    from numba import cuda

    from vmstoolkit.kernels import gemm_bf16 as GB

    x, w = cuda.to_device(np.zeros((4, 8), np.uint16)), cuda.to_device(np.zeros((3, 8), np.uint16))
    with pytest.raises(KernelError, match="float32"):
        GB.gemm_bf16(cuda.to_device(np.zeros((4, 8), np.float32)), w, cuda.device_array((4, 3), np.float32))
    with pytest.raises(KernelError, match="shape"):
        GB.gemm_bf16(x, w, cuda.device_array((4, 4), np.float32))
    with pytest.raises(KernelError, match="acc needs a float32 output"):
        GB.gemm_bf16(x, w, cuda.device_array((4, 3), np.uint16), acc=cuda.device_array((4, 3), np.float32))
    with pytest.raises(KernelError, match="splits"):
        GB.gemm_bf16(x, w, cuda.device_array((4, 3), np.uint16), splits=2)


def test_gemm_bf16_ragged_rows_with_aligned_pitch():
    """Operands whose rows are 16-byte aligned (pitch a multiple of 8) but whose length is not a
    multiple of 8 take the cp.async fetch: the last chunk of a row must stop at the row's end,
    not read the padding after it (filled here with large values, so reading it shows)."""
    from numba import cuda

    from vmstoolkit.kernels import gemm_bf16 as GB

    rng = np.random.default_rng(5)
    m, n, k = 5, 13, 13  # k and n end mid-chunk; the arrays' pitch is 16 elements
    garbage = L.bf16_bits(np.full(1, 1e4, np.float32))[0]

    def padded(rows, cols):
        full = np.full((rows, 16), garbage, np.uint16)
        full[:, :cols] = _bits(rng, (rows, cols))
        dev = cuda.to_device(full)[:, :cols]
        assert GB.aligned_b16(dev), "the view must take the cp.async path"
        return full[:, :cols], dev

    (x, xd), (w, wd), (dy, dyd) = padded(m, k), padded(n, k), padded(m, n)
    for layout, fn, a, ad, b, bd, shape in (("nn", GB.gemm_bf16, x, xd, w, wd, (m, n)),
                                           ("nt", GB.linear_dx_bf16, dy, dyd, w, wd, (m, k)),
                                           ("tt", GB.linear_dw_bf16, dy, dyd, x, xd, (n, k))):
        want = GB.reference(layout, a, b)
        out = cuda.device_array(shape, np.float32)
        fn(ad, bd, out)
        assert np.max(np.abs(out.copy_to_host() - want)) <= 1e-5 * np.max(np.abs(want)), layout

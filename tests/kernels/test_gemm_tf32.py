"""The tf32 / 3xtf32 tensor-core GEMM (:mod:`vmstoolkit.kernels.gemm_tf32`) under the simulator, in
its three layouts at tiny ragged sizes, by both fetch paths, slices 16 and 32 deep, split k, an
accumulator and views; and the real kernel's PTX for sm_90 (where NVVM and NVRTC are present).

Error bounds. "tf32" against a float64 product of the same tf32-rounded operands (the products
are then exact): the simulated mma rounds its fp32 sum once per k8 step, so each output is off by
at most ceil(K / 8) roundings of partial sums, |err| <= ceil(K / 8) u sum_k |a_k b_k| (u = 2^-24);
we allow 2u a step, which covers a tensor core that truncates. "3xtf32" against the exact
product: the dropped a_small b_small term is below 2^-22 of each product, so the error is that of
an fp32 accumulation; we check it is within 4x numpy's float32 GEMM and 100x below plain tf32's.
"""

import math

import numpy as np
import pytest
from numba import cuda

from vmstoolkit.errors import KernelError
from vmstoolkit.kernels import gemm_tf32 as GT
from vmstoolkit.kernels import mma_layout as L

U = 2.0 ** -24


def _operands(layout, a, b):
    """(A, B) as the (R, K) and (K, C) matrices of the product, from the stored operands."""
    a_trans, b_trans = GT.LAYOUTS[layout]
    return (a.T if a_trans else a), (b if b_trans else b.T)


def _cases(x, w, dy, m, n, k):
    return (("nn", GT.gemm_tf32, x, w, (m, n)), ("nt", GT.linear_dx_tf32, dy, w, (m, k)),
            ("tt", GT.linear_dw_tf32, dy, x, (n, k)))


def _run(fn, a, b, shape, **kw):
    out = cuda.to_device(np.full(shape, np.nan, np.float32))  # every output must be written
    fn(a if hasattr(a, "copy_to_host") else cuda.to_device(a), b if hasattr(b, "copy_to_host") else cuda.to_device(b),
       out, **kw)
    return out.copy_to_host()


def check_tf32(layout, a, b, got, acc=None):
    """|got - ref| within ceil(K/8) 2u of sum |a b| (ref: tf32-rounded operands, float64)."""
    A, B = _operands(layout, a, b)
    ref = GT.reference(layout, a, b, acc, precision="tf32")
    mag = np.abs(L.tf32_round(A)).astype(np.float64) @ np.abs(L.tf32_round(B)).astype(np.float64)
    if acc is not None:
        mag += np.abs(acc)
    bound = (math.ceil(A.shape[1] / 8) + 1) * 2 * U * mag
    assert not np.isnan(got).any(), layout
    excess = np.abs(got - ref) - bound
    assert excess.max() <= 0, (layout, float(np.max(np.abs(got - ref) / np.maximum(mag, 1e-30))))


def errors(layout, a, b, got):
    """(ours, numpy float32's, plain tf32's) max |x - exact| / max |exact|."""
    A, B = _operands(layout, a, b)
    exact = GT.reference(layout, a, b, precision="fp32")
    scale = np.max(np.abs(exact))
    f32 = A.astype(np.float32) @ B.astype(np.float32)
    tf32 = GT.reference(layout, a, b, precision="tf32")
    return tuple(float(np.max(np.abs(v - exact)) / scale) for v in (got, f32, tf32))


def check_3xtf32(layout, a, b, got):
    ours, f32, tf32 = errors(layout, a, b, got)
    assert not np.isnan(got).any(), layout
    assert ours <= 4 * max(f32, 2 * U), (layout, ours, f32)  # about fp32's
    assert ours * 100 <= tf32, (layout, ours, tf32)  # and far below plain tf32's


@pytest.mark.parametrize("m, n, k", [(17, 24, 40), (5, 9, 7)])  # cp.async operands; element-wise ones
def test_layouts_both_precisions(m, n, k):
    rng = np.random.default_rng(m)
    x, w, dy = (rng.standard_normal(s).astype(np.float32) for s in ((m, k), (n, k), (m, n)))
    for layout, fn, a, b, shape in _cases(x, w, dy, m, n, k):
        check_tf32(layout, a, b, _run(fn, a, b, shape, precision="tf32"))
        check_3xtf32(layout, a, b, _run(fn, a, b, shape, precision="3xtf32"))


def test_the_checks_tell_tf32_from_3xtf32_and_from_unrounded_operands():
    """The bounds above can fail: 3xtf32's output fails the tf32 check's 'same rounding' (it is
    more accurate), tf32's fails the 3xtf32 one, and truncated operands (what the mma reads
    without the cvt) fail the tf32 one."""
    rng = np.random.default_rng(2)
    m, n, k = 17, 24, 40
    x, w = rng.standard_normal((m, k)).astype(np.float32), rng.standard_normal((n, k)).astype(np.float32)
    y3 = _run(GT.gemm_tf32, x, w, (m, n), precision="3xtf32")
    y1 = _run(GT.gemm_tf32, x, w, (m, n), precision="tf32")
    with pytest.raises(AssertionError):
        check_tf32("nn", x, w, y3)
    with pytest.raises(AssertionError):
        check_3xtf32("nn", x, w, y1)
    trunc = (L.tf32_truncate(x).astype(np.float64) @ L.tf32_truncate(w).astype(np.float64).T).astype(np.float32)
    with pytest.raises(AssertionError):
        check_tf32("nn", x, w, trunc)


def test_deep_slices_and_four_warps():
    """Slices 32 deep (rows of 8 chunks: the other "n" swizzle, the XOR-16 second k16 block), on 4
    warps of 16 x 16 whose "t" tiles are 32 wide (the full "t" swizzle), 2 stages."""
    rng = np.random.default_rng(4)
    m, n, k = 17, 24, 72
    x, w, dy = (rng.standard_normal(s).astype(np.float32) for s in ((m, k), (n, k), (m, n)))
    tiles = GT.Tf32Tiles(bm=32, bn=32, wm=16, wn=16, stages=2, bk=32)
    for layout, fn, a, b, shape in _cases(x, w, dy, m, n, k):
        check_tf32(layout, a, b, _run(fn, a, b, shape, precision="tf32", tiles=tiles))
        check_3xtf32(layout, a, b, _run(fn, a, b, shape, precision="3xtf32", tiles=tiles))


def test_split_k_and_acc():
    rng = np.random.default_rng(3)
    m, n, k = 9, 20, 40  # three k slices of 16
    x, w = rng.standard_normal((m, k)).astype(np.float32), rng.standard_normal((n, k)).astype(np.float32)
    acc = rng.standard_normal((m, n)).astype(np.float32)
    for splits in (1, 3):
        got = _run(GT.gemm_tf32, x, w, (m, n), acc=cuda.to_device(acc), splits=splits)
        check_tf32("nn", x, w, got, acc)
    dy = rng.standard_normal((m, n)).astype(np.float32)
    dw0 = rng.standard_normal((n, k)).astype(np.float32)
    dw = cuda.to_device(dw0)  # accumulate in place
    GT.linear_dw_tf32(cuda.to_device(dy), cuda.to_device(x), dw, acc=dw, precision="3xtf32")
    exact = dw0 + dy.astype(np.float64).T @ x
    assert np.max(np.abs(dw.copy_to_host() - exact)) <= 8 * U * np.max(np.abs(exact))


def test_views_and_strides():
    """A padded view (16-byte rows, K = 13 ends inside a chunk: cp.async reads 4 of its bytes; the
    twin's NaN past the row would show otherwise), a view starting mid-row (element-wise fetch), a
    transposed view (column stride != 1), an output that is a view of a wider array."""
    rng = np.random.default_rng(7)
    m, n, k = 6, 10, 13
    big_x = cuda.to_device(rng.standard_normal((m, 20)).astype(np.float32))
    big_w = cuda.to_device(rng.standard_normal((n, 20)).astype(np.float32))
    hx, hw = big_x.copy_to_host(), big_w.copy_to_host()
    for off in (0, 3):
        x, w = big_x[:, off:off + k], big_w[:, off:off + k]
        assert GT.aligned16(x) == (off == 0)
        wide = cuda.to_device(np.full((m, n + 8), 7.0, np.float32))
        for precision in GT.PRECISIONS:
            GT.gemm_tf32(x, w, wide[:, 4:4 + n], precision=precision)
            out = wide.copy_to_host()
            assert (out[:, :4] == 7).all() and (out[:, 4 + n:] == 7).all(), off
            (check_tf32 if precision == "tf32" else check_3xtf32)("nn", hx[:, off:off + k], hw[:, off:off + k],
                                                                   out[:, 4:4 + n])
    xt = rng.standard_normal((k, m)).astype(np.float32)
    dxt = cuda.to_device(xt)
    got = _run(GT.gemm_tf32, dxt.T, cuda.to_device(np.ascontiguousarray(hw[:, :k])), (m, n))
    check_tf32("nn", xt.T, hw[:, :k], got)


def test_rejects_bad_input():
    f = lambda *s, dt=np.float32: cuda.to_device(np.zeros(s, dt))  # noqa: E731
    x, w = f(4, 8), f(3, 8)
    with pytest.raises(KernelError, match=r"^x must be float32, got dtype=float64 \(shape=\(4, 8\)\)$"):
        GT.gemm_tf32(f(4, 8, dt=np.float64), w, f(4, 3))
    with pytest.raises(KernelError, match=r"^y must be float32, got dtype=uint16"):
        GT.gemm_tf32(x, w, f(4, 3, dt=np.uint16))
    with pytest.raises(KernelError, match=r"^gemm_tf32: y has shape \(4, 4\), expected \(4, 3\)"):
        GT.gemm_tf32(x, w, f(4, 4))
    with pytest.raises(KernelError, match=r"^linear_dx_tf32: w has shape \(5, 8\), expected \(3, 8\)"):
        GT.linear_dx_tf32(f(4, 3), f(5, 8), f(4, 8))
    with pytest.raises(KernelError, match="acc must be float32"):
        GT.gemm_tf32(x, w, f(4, 3), acc=f(4, 3, dt=np.float64))
    with pytest.raises(KernelError, match=r"^precision must be one of 'tf32', '3xtf32', got 'fp16'$"):
        GT.gemm_tf32(x, w, f(4, 3), precision="fp16")
    with pytest.raises(KernelError, match="splits=9"):
        GT.gemm_tf32(x, w, f(4, 3), splits=9)
    from vmstoolkit.kernels.gemm_bf16 import MmaTiles

    with pytest.raises(KernelError, match="Tf32Tiles"):
        GT.gemm_tf32(x, w, f(4, 3), tiles=MmaTiles(bm=16, bn=16, wm=16, wn=16))
    with pytest.raises(KernelError, match="bk must be 16 or 32"):
        GT.gemm_tf32(x, w, f(4, 3), tiles=GT.Tf32Tiles(bm=16, bn=16, wm=16, wn=16, bk=64))


def test_swizzles_permute_chunks_within_a_row():
    """Each swizzle maps a row's chunks onto the row's chunks (no two to one place)."""
    for bk in (16, 32):
        for r in range(8):
            offs = [eval(GT._swizzle_n(str(r), str(c), bk)) for c in range(bk // 4)]  # noqa: S307 - our text
            assert sorted(offs) == [r * bk + 4 * c for c in range(bk // 4)], (bk, r)
    for width in (8, 16, 32, 128):
        for k in range(32):
            offs = [eval(GT._swizzle_t(str(k), str(c), width)) for c in range(width // 4)]  # noqa: S307
            assert sorted(offs) == [k * width + 4 * c for c in range(width // 4)], (width, k)


def test_t_tile_loads_hit_32_banks():
    """A warp's LDS.32 of a "t" tile (lanes (g, t): k row 4t + e, column base + g) on the 128-wide
    GPU tile touches 32 distinct banks, for each k16 block, e, and tile column offset."""
    W = GT.GPU_TILES.bm
    for e in range(4):
        for col0 in range(0, 64, 8):
            banks = set()
            for lane in range(32):
                g, t = lane >> 2, lane & 3
                kk, m = 4 * t + e, col0 + g
                off = eval(GT._swizzle_t(str(kk), str(m >> 2), W)) + (m & 3)  # noqa: S307
                banks.add(off % 32)
            assert len(banks) == 32, (e, col0)


_PTX_PROBE = r"""from vmstoolkit.kernels import gemm_tf32 as GT
arr = types.Array(types.float32, 2, "A")
t = GT.Tf32Tiles(bm=32, bn=32, wm=16, wn=16, stages=2)  # small: seconds to compile
for layout in ("nn", "tt"):
    a_t, b_t = GT.LAYOUTS[layout]
    for precision in GT.PRECISIONS:
        k = GT.make_gemm_tf32(t, a_t, b_t, precision)
        ptx, _ = cuda.compile_ptx(k.py_func, (arr, arr, arr, arr, types.int64), cc=(9, 0))
        need = ("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32", "cvt.rna.tf32.f32", "cp.async.cg.shared.global",
                "ld.shared.v4.f32" if layout == "nn" else "ld.shared.f32")
        missing = [n for n in need if n not in ptx]
        print("PTX", layout, precision, ptx.count("mma.sync"), ptx.count("cvt.rna.tf32"), "missing:", missing)
"""


def test_kernel_compiles_to_ptx_for_sm90():
    """The real (not simulated) kernel through Numba's typing and NVVM for sm_90, both precisions,
    "n" (LDS.128) and "t" (LDS.32) operands: the mma and cvt are in the PTX, one mma per product
    for tf32 and three for 3xtf32. Needs NVVM and NVRTC (no GPU); skipped without them."""
    import ptx_probe

    stdout = ptx_probe.run(_PTX_PROBE)
    lines = [x.split() for x in stdout.splitlines() if x.startswith("PTX")]
    assert len(lines) == 4, stdout
    # per slice of a warp (one m16 and two n8 tiles, two k8 steps): 4 products, 16 operand values
    # (4 of A and 2 x 2 of B a step), each converted once (tf32) or twice (3xtf32); LLVM may
    # duplicate the k loop's body, so compare per slice
    per_slice = {"tf32": (4, 16), "3xtf32": (12, 32)}
    for _, layout, precision, mmas, cvts, *rest in lines:
        assert rest == ["missing:", "[]"], (layout, precision, rest)
        mma, cvt = per_slice[precision]
        copies = int(mmas) // mma
        assert copies >= 1 and int(mmas) == copies * mma and int(cvts) == copies * cvt, (layout, precision, mmas, cvts)

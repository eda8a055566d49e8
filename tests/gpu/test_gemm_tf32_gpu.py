"""On a real GPU only: the tf32 / 3xtf32 tensor-core GEMMs on torch float32 tensors against torch in
float64, in every layout, both precisions: at ragged sizes (the element-wise fetch), aligned ones
(cp.async), padded views whose K ends inside a 16-byte chunk, views with offsets and row strides,
transposed views, split k and an accumulator; outputs that are views leave their neighbours
alone. The intrinsics' one-warp checks (``mma_check.validate``) run first.

Bounds (relative to max |reference|, Note [bf16 noise]'s measure):

- "tf32" against a float64 product of the same tf32-rounded operands (round to nearest, ties
  away, as ``cvt.rna``): fp32 accumulation alone, TF32_SAME_RTOL; and against the exact product
  within 2x cuBLAS TF32's error (torch with ``allow_tf32=True``) plus TF32_SLACK;
- "3xtf32" against the exact product within 4x cuBLAS fp32's error (``allow_tf32=False``) plus
  X3_SLACK, and 30x below our "tf32"'s error.

    VMSTOOLKIT_REAL_GPU=1 python -m pytest tests/gpu/test_gemm_tf32_gpu.py -q
"""

import os

import pytest

torch = pytest.importorskip("torch")

from torch_bf16 import err, nb  # noqa: E402 - after the importorskip

pytestmark = pytest.mark.skipif(
    os.environ.get("VMSTOOLKIT_REAL_GPU") != "1" or not torch.cuda.is_available(),
    reason="needs a CUDA GPU, torch and VMSTOOLKIT_REAL_GPU=1")

TF32_SAME_RTOL = 2e-5  # fp32 accumulation in another order than float64's
TF32_SLACK = 1e-4
X3_SLACK = 2e-6


@pytest.fixture(autouse=True)
def _fp32():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    yield
    torch.backends.cuda.matmul.allow_tf32 = False


def tf32(t):
    """Round to the nearest tf32, ties away from zero (``cvt.rna.tf32.f32``), low 13 bits zero."""
    bits = t.contiguous().view(torch.int32)
    r = ((bits + 0x1000) & ~0x1FFF).view(torch.float32)
    return torch.where(torch.isfinite(t), r, t)


def f32(*shape):
    return torch.randn(*shape, device="cuda")


def products(x, w, dy):
    """The three layouts' (A, B) with y = A B: y = x w^T, dx = dy w, dw = dy^T x."""
    return ((x, w.T), (dy, w), (dy.T, x))


def cublas(a, b, allow_tf32: bool):
    torch.backends.cuda.matmul.allow_tf32 = allow_tf32
    try:
        return a @ b
    finally:
        torch.backends.cuda.matmul.allow_tf32 = False


def run_layouts(x, w, dy, precision, splits=None):
    from numba import cuda

    from vmstoolkit.kernels import gemm_tf32 as GT

    m, k = x.shape
    n = w.shape[0]
    outs = [torch.full(s, float("nan"), device="cuda") for s in ((m, n), (m, k), (n, k))]
    GT.gemm_tf32(nb(x), nb(w), nb(outs[0]), precision=precision, splits=splits)
    GT.linear_dx_tf32(nb(dy), nb(w), nb(outs[1]), precision=precision, splits=splits)
    GT.linear_dw_tf32(nb(dy), nb(x), nb(outs[2]), precision=precision, splits=splits)
    cuda.synchronize()
    return outs


def check(name, got, a, b, precision, acc=None):
    """The bounds of the module docstring for ``got`` = [acc +] a @ b."""
    assert not got.isnan().any(), name
    add = (lambda t: t) if acc is None else (lambda t: t + acc.double())
    exact = add(a.double() @ b.double())
    if precision == "tf32":
        same = add(tf32(a).double() @ tf32(b).double())
        assert err(got, same) <= TF32_SAME_RTOL, (name, err(got, same))
        ref = err(add(cublas(a, b, True).double()), exact)
        assert err(got, exact) <= 2 * ref + TF32_SLACK, (name, err(got, exact), ref)
    else:
        ref = err(add(cublas(a, b, False).double()), exact)
        assert err(got, exact) <= 4 * ref + X3_SLACK, (name, err(got, exact), ref)
        plain = err(add(tf32(a).double() @ tf32(b).double()), exact)
        assert err(got, exact) * 30 <= plain, (name, err(got, exact), plain)


def test_intrinsics_one_warp():
    from vmstoolkit.kernels import mma_check

    assert [r["check"] for r in mma_check.validate()] == ["mma", "ldmatrix", "cp_async", "pack", "mma_tf32",
                                                         "cvt_tf32", "smem_f32"]


@pytest.mark.parametrize("precision", ["tf32", "3xtf32"])
@pytest.mark.parametrize("m, n, k", [(1000, 520, 1032), (1001, 517, 1027), (7, 3, 5)])
def test_layouts(m, n, k, precision):
    x, w, dy = f32(m, k), f32(n, k), f32(m, n)
    for name, got, (a, b) in zip(("y", "dx", "dw"), run_layouts(x, w, dy, precision), products(x, w, dy)):
        check(name, got, a, b, precision)


@pytest.mark.parametrize("precision", ["tf32", "3xtf32"])
def test_split_k_and_acc(precision):
    from numba import cuda

    from vmstoolkit.kernels import gemm_tf32 as GT

    m, n, k = 264, 136, 4096
    x, w, dy = f32(m, k), f32(n, k), f32(m, n)
    for splits in (2, 4):
        for name, got, (a, b) in zip(("y", "dx", "dw"), run_layouts(x, w, dy, precision, splits), products(x, w, dy)):
            check(f"{name} split {splits}", got, a, b, precision)
    acc = f32(m, n)
    y = torch.empty(m, n, device="cuda")
    for splits in (1, 2):
        GT.gemm_tf32(nb(x), nb(w), nb(y), acc=nb(acc), precision=precision, splits=splits)
        cuda.synchronize()
        check(f"acc split {splits}", y, x, w.T, precision, acc)
    dw = f32(n, k)  # accumulate in place
    dw0 = dw.clone()
    GT.linear_dw_tf32(nb(dy), nb(x), nb(dw), acc=nb(dw), precision=precision)
    cuda.synchronize()
    check("dw in place", dw, dy.T, x, precision, dw0)


@pytest.mark.parametrize("precision", ["tf32", "3xtf32"])
def test_views_and_strides(precision):
    """Operands that are views: a column offset of 4 (16-byte aligned: cp.async), of 3 (not: the
    element-wise fetch), rows every other row, K = 1027 (the last cp.async chunk of a row ends
    inside the padded stride); an output that is a view of a wider array; a transposed view."""
    from numba import cuda

    from vmstoolkit.kernels import gemm_tf32 as GT

    m, n, k = 300, 200, 1027
    big_x, big_w = f32(2 * m, k + 17), f32(n, k + 17)
    for off in (4, 3):
        x, w = big_x[::2, off:off + k], big_w[:, off:off + k]
        assert GT.aligned16(nb(x)) == (off == 4), off  # row strides 8352 and 4176 bytes
        wide = torch.full((m, n + 24), 7.0, device="cuda")
        y = wide[:, 8:8 + n]
        GT.gemm_tf32(nb(x), nb(w), nb(y), precision=precision)
        cuda.synchronize()
        check(f"y off {off}", y, x, w.T, precision)
        assert (wide[:, :8] == 7).all() and (wide[:, 8 + n:] == 7).all(), off
    # padded rows of 16-byte multiples (K = 1027 inside a 1040-wide row): cp.async with a short last chunk
    pad_x, pad_w = f32(m, 1040)[:, :k], f32(n, 1040)[:, :k]
    assert GT.aligned16(nb(pad_x)) and GT.aligned16(nb(pad_w))
    y = torch.empty(m, n, device="cuda")
    GT.gemm_tf32(nb(pad_x), nb(pad_w), nb(y), precision=precision)
    cuda.synchronize()
    check("padded", y, pad_x, pad_w.T, precision)
    xt = f32(k, m).T  # (m, k) with strides (1, m): the element-wise fetch
    GT.gemm_tf32(nb(xt), nb(pad_w), nb(y), precision=precision)
    cuda.synchronize()
    check("transposed", y, xt, pad_w.T, precision)

"""On a real GPU only: the tensor-core intrinsics' one-warp checks (``mma_check.validate``) and the
bf16 GEMMs on torch bf16 tensors (viewed as int16) against torch in every layout: float32 outputs
against a float32 product of the same bf16 operands, bf16 outputs against torch's bf16 matmul,
at ragged sizes (the element-wise fetch), aligned ones (cp.async), views with offsets and row
strides, split k and an accumulator; outputs that are views leave their neighbours alone.

    VMSTOOLKIT_REAL_GPU=1 python -m pytest tests/gpu/test_gemm_bf16_gpu.py -q
"""

import os

import pytest

torch = pytest.importorskip("torch")

from torch_bf16 import bf, err, nb, run_layouts  # noqa: E402 - after the importorskip

pytestmark = pytest.mark.skipif(
    os.environ.get("VMSTOOLKIT_REAL_GPU") != "1" or not torch.cuda.is_available(),
    reason="needs a CUDA GPU, torch and VMSTOOLKIT_REAL_GPU=1")

F32_RTOL = 2e-5  # fp32 accumulation in another order than cuBLAS's
BF16_RTOL = 1.6e-2  # a bf16 rounding of each output, ours and torch's (2 ulps of the largest)


@pytest.fixture(autouse=True)
def _fp32():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)


def test_intrinsics_one_warp():
    from vmstoolkit.kernels import mma_check

    assert [r["check"] for r in mma_check.validate()] == ["mma", "ldmatrix", "cp_async", "pack", "mma_tf32",
                                                         "cvt_tf32", "smem_f32"]


@pytest.mark.parametrize("m, n, k", [(1000, 520, 1032), (1001, 517, 1027), (7, 3, 5)])
def test_layouts_float32_out(m, n, k):
    ours, want = run_layouts(bf(m, k), bf(n, k), bf(m, n))
    for name, a, b in zip(("y", "dx", "dw"), ours, want):
        assert err(a, b) <= F32_RTOL, (name, err(a, b))


@pytest.mark.parametrize("m, n, k", [(1000, 520, 1032), (1001, 517, 1027)])
def test_layouts_bf16_out(m, n, k):
    ours, want = run_layouts(bf(m, k), bf(n, k), bf(m, n), torch.bfloat16)
    for name, a, b in zip(("y", "dx", "dw"), ours, want):
        assert not a.isnan().any(), name
        assert err(a, b) <= BF16_RTOL, (name, err(a, b))


def test_split_k_and_acc():
    from numba import cuda

    from vmstoolkit.kernels import gemm_bf16 as GB

    m, n, k = 264, 136, 4096
    x, w, dy = bf(m, k), bf(n, k), bf(m, n)
    for splits in (2, 4):
        ours, want = run_layouts(x, w, dy, splits=splits)
        for name, a, b in zip(("y", "dx", "dw"), ours, want):
            assert err(a, b) <= F32_RTOL, (splits, name, err(a, b))
    acc = torch.randn(m, n, device="cuda")
    y = torch.empty(m, n, device="cuda")
    for splits in (1, 2):
        GB.gemm_bf16(nb(x), nb(w), nb(y), acc=nb(acc), splits=splits)
        cuda.synchronize()
        assert err(y, acc + x.float() @ w.float().T) <= F32_RTOL, splits
    dw = torch.randn(n, k, device="cuda")  # accumulate in place
    want = dw + dy.float().T @ x.float()
    GB.linear_dw_bf16(nb(dy), nb(x), nb(dw), acc=nb(dw))
    cuda.synchronize()
    assert err(dw, want) <= F32_RTOL


def test_views_and_strides():
    """Operands that are views: a column offset of 8 (16-byte aligned: cp.async), of 3 (not:
    the element-wise fetch), rows every other row; an output that is a view of a wider array."""
    from numba import cuda

    from vmstoolkit.kernels import gemm_bf16 as GB

    m, n, k = 300, 200, 520
    big_x, big_w = bf(2 * m, k + 16), bf(n, k + 16)
    for off in (8, 3):
        x, w = big_x[::2, off:off + k], big_w[:, off:off + k]
        wide = torch.full((m, n + 24), 7.0, device="cuda")
        y = wide[:, 8:8 + n]
        GB.gemm_bf16(nb(x), nb(w), nb(y))
        cuda.synchronize()
        assert err(y, x.float() @ w.float().T) <= F32_RTOL, off
        assert (wide[:, :8] == 7).all() and (wide[:, 8 + n:] == 7).all(), off
        wide_bf = torch.full((m, n + 24), 7.0, device="cuda", dtype=torch.bfloat16)
        GB.gemm_bf16(nb(x), nb(w), nb(wide_bf[:, 3:3 + n]))
        cuda.synchronize()
        assert err(wide_bf[:, 3:3 + n], x @ w.T) <= BF16_RTOL, off
        assert (wide_bf[:, :3] == 7).all() and (wide_bf[:, 3 + n:] == 7).all(), off
    # a transposed view (column stride != 1) takes the element-wise fetch, and is right
    xt = bf(k, m).T  # (m, k) with strides (1, m)
    y = torch.empty(m, n, device="cuda")
    GB.gemm_bf16(nb(xt), nb(big_w[:, :k]), nb(y))
    cuda.synchronize()
    assert err(y, xt.float() @ big_w[:, :k].float().T) <= F32_RTOL


def test_rows_ending_mid_chunk_with_an_aligned_pitch():
    """Rows of 1027 and 517 elements with a pitch of 1040 pass ``aligned_b16`` (cp.async): the last
    chunk of a row stops at its end instead of adding the padding after it into the sums."""
    from vmstoolkit.kernels import gemm_bf16 as GB

    xr, wr, dyr = bf(1000, 1040)[:, :1027], bf(517, 1040)[:, :1027], bf(1000, 1040)[:, :517]
    assert GB.aligned_b16(nb(xr)) and GB.aligned_b16(nb(dyr))
    ours, want = run_layouts(xr, wr, dyr)
    for name, a, b in zip(("y", "dx", "dw"), ours, want):
        assert err(a, b) <= F32_RTOL, (name, err(a, b))

"""On a real GPU only: the GEMMs on torch tensors against cuBLAS fp32 (TF32 off), every variant,
the 16-byte loads of variant 11 on aligned operands and its scalar fallback on operands that are
not (views starting mid-row, rows whose length is not a multiple of 4), and variant 13's staged
16-byte stores into outputs and accumulators that are views, leaving what is beside them alone.

    VMSTOOLKIT_REAL_GPU=1 python -m pytest tests/gpu/test_gemm_gpu.py -q
"""

import os

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.skipif(
    os.environ.get("VMSTOOLKIT_REAL_GPU") != "1" or not torch.cuda.is_available(),
    reason="needs a CUDA GPU, torch and VMSTOOLKIT_REAL_GPU=1")

RTOL = 1e-5


@pytest.fixture(autouse=True)
def _fp32():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)


def nb(t):
    from numba import cuda

    return cuda.as_cuda_array(t)


def err(got, want) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


def run_all(x, w, dy, variant, splits=None):
    """(y, dx, dw) from our three GEMMs and from torch, for x (M, K), w (N, K), dy (M, N)."""
    from numba import cuda

    from vmstoolkit.kernels import gemm as G

    m, k = x.shape
    n = w.shape[0]
    y, dx, dw = (torch.full(s, float("nan"), device="cuda") for s in ((m, n), (m, k), (n, k)))
    G.gemm(nb(x), nb(w), nb(y), variant=variant, splits=splits)
    G.linear_dx(nb(dy), nb(w), nb(dx), variant=variant, splits=splits)
    G.linear_dw(nb(dy), nb(x), nb(dw), variant=variant, splits=splits)
    cuda.synchronize()
    return (y, dx, dw), (x @ w.T, dy @ w, dy.T @ x)


@pytest.mark.parametrize("variant", [5, 11, 13])
@pytest.mark.parametrize("m, n, k", [(1001, 516, 1028), (1001, 517, 1027)])
def test_every_variant_against_cublas(variant, m, n, k):
    x, w, dy = torch.randn(m, k, device="cuda"), torch.randn(n, k, device="cuda"), torch.randn(m, n, device="cuda")
    ours, want = run_all(x, w, dy, variant)
    for name, a, b in zip(("y", "dx", "dw"), ours, want):
        assert err(a, b) <= RTOL, (name, err(a, b))


def test_variant11_loads_16_bytes_only_where_operands_allow():
    from vmstoolkit.kernels import gemm as G

    big = torch.randn(300, 260, device="cuda")
    assert G.loaded_variant(11, nb(big), nb(big)) == 11
    assert G.loaded_variant(11, nb(big[:, 1:257]), nb(big)) == 5  # starts 4 bytes into a row
    assert G.loaded_variant(11, nb(big[:, 4:260]), nb(big)) == 11  # 16 bytes in
    assert G.loaded_variant(11, nb(big[:, :257].contiguous()), nb(big)) == 5  # rows of 1028 bytes


@pytest.mark.parametrize("offset", [1, 4])
@pytest.mark.parametrize("splits", [None, 2])
def test_variant11_on_views_starting_mid_row(offset, splits):
    # operands that are views into wider tensors, 4 or 16 bytes past a row's start: the first must
    # take the scalar loads, the second may take the vectors; both must be right (32 big tiles)
    k, m, n = 512, 1024, 512
    xb = torch.randn(m, k + 8, device="cuda")
    wb = torch.randn(n, k + 8, device="cuda")
    dyb = torch.randn(m, n + 8, device="cuda")
    x, w, dy = xb[:, offset:offset + k], wb[:, offset:offset + k], dyb[:, offset:offset + n]
    ours, want = run_all(x, w, dy, 11, splits)
    for name, a, b in zip(("y", "dx", "dw"), ours, want):
        assert err(a, b) <= RTOL, (name, offset, err(a, b))


def test_default_launch_at_a_7b_shape():
    # the launcher's own choice (rule, variant, splits) at the 7B k/v GQA8 shape, forward and backward
    x, w, dy = (torch.randn(2048, 4096, device="cuda"), torch.randn(1024, 4096, device="cuda") / 64,
                torch.randn(2048, 1024, device="cuda"))
    ours, want = run_all(x, w, dy, None)
    for name, a, b in zip(("y", "dx", "dw"), ours, want):
        assert err(a, b) <= RTOL, (name, err(a, b))


@pytest.mark.parametrize("offset", [1, 4])
@pytest.mark.parametrize("splits", [None, 2])
def test_variant13_into_output_and_accumulator_views(offset, splits):
    # outputs (and accumulators) that are views 4 or 16 bytes into wider tensors: the first must
    # take variant 11's scalar stores, the second the staged 16-byte ones; the columns beside
    # each view must keep their values
    from numba import cuda

    from vmstoolkit.kernels import gemm as G

    m, n, k = 1024, 512, 768
    x, w, dy = torch.randn(m, k, device="cuda"), torch.randn(n, k, device="cuda"), torch.randn(m, n, device="cuda")
    yb, dxb, dwb = (torch.full((r, c + 8), 7.0, device="cuda") for r, c in ((m, n), (m, k), (n, k)))
    y, dx, dw = (t[:, offset:offset - 8] for t in (yb, dxb, dwb))
    accb = torch.randn(n, k + 8, device="cuda")
    acc = accb[:, offset:offset - 8]
    want_ran = 13 if offset == 4 else 11
    assert G.loaded_variant(13, nb(x), nb(w), nb(y)) == want_ran
    G.gemm(nb(x), nb(w), nb(y), variant=13, splits=splits)
    G.linear_dx(nb(dy), nb(w), nb(dx), variant=13, splits=splits)
    G.linear_dx(nb(dy), nb(w), nb(dx), acc=nb(dx), variant=13, splits=splits)  # in place: dx = 2 dy w
    G.linear_dw(nb(dy), nb(x), nb(dw), acc=nb(acc), variant=13, splits=splits)
    cuda.synchronize()
    for name, a, b in (("y", y, x @ w.T), ("dx", dx, 2 * (dy @ w)), ("dw", dw, acc + dy.T @ x)):
        assert err(a, b) <= RTOL, (name, offset, err(a, b))
    for t in (yb, dxb, dwb):
        assert (t[:, :offset] == 7).all() and (t[:, offset - 8:] == 7).all()

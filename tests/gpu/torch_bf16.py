"""Helpers of the bf16 GPU tests (not a test module): torch bf16 tensors as Numba device arrays, the
error measure, random bf16 tensors. Imported by name (conftest.py puts this folder on sys.path)."""

import torch


def nb(t):
    """A torch tensor as a Numba device array; bf16 ones through an int16 view (same bits)."""
    from numba import cuda

    return cuda.as_cuda_array(t.view(torch.int16) if t.dtype == torch.bfloat16 else t)


def err(got, want) -> float:
    """max |got - want| / max |want| (Note [bf16 noise])."""
    return ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()


def bf(*shape):
    return torch.randn(*shape, device="cuda").bfloat16()


def run_layouts(x, w, dy, out_dtype=torch.float32, splits=None, tiles=None):
    """(ours, torch's) for y = x w^T, dx = dy w, dw = dy^T x through the gemm_bf16 launchers
    (``tiles``: mma.sync ``MmaTiles``, wgmma ``WgmmaTiles`` or the launch rule's)."""
    from numba import cuda

    from vmstoolkit.kernels import gemm_bf16 as GB

    m, k = x.shape
    n = w.shape[0]
    outs = [torch.full(s, float("nan"), device="cuda", dtype=out_dtype) for s in ((m, n), (m, k), (n, k))]
    GB.gemm_bf16(nb(x), nb(w), nb(outs[0]), splits=splits, tiles=tiles)
    GB.linear_dx_bf16(nb(dy), nb(w), nb(outs[1]), splits=splits, tiles=tiles)
    GB.linear_dw_bf16(nb(dy), nb(x), nb(outs[2]), splits=splits, tiles=tiles)
    cuda.synchronize()
    if out_dtype == torch.float32:
        want = (x.float() @ w.float().T, dy.float() @ w.float(), dy.float().T @ x.float())
    else:
        want = (x @ w.T, dy @ w, dy.T @ x)
    return outs, want

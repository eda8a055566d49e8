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

"""Rotary position embedding, HF ``rotate_half`` convention, on x (B, T, nh, hd), float32.

Recipe: the numpy reference (``reference.rope``), the kernel, a launcher, ``validate()``.

One thread per rotated pair ``(i, i + hd/2)``: it reads both, writes both, so the output may
alias the input (the block applies it in place). The angle ``pos * theta**(-2i/hd)`` and its
cosine and sine are computed in float64 like the reference's tables, then rounded to float32:
no table to allocate, and at position 1023 float32 angles would already be off by ~6e-5 rad.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
from numba import cuda, float32, float64

from vmstoolkit.errors import KernelError

from . import _launch as fastlaunch, reference
from ._util import check_float32, check_ndim, elementwise_grid


@lru_cache(maxsize=None)
def make_rope_kernel(inverse: bool = False):
    """The forward kernel, or with ``inverse`` its backward: the rotation by the opposite angle
    (the transpose of a rotation), so ``dx = rope_inverse(dy)``."""
    SIGN = -1.0 if inverse else 1.0

    @fastlaunch.jit
    def rope_kernel(x, y, theta, offset):
        b_, t_, nh, hd = x.shape
        half = hd // 2
        n = b_ * t_ * nh * half
        start = cuda.grid(1)
        step = cuda.gridsize(1)
        for e in range(start, n, step):
            i = e % half
            rest = e // half
            h = rest % nh
            rest //= nh
            t = rest % t_
            b = rest // t_
            inv_freq = 1.0 / (theta ** (float64(2 * i) / float64(hd)))
            ang = float64(t + offset) * inv_freq
            c = float32(math.cos(ang))
            s = float32(SIGN * math.sin(ang))
            x1 = x[b, t, h, i]
            x2 = x[b, t, h, i + half]
            y[b, t, h, i] = x1 * c - x2 * s
            y[b, t, h, i + half] = x2 * c + x1 * s

    return rope_kernel


def check_args(x, y) -> tuple:
    check_float32("x", x)
    check_float32("rope output", y)
    check_ndim("x", x, 4)
    if tuple(y.shape) != tuple(x.shape):
        raise KernelError(f"rope: output shape {tuple(y.shape)} != input shape {tuple(x.shape)}")
    if x.shape[3] % 2:
        raise KernelError(f"rope: head_dim must be even, got {x.shape[3]}")
    return tuple(x.shape)


def rope(x, y, theta: float = 10000.0, offset: int = 0, stream=0):
    """Enqueue RoPE of x (B, T, nh, hd) at positions offset..offset+T-1 into y (may be x)."""
    _launch(x, y, theta, offset, stream, inverse=False)


def _launch(x, y, theta, offset, stream, inverse: bool) -> None:
    b, t, nh, hd = check_args(x, y)
    n = b * t * nh * (hd // 2)
    if n == 0:
        return
    blocks, threads = elementwise_grid(n)
    make_rope_kernel(inverse)[blocks, threads, stream](x, y, np.float64(theta), np.int64(offset))


def rope_backward(dy, dx, theta: float = 10000.0, offset: int = 0, stream=0):
    """Enqueue the gradient of :func:`rope`: dy (B, T, nh, hd) rotated back into dx (may be dy)."""
    _launch(dy, dx, theta, offset, stream, inverse=True)


def validate_backward(shapes=((1, 3, 2, 4), (2, 5, 3, 8)), theta: float = 500.0, rtol: float = 1e-5,
                      seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    records = []
    for shape in shapes:
        dy = rng.standard_normal(shape, dtype=np.float32)  # (B, T, nh, hd)
        want = reference.rope_backward(dy, theta)
        d_dx = cuda.device_array(shape, dtype=np.float32)
        rope_backward(cuda.to_device(dy), d_dx, theta)
        err = float(np.max(np.abs(d_dx.copy_to_host() - want)) / np.max(np.abs(want)))
        records.append({"shape": shape, "max_rel_err": err})
        if not err <= rtol:
            raise AssertionError(f"rope backward at {shape}: max rel err {err:.3g}")
    return records


def validate(shapes=((1, 3, 2, 4), (2, 5, 3, 8), (1, 7, 1, 6)), theta: float = 10000.0,
             offset: int = 0, rtol: float = 1e-5, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    records = []
    for shape in shapes:
        x = rng.standard_normal(shape, dtype=np.float32)  # (B, T, nh, hd)
        want = reference.rope(x, theta, offset)  # (B, T, nh, hd)
        d_y = cuda.device_array(shape, dtype=np.float32)
        rope(cuda.to_device(x), d_y, theta, offset)
        got = d_y.copy_to_host()
        err = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
        records.append({"shape": shape, "max_rel_err": err})
        if not err <= rtol:
            raise AssertionError(f"rope at {shape}: max rel err {err:.3g}")
    return records

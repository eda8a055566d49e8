"""Residual add ``y = a + b`` elementwise, float32, any (matching) shapes.

Recipe: the numpy reference (``reference.residual_add``), the kernel, a launcher, ``validate()``.
A grid-stride loop over the flattened arrays; ``y`` may alias ``a`` or ``b``.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
from numba import cuda

from . import _launch as fastlaunch, reference
from ._util import check_binary_elementwise, launch_binary_elementwise


@lru_cache(maxsize=None)
def make_residual_kernel():
    @fastlaunch.jit
    def residual_add_kernel(a, b, y):
        n = a.shape[0]
        for e in range(cuda.grid(1), n, cuda.gridsize(1)):
            y[e] = a[e] + b[e]

    return residual_add_kernel


def check_args(a, b, y) -> None:
    check_binary_elementwise("residual_add", ("a", "b", "residual output"), a, b, y)


def residual_add(a, b, y, stream=0):
    """Enqueue ``y = a + b`` (contiguous arrays of one shape)."""
    check_args(a, b, y)
    launch_binary_elementwise(make_residual_kernel(), a, b, y, stream)


def validate(shapes=((7,), (3, 33), (2, 5, 9)), seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    records = []
    for shape in shapes:
        a = rng.standard_normal(shape, dtype=np.float32)
        b = rng.standard_normal(shape, dtype=np.float32)
        want = reference.residual_add(a, b)
        d_y = cuda.device_array(shape, dtype=np.float32)
        residual_add(cuda.to_device(a), cuda.to_device(b), d_y)
        got = d_y.copy_to_host()
        err = float(np.max(np.abs(got - want)))
        records.append({"shape": shape, "max_abs_err": err})
        if err != 0.0:
            raise AssertionError(f"residual_add at {shape}: max abs err {err:.3g} (must be exact)")
    return records

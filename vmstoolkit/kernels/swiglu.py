"""SwiGLU ``y = silu(gate) * up`` elementwise, float32, any (matching) shapes.

Recipe: the numpy reference (``reference.swiglu``), the kernel, a launcher, ``validate()``.
A grid-stride loop over the flattened arrays: bandwidth bound (12 bytes per element).
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
from numba import cuda, float32

from . import _launch as fastlaunch, reference
from ._util import check_binary_elementwise, elementwise_grid, flat, launch_binary_elementwise


@lru_cache(maxsize=None)
def make_swiglu_kernel():
    @fastlaunch.jit
    def swiglu_kernel(gate, up, y):
        n = gate.shape[0]
        for e in range(cuda.grid(1), n, cuda.gridsize(1)):
            g = gate[e]
            y[e] = g / (float32(1.0) + math.exp(-g)) * up[e]

    return swiglu_kernel


def check_args(gate, up, y) -> None:
    check_binary_elementwise("swiglu", ("gate", "up", "swiglu output"), gate, up, y)


def swiglu(gate, up, y, stream=0):
    """Enqueue ``y = silu(gate) * up`` (contiguous arrays of one shape)."""
    check_args(gate, up, y)
    launch_binary_elementwise(make_swiglu_kernel(), gate, up, y, stream)


def validate(shapes=((7,), (3, 33), (2, 5, 9)), rtol: float = 1e-5, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    records = []
    for shape in shapes:
        gate = rng.standard_normal(shape, dtype=np.float32) * 4  # (..., F)
        up = rng.standard_normal(shape, dtype=np.float32)  # (..., F)
        want = reference.swiglu(gate, up)
        d_y = cuda.device_array(shape, dtype=np.float32)
        swiglu(cuda.to_device(gate), cuda.to_device(up), d_y)
        got = d_y.copy_to_host()
        err = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
        records.append({"shape": shape, "max_rel_err": err})
        if not err <= rtol:
            raise AssertionError(f"swiglu at {shape}: max rel err {err:.3g}")
    return records


# ---- backward -------------------------------------------------------------------------------


@lru_cache(maxsize=None)
def make_swiglu_backward_kernel():
    @fastlaunch.jit
    def swiglu_backward_kernel(gate, up, ds, dgate, dup):
        n = gate.shape[0]
        for e in range(cuda.grid(1), n, cuda.gridsize(1)):
            g = gate[e]
            sig = float32(1.0) / (float32(1.0) + math.exp(-g))
            d = ds[e]
            u = up[e]
            dup[e] = d * g * sig
            dgate[e] = d * u * sig * (float32(1.0) + g * (float32(1.0) - sig))

    return swiglu_backward_kernel


def swiglu_backward(gate, up, ds, dgate, dup, stream=0):
    """Enqueue the gradients of ``silu(gate) * up``: ``dgate``, ``dup`` from ``ds`` (one shape;
    each output may alias ``ds``, not the other output)."""
    check_args(gate, up, ds)
    check_binary_elementwise("swiglu backward", ("dgate", "dup", "ds"), dgate, dup, ds)
    fg = flat(gate)
    if fg.shape[0] == 0:
        return
    blocks, threads = elementwise_grid(fg.shape[0])
    make_swiglu_backward_kernel()[blocks, threads, stream](fg, flat(up), flat(ds), flat(dgate), flat(dup))


def validate_backward(shapes=((7,), (3, 33)), rtol: float = 1e-5, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    records = []
    for shape in shapes:
        gate = rng.standard_normal(shape, dtype=np.float32) * 4  # (..., F)
        up = rng.standard_normal(shape, dtype=np.float32)  # (..., F)
        ds = rng.standard_normal(shape, dtype=np.float32)  # (..., F)
        want = reference.swiglu_backward(gate, up, ds)
        outs = [cuda.device_array(shape, dtype=np.float32) for _ in range(2)]
        swiglu_backward(cuda.to_device(gate), cuda.to_device(up), cuda.to_device(ds), *outs)
        for name, d, w in zip(("dgate", "dup"), outs, want):
            err = float(np.max(np.abs(d.copy_to_host() - w)) / np.max(np.abs(w)))
            records.append({"shape": shape, "grad": name, "max_rel_err": err})
            if not err <= rtol:
                raise AssertionError(f"swiglu backward {name} at {shape}: max rel err {err:.3g}")
    return records

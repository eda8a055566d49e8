"""AdamW update (``torch.optim.AdamW``, ``amsgrad=False``): w, g, m, v -> w', m', v', float32.

Recipe: the numpy reference (``reference.adamw``), the kernel, a launcher, ``validate()``.

A grid-stride loop, bandwidth bound: 4 arrays read, 3 written (28 bytes per parameter). The
bias corrections are folded into two scalars on the host (``lr / (1 - beta1^t)`` and
``1 / sqrt(1 - beta2^t)``), as PyTorch's fused kernel does. The outputs may alias the inputs
(in-place update) or be other arrays (the runtime's write-once tensors).
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
from numba import cuda, float32

from vmstoolkit.errors import KernelError

from . import _launch as fastlaunch, reference
from ._util import check_float32, elementwise_grid, flat


@lru_cache(maxsize=None)
def make_adamw_kernel():
    @fastlaunch.jit
    def adamw_kernel(w, g, m, v, w_out, m_out, v_out, step_size, inv_bc2_sqrt, beta1, beta2, eps, decay):
        n = w.shape[0]
        for e in range(cuda.grid(1), n, cuda.gridsize(1)):
            gi = g[e]
            mi = beta1 * m[e] + (float32(1.0) - beta1) * gi
            vi = beta2 * v[e] + (float32(1.0) - beta2) * gi * gi
            w_out[e] = w[e] * decay - step_size * mi / (math.sqrt(vi) * inv_bc2_sqrt + eps)
            m_out[e] = mi
            v_out[e] = vi

    return adamw_kernel


def step_scalars(op: str, arrays: dict, lr: float, beta1: float, beta2: float, eps: float,
                 weight_decay: float, step: int) -> tuple:
    """Check that ``arrays`` (name -> array, ``w`` first) share w's shape and that ``step`` counts
    from 1; return the kernel's float32 scalars (step size, 1 / sqrt(bias correction 2), beta1,
    beta2, eps, decay factor)."""
    w = next(iter(arrays.values()))
    for name, a in arrays.items():
        if tuple(a.shape) != tuple(w.shape):
            raise KernelError(f"{op}: {name} has shape {tuple(a.shape)}, w has {tuple(w.shape)}")
    if step < 1:
        raise KernelError(f"{op}: step counts from 1, got {step}")
    f = np.float32
    return (f(lr / (1.0 - beta1 ** step)), f(1.0 / math.sqrt(1.0 - beta2 ** step)), f(beta1), f(beta2), f(eps),
            f(1.0 - lr * weight_decay))


def adamw(w, g, m, v, w_out, m_out, v_out, *, lr: float, beta1: float = 0.9, beta2: float = 0.999,
          eps: float = 1e-8, weight_decay: float = 0.0, step: int = 1, stream=0) -> None:
    """Enqueue one AdamW step (``step`` counts from 1) over arrays of one shape."""
    arrays = {"w": w, "g": g, "m": m, "v": v, "w_out": w_out, "m_out": m_out, "v_out": v_out}
    for name, a in arrays.items():
        check_float32(name, a)
    scalars = step_scalars("adamw", arrays, lr, beta1, beta2, eps, weight_decay, step)
    n = int(np.prod(w.shape))
    if n == 0:
        return
    blocks, threads = elementwise_grid(n)
    make_adamw_kernel()[blocks, threads, stream](*(flat(a) for a in arrays.values()), *scalars)


def validate(shapes=((7,), (3, 33)), rtol: float = 1e-5, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    records = []
    hp = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.1}
    for shape in shapes:
        w, g = (rng.standard_normal(shape, dtype=np.float32) for _ in range(2))
        m = rng.standard_normal(shape, dtype=np.float32) * 0.1
        v = np.abs(rng.standard_normal(shape, dtype=np.float32)) * 0.01
        for step in (1, 10):
            want = reference.adamw(w, g, m, v, step=step, **hp)
            outs = [cuda.device_array(shape, dtype=np.float32) for _ in range(3)]
            adamw(*(cuda.to_device(a) for a in (w, g, m, v)), *outs, step=step, **hp)
            for name, d, ref in zip(("w", "m", "v"), outs, want):
                err = float(np.max(np.abs(d.copy_to_host() - ref)) / np.max(np.abs(ref)))
                records.append({"shape": shape, "step": step, "out": name, "max_rel_err": err})
                if not err <= rtol:
                    raise AssertionError(f"adamw {name} at {shape}, step {step}: max rel err {err:.3g}")
    return records

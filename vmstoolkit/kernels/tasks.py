"""The kernels as tasks the runtime (``vmstoolkit.exec``) can launch and cost.

``KERNEL_TASKS[name]`` is a ``KernelTask`` with

- ``reference(inputs, **params) -> np.ndarray``: the numpy result (``reference.py``);
- ``launch(stream, inputs, outputs, **params) -> None``: enqueue the Numba kernel(s) on that
  stream, reading the device arrays ``inputs`` and writing the preallocated ``outputs[0]``;
  no allocation, no synchronisation (works on a GPU and under ``NUMBA_ENABLE_CUDASIM=1``);
- ``flops(shapes, **params)`` and ``bytes_moved(shapes, **params)``: the cost model's figures
  from the input shapes (bytes: each input read once, the output written once, float32);
- ``output_shape(shapes, **params)``: the shape of the single output, for the runtime to allocate.

Inputs and params:

=============== ============================================ ========== ===================
name            inputs                                       params     output
=============== ============================================ ========== ===================
linear          x (M, K), w (N, K)                           -          (M, N) = x @ w.T
rmsnorm         x (..., H), w (H,)                           eps        like x
rope            x (B, T, nh, hd)                             theta      like x (may alias)
attention       q (B, T, nh, hd), k, v (B, T, nkv, hd)       -          like q, causal
swiglu          gate, up (same shape)                        -          like gate
residual_add    a, b (same shape)                            -          like a
=============== ============================================ ========== ===================
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from . import reference
from .attention import attention
from .gemm import gemm
from .residual import residual_add
from .rmsnorm import rmsnorm
from .rope import rope
from .swiglu import swiglu

F32 = 4  # bytes per element


@dataclass(frozen=True)
class KernelTask:
    name: str
    reference: Callable[..., np.ndarray]
    launch: Callable[..., None]
    flops: Callable[..., float]
    bytes_moved: Callable[..., float]
    output_shape: Callable[..., tuple] = field(default=lambda shapes, **params: tuple(shapes[0]))
    n_inputs: int = 1
    params: tuple[str, ...] = ()  # accepted keyword parameters


def _numel(shape) -> int:
    return int(np.prod(shape, dtype=np.int64))


def _check_call(task: str, n_inputs: int, allowed: tuple, inputs, outputs, params) -> None:
    if len(inputs) != n_inputs:
        raise ValueError(f"{task}: expected {n_inputs} inputs, got {len(inputs)}")
    if outputs is not None and len(outputs) != 1:
        raise ValueError(f"{task}: expected 1 output, got {len(outputs)}")
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        raise ValueError(f"{task}: unknown params {unknown} (accepted: {list(allowed)})")


def _io_bytes(shapes, out_shape) -> float:
    return float(F32 * (sum(_numel(s) for s in shapes) + _numel(out_shape)))


# ---- linear -------------------------------------------------------------------------------


def _linear_out(shapes, **params):
    (m, _), (n, _) = shapes
    return (m, n)


def _linear_ref(inputs, **params):
    _check_call("linear", 2, (), inputs, None, params)
    return reference.linear(*inputs)


def _linear_launch(stream, inputs, outputs, **params):
    _check_call("linear", 2, (), inputs, outputs, params)
    gemm(inputs[0], inputs[1], outputs[0], stream)


def _linear_flops(shapes, **params):
    (m, k), (n, _) = shapes
    return 2.0 * m * n * k


# ---- rmsnorm ------------------------------------------------------------------------------


def _rows(a):
    """(..., H) -> (R, H) view (the simulator's shape tuples have no negative indexing)."""
    h = a.shape[len(a.shape) - 1]
    return a.reshape(_numel(a.shape) // h if h else 0, h)


def _rmsnorm_ref(inputs, eps: float = 1e-6, **params):
    _check_call("rmsnorm", 2, ("eps",), inputs, None, params)
    return reference.rmsnorm(inputs[0], inputs[1], eps)


def _rmsnorm_launch(stream, inputs, outputs, eps: float = 1e-6, **params):
    _check_call("rmsnorm", 2, ("eps",), inputs, outputs, params)
    x, w = inputs
    if tuple(outputs[0].shape) != tuple(x.shape):
        raise ValueError(f"rmsnorm: output {tuple(outputs[0].shape)} != x {tuple(x.shape)}")
    rmsnorm(_rows(x), w, _rows(outputs[0]), eps, stream)


def _rmsnorm_flops(shapes, **params):
    return 4.0 * _numel(shapes[0])  # square, add; scale by 1/rms, by w (per element)


# ---- rope ---------------------------------------------------------------------------------


def _rope_ref(inputs, theta: float = 10000.0, **params):
    _check_call("rope", 1, ("theta",), inputs, None, params)
    return reference.rope(inputs[0], theta)


def _rope_launch(stream, inputs, outputs, theta: float = 10000.0, **params):
    _check_call("rope", 1, ("theta",), inputs, outputs, params)
    rope(inputs[0], outputs[0], theta, 0, stream)


def _rope_flops(shapes, **params):
    return 3.0 * _numel(shapes[0])  # two products and a sum per element (tables not counted)


# ---- attention ----------------------------------------------------------------------------


def _attention_ref(inputs, **params):
    _check_call("attention", 3, (), inputs, None, params)
    return reference.attention(*inputs)


def _attention_launch(stream, inputs, outputs, **params):
    _check_call("attention", 3, (), inputs, outputs, params)
    attention(inputs[0], inputs[1], inputs[2], outputs[0], stream)


def _attention_flops(shapes, **params):
    b, t, nh, hd = shapes[0]
    pairs = t * (t + 1) / 2  # causal (query, key) pairs per head
    return 4.0 * b * nh * hd * pairs  # q.k and p*v, 2 flops per multiply-add


# ---- swiglu, residual_add -----------------------------------------------------------------


def _swiglu_ref(inputs, **params):
    _check_call("swiglu", 2, (), inputs, None, params)
    return reference.swiglu(*inputs)


def _swiglu_launch(stream, inputs, outputs, **params):
    _check_call("swiglu", 2, (), inputs, outputs, params)
    swiglu(inputs[0], inputs[1], outputs[0], stream)


def _residual_ref(inputs, **params):
    _check_call("residual_add", 2, (), inputs, None, params)
    return reference.residual_add(*inputs)


def _residual_launch(stream, inputs, outputs, **params):
    _check_call("residual_add", 2, (), inputs, outputs, params)
    residual_add(inputs[0], inputs[1], outputs[0], stream)


def _same_shape_out(shapes, **params):
    return tuple(shapes[0])


def _bytes(out_shape_fn):
    def bytes_moved(shapes, **params):
        return _io_bytes(shapes, out_shape_fn(shapes, **params))

    return bytes_moved


KERNEL_TASKS: dict[str, KernelTask] = {
    t.name: t
    for t in (
        KernelTask("linear", _linear_ref, _linear_launch, _linear_flops, _bytes(_linear_out),
                   _linear_out, 2),
        KernelTask("rmsnorm", _rmsnorm_ref, _rmsnorm_launch, _rmsnorm_flops,
                   _bytes(_same_shape_out), _same_shape_out, 2, ("eps",)),
        KernelTask("rope", _rope_ref, _rope_launch, _rope_flops, _bytes(_same_shape_out),
                   _same_shape_out, 1, ("theta",)),
        KernelTask("attention", _attention_ref, _attention_launch, _attention_flops,
                   _bytes(_same_shape_out), _same_shape_out, 3),
        KernelTask("swiglu", _swiglu_ref, _swiglu_launch, lambda s, **p: 5.0 * _numel(s[0]),
                   _bytes(_same_shape_out), _same_shape_out, 2),
        KernelTask("residual_add", _residual_ref, _residual_launch,
                   lambda s, **p: 1.0 * _numel(s[0]), _bytes(_same_shape_out),
                   _same_shape_out, 2),
    )
}

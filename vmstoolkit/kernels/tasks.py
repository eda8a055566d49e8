"""The kernels as tasks the runtime (``vmstoolkit.exec``) can launch and cost.

``KERNEL_TASKS[name]`` is a ``KernelTask`` with

- ``reference(inputs, **params) -> np.ndarray``: the numpy result (``reference.py``); a tuple
  of arrays for the tasks with several outputs (``n_outputs > 1``);
- ``launch(stream, inputs, outputs, **params) -> None``: enqueue the Numba kernel(s) on that
  stream, reading the device arrays ``inputs`` and writing the preallocated ``outputs``;
  no allocation, no synchronisation (works on a GPU and under ``NUMBA_ENABLE_CUDASIM=1``);
- ``flops(shapes, **params)`` and ``bytes_moved(shapes, **params)``: the cost model's figures
  from the input shapes (bytes: each input read once, the output written once, float32);
- ``output_shape(shapes, **params)``: the shape of the (first) output, for the runtime to
  allocate; ``output_shapes`` gives every output's.

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

Training (backward and optimizer; ``[acc]``: an optional existing gradient added to the result):

================== ======================================== ============ ========================
name               inputs                                   params       outputs
================== ======================================== ============ ========================
linear_dx          dy (M, N), w (N, K) [, acc (M, K)]       -            dx (M, K) = dy @ w
linear_dw          dy (M, N), x (M, K) [, acc (N, K)]       -            dw (N, K) = dy.T @ x
rmsnorm_dx         x (R, H), w (H,), dy (R, H)              eps          dx (R, H)
rmsnorm_dw         x (R, H), dy (R, H) [, acc (H,)]         eps          dw (H,)
rope_backward      dy (B, T, nh, hd)                        theta        dx like dy
attention_lse      q, k, v as attention                     -            o like q, lse (B, nh, T)
attention_backward q, k, v, o, lse, do                      -            dq, dk, dv
swiglu_backward    gate, up, ds (same shape)                -            dgate, dup
adamw              w, g, m, v (same shape)                  lr, beta1,   w, m, v after the step
                                                            beta2, eps,
                                                            weight_decay,
                                                            step
cross_entropy      logits (M, V), labels (M,) int32         -            row_loss (M,), dlogits
                   (negative: ignored)                                   (M, V) (cross_entropy.py)
================== ======================================== ============ ========================
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from vmstoolkit.errors import KernelError

from . import model_ops, reference
from .cross_entropy import cross_entropy, cross_entropy_ref
from .adamw import adamw
from .attention import attention
from .attention_backward import attention_backward
from .gemm import gemm, linear_dw, linear_dx
from .residual import residual_add
from .rmsnorm import rmsnorm, rmsnorm_backward_dw, rmsnorm_backward_dx
from .rope import rope, rope_backward
from .swiglu import swiglu, swiglu_backward

F32 = 4  # bytes per element


@dataclass(frozen=True)
class KernelTask:
    name: str
    reference: Callable[..., np.ndarray]
    launch: Callable[..., None]
    flops: Callable[..., float]
    bytes_moved: Callable[..., float]
    output_shape: Callable[..., tuple] = field(default=lambda shapes, **params: tuple(shapes[0]))
    n_inputs: int | tuple[int, ...] = 1  # or the accepted counts
    params: tuple[str, ...] = ()  # accepted keyword parameters
    n_outputs: int = 1
    output_shapes: Callable[..., list] | None = None  # every output's shape (default: [output_shape])

    def shapes_out(self, shapes, **params) -> list[tuple]:
        """Shapes of every output, in order."""
        if self.output_shapes is not None:
            return [tuple(s) for s in self.output_shapes(shapes, **params)]
        return [tuple(self.output_shape(shapes, **params))]


def _numel(shape) -> int:
    return int(np.prod(shape, dtype=np.int64))


def _check_call(task: str, n_inputs, allowed: tuple, inputs, outputs, params, n_outputs: int = 1) -> None:
    counts = n_inputs if isinstance(n_inputs, tuple) else (n_inputs,)
    if len(inputs) not in counts:
        want = " or ".join(map(str, counts))
        raise KernelError(f"{task}: expected {want} inputs, got {len(inputs)}")
    if outputs is not None and len(outputs) != n_outputs:
        raise KernelError(f"{task}: expected {n_outputs} output{'s' if n_outputs > 1 else ''}, got {len(outputs)}")
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        raise KernelError(f"{task}: unknown params {unknown} (accepted: {list(allowed)})")


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
        raise KernelError(f"rmsnorm: output {tuple(outputs[0].shape)} != x {tuple(x.shape)}")
    rmsnorm(_rows(x), w, _rows(outputs[0]), eps, stream)


def _rmsnorm_flops(shapes, **params):
    return 4.0 * _numel(shapes[0])  # square, add; scale by 1/rms, by w (per element)


# ---- rope ---------------------------------------------------------------------------------


def _rope_ref(inputs, theta: float = 10000.0, offset: int = 0, **params):
    _check_call("rope", 1, ("theta", "offset"), inputs, None, params)
    return reference.rope(inputs[0], theta, offset)


def _rope_launch(stream, inputs, outputs, theta: float = 10000.0, offset: int = 0, **params):
    _check_call("rope", 1, ("theta", "offset"), inputs, outputs, params)
    rope(inputs[0], outputs[0], theta, offset, stream)


def _rope_flops(shapes, **params):
    return 3.0 * _numel(shapes[0])  # two products and a sum per element (tables not counted)


# ---- attention ----------------------------------------------------------------------------


def _attention_ref(inputs, **params):
    _check_call("attention", 3, (), inputs, None, params)
    return reference.attention(*inputs)


def _attention_launch(stream, inputs, outputs, **params):
    _check_call("attention", 3, (), inputs, outputs, params)
    # splits=1: split-KV would allocate a workspace the memory plan does not know about
    attention(inputs[0], inputs[1], inputs[2], outputs[0], stream, splits=1)


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


# ---- training: backward and optimizer ------------------------------------------------------


def _train_task(name, n_inputs, fn_ref, fn_launch, flops, out_shapes, params=(), n_outputs=1):
    """A KernelTask whose reference and launch take the inputs positionally (the optional
    accumulator last) and check arity, params and outputs in one place."""

    def ref(inputs, **p):
        _check_call(name, n_inputs, params, inputs, None, p, n_outputs)
        return fn_ref(*inputs, **p)

    def launch(stream, inputs, outputs, **p):
        _check_call(name, n_inputs, params, inputs, outputs, p, n_outputs)
        fn_launch(stream, list(inputs), list(outputs), **p)

    def bytes_moved(shapes, **p):
        return float(F32 * (sum(_numel(s) for s in shapes) + sum(_numel(s) for s in out_shapes(shapes, **p))))

    return KernelTask(name, ref, launch, flops, bytes_moved, lambda shapes, **p: tuple(out_shapes(shapes, **p)[0]),
                      n_inputs, params, n_outputs, out_shapes)


def _acc(inputs, i):
    return inputs[i] if len(inputs) > i else None


def _gemm_flops(m, n, k):
    return 2.0 * m * n * k


def _attention_backward_flops(shapes, **p):
    return 2.5 * _attention_flops(shapes)  # dV, dP, dQ, dK: 4 matmuls, plus the recomputed QK^T


_TRAIN = (
    _train_task(
        "linear_dx", (2, 3),
        lambda dy, w, acc=None: reference.linear_backward_x(dy, w) + (0 if acc is None else acc),
        lambda s, i, o: linear_dx(i[0], i[1], o[0], s, acc=_acc(i, 2)),
        lambda sh, **p: _gemm_flops(sh[0][0], sh[1][1], sh[0][1]),
        lambda sh, **p: [(sh[0][0], sh[1][1])]),
    _train_task(
        "linear_dw", (2, 3),
        lambda dy, x, acc=None: reference.linear_backward_w(dy, x, acc),
        lambda s, i, o: linear_dw(i[0], i[1], o[0], s, acc=_acc(i, 2)),
        lambda sh, **p: _gemm_flops(sh[0][1], sh[1][1], sh[0][0]),
        lambda sh, **p: [(sh[0][1], sh[1][1])]),
    _train_task(
        "rmsnorm_dx", 3,
        lambda x, w, dy, eps=1e-6: reference.rmsnorm_backward(x, w, dy, eps)[0],
        lambda s, i, o, eps=1e-6: rmsnorm_backward_dx(_rows(i[0]), i[1], _rows(i[2]), _rows(o[0]), eps, s),
        lambda sh, **p: 8.0 * _numel(sh[0]),
        lambda sh, **p: [tuple(sh[0])], ("eps",)),
    _train_task(
        "rmsnorm_dw", (2, 3),
        lambda x, dy, acc=None, eps=1e-6: reference.rmsnorm_backward(x, np.ones(x.shape[-1], x.dtype), dy, eps)[1]
        + (0 if acc is None else acc),
        lambda s, i, o, eps=1e-6: rmsnorm_backward_dw(_rows(i[0]), _rows(i[1]), o[0], eps, s, acc=_acc(i, 2)),
        lambda sh, **p: 5.0 * _numel(sh[0]),
        lambda sh, **p: [(sh[0][len(sh[0]) - 1],)], ("eps",)),
    _train_task(
        "rope_backward", 1,
        lambda dy, theta=10000.0: reference.rope_backward(dy, theta),
        lambda s, i, o, theta=10000.0: rope_backward(i[0], o[0], theta, 0, s),
        _rope_flops, lambda sh, **p: [tuple(sh[0])], ("theta",)),
    _train_task(
        "attention_lse", 3,
        reference.attention_lse,
        lambda s, i, o: attention(i[0], i[1], i[2], o[0], s, lse=o[1], splits=1),
        _attention_flops,
        lambda sh, **p: [tuple(sh[0]), (sh[0][0], sh[0][2], sh[0][1])], n_outputs=2),
    _train_task(
        "attention_backward", 6,
        reference.attention_backward,
        lambda s, i, o: attention_backward(*i, *o, stream=s),
        _attention_backward_flops,
        lambda sh, **p: [tuple(sh[0]), tuple(sh[1]), tuple(sh[2])], n_outputs=3),
    _train_task(
        "swiglu_backward", 3,
        reference.swiglu_backward,
        lambda s, i, o: swiglu_backward(*i, *o, stream=s),
        lambda sh, **p: 10.0 * _numel(sh[0]),
        lambda sh, **p: [tuple(sh[0]), tuple(sh[0])], n_outputs=2),
    _train_task(
        "adamw", 4,
        lambda w, g, m, v, **hp: reference.adamw(w, g, m, v, **hp),
        lambda s, i, o, **hp: adamw(*i, *o, stream=s, **hp),
        lambda sh, **p: 12.0 * _numel(sh[0]),
        lambda sh, **p: [tuple(sh[0])] * 3, ("lr", "beta1", "beta2", "eps", "weight_decay", "step"), 3),
    _train_task(
        "cross_entropy", 2,
        cross_entropy_ref,
        lambda s, i, o: cross_entropy(i[0], i[1], o[0], o[1], stream=s),
        lambda sh, **p: 6.0 * _numel(sh[0]),
        lambda sh, **p: [(sh[0][0],), tuple(sh[0])], n_outputs=2),
)


# ---- the whole model: embedding, biases, rows, the KV cache, decoding (model_ops.py) ----------
# (inputs, params, outputs): embedding ids (T,) int32, table (V, H) -> (T, H); bias_add x (M, N),
# b (N,) -> (M, N); take_rows x (M, N), lo, hi -> (hi - lo, N); append_rows cache (T, N), new
# (R, N) -> (T + R, N); attention_cached q (B, Tq, nh, hd), k, v (B, Tk, nkv, hd) -> like q
# (query i at position Tk - Tq + i); argmax x (R, V) -> (R,) int32.

_MODEL = (
    _train_task("embedding", 2, model_ops.embedding_ref, lambda s, i, o: model_ops.embedding(i[0], i[1], o[0], s),
                lambda sh, **p: 0.0, lambda sh, **p: [(sh[0][0], sh[1][1])]),
    _train_task("bias_add", 2, model_ops.bias_add_ref, lambda s, i, o: model_ops.bias_add(i[0], i[1], o[0], s),
                lambda sh, **p: float(_numel(sh[0])), lambda sh, **p: [tuple(sh[0])]),
    _train_task("take_rows", 1, model_ops.take_rows_ref,
                lambda s, i, o, lo, hi: model_ops.take_rows(i[0], o[0], lo, s),
                lambda sh, **p: 0.0, lambda sh, lo, hi, **p: [(hi - lo, sh[0][1])], ("lo", "hi")),
    _train_task("append_rows", 2, model_ops.append_rows_ref,
                lambda s, i, o: model_ops.append_rows(i[0], i[1], o[0], s),
                lambda sh, **p: 0.0, lambda sh, **p: [(sh[0][0] + sh[1][0], sh[0][1])]),
    _train_task("attention_cached", 3, model_ops.attention_cached_ref,
                lambda s, i, o: model_ops.attention_cached(i[0], i[1], i[2], o[0], s),
                lambda sh, **p: 4.0 * sh[0][0] * sh[0][1] * sh[0][2] * sh[0][3] * sh[1][1],
                lambda sh, **p: [tuple(sh[0])]),
    _train_task("argmax", 1, model_ops.argmax_ref, lambda s, i, o: model_ops.argmax(i[0], o[0], s),
                lambda sh, **p: float(_numel(sh[0])), lambda sh, **p: [(sh[0][0],)]),
)


KERNEL_TASKS: dict[str, KernelTask] = {
    t.name: t
    for t in (
        KernelTask("linear", _linear_ref, _linear_launch, _linear_flops, _bytes(_linear_out),
                   _linear_out, 2),
        KernelTask("rmsnorm", _rmsnorm_ref, _rmsnorm_launch, _rmsnorm_flops,
                   _bytes(_same_shape_out), _same_shape_out, 2, ("eps",)),
        KernelTask("rope", _rope_ref, _rope_launch, _rope_flops, _bytes(_same_shape_out),
                   _same_shape_out, 1, ("theta", "offset")),
        KernelTask("attention", _attention_ref, _attention_launch, _attention_flops,
                   _bytes(_same_shape_out), _same_shape_out, 3),
        KernelTask("swiglu", _swiglu_ref, _swiglu_launch, lambda s, **p: 5.0 * _numel(s[0]),
                   _bytes(_same_shape_out), _same_shape_out, 2),
        KernelTask("residual_add", _residual_ref, _residual_launch,
                   lambda s, **p: 1.0 * _numel(s[0]), _bytes(_same_shape_out),
                   _same_shape_out, 2),
        *_TRAIN,
        *_MODEL,
    )
}

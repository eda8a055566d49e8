"""Numpy execution of one task-graph vertex (the sim backend's kernels and the ground truth)."""

from __future__ import annotations

import numpy as np

from vmstoolkit.exec.errors import InvalidGraphError
from vmstoolkit.exec.graph import MODEL_OPS, TRAIN_OPS, TaskGraph
from vmstoolkit.kernels import reference as ref


def run_op(v, inputs: list[np.ndarray]) -> list[np.ndarray]:
    """Outputs of vertex ``v`` for host ``inputs`` (each reshaped to the vertex's view)."""
    n_in = len(v.inputs)
    xs = [a.reshape(shape) for a, shape in zip(inputs, v.views[:n_in])]
    out_shape = v.views[n_in]
    op = v.op
    if op == "linear":
        y = ref.linear(xs[0], xs[1])
    elif op == "rmsnorm":
        y = ref.rmsnorm(xs[0], xs[1], v.params.get("eps", 1e-6))
    elif op == "rope":
        y = ref.rope(xs[0], v.params.get("theta", 10000.0), v.params.get("offset", 0))
    elif op == "attention":
        y = ref.attention(xs[0], xs[1], xs[2])
    elif op == "swiglu":
        y = ref.swiglu(xs[0], xs[1])
    elif op == "residual_add":
        y = ref.residual_add(xs[0], xs[1])
    elif op == "concat":
        y = np.concatenate(xs, axis=-1)
    elif op == "copy":
        y = xs[0].copy()
    elif op in MODEL_OPS:  # their own output dtypes (token ids are int32)
        from vmstoolkit.kernels.tasks import KERNEL_TASKS

        y = KERNEL_TASKS[op].reference(xs, **v.params)
        return [np.ascontiguousarray(y).reshape(out_shape)]
    elif op in TRAIN_OPS:
        from vmstoolkit.kernels.tasks import KERNEL_TASKS

        task = KERNEL_TASKS[op]
        ys = task.reference(xs, **v.params)
        ys = list(ys) if task.n_outputs > 1 else [ys]
        return [np.ascontiguousarray(y, dtype=xs[0].dtype).reshape(shape) for y, shape in zip(ys, v.views[n_in:])]
    else:
        raise InvalidGraphError(f"vertex {v.name!r}: no numpy implementation of op {op!r}")
    return [np.ascontiguousarray(y, dtype=xs[0].dtype).reshape(out_shape)]


def reference_forward(graph: TaskGraph, values: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
    """Run ``graph`` in program order with the numpy reference kernels; returns every tensor."""
    vals = dict(values)
    for v in graph.vertices:
        for t, res in zip(v.outputs, run_op(v, [vals[t] for t in v.inputs])):
            vals[t] = res.reshape(graph.tensors[t].shape)
    return vals

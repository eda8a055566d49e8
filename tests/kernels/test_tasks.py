import numpy as np
import pytest
from numba import cuda

from vmstoolkit.kernels import KERNEL_TASKS

# name -> (input shapes, params)
CASES = {
    "linear": ([(5, 7), (6, 7)], {}),
    "rmsnorm": ([(2, 3, 10), (10,)], {"eps": 1e-5}),
    "rope": ([(2, 5, 3, 6)], {"theta": 100.0}),
    "attention": ([(1, 7, 4, 4), (1, 7, 2, 4), (1, 7, 2, 4)], {}),
    "swiglu": ([(3, 11), (3, 11)], {}),
    "residual_add": ([(4, 9), (4, 9)], {}),
}
# the training tasks (several outputs, optional accumulators)
TRAIN_CASES = {
    "linear_dx": ([(5, 6), (6, 7), (5, 7)], {}),
    "linear_dw": ([(5, 6), (5, 7)], {}),
    "rmsnorm_dx": ([(3, 10), (10,), (3, 10)], {"eps": 1e-5}),
    "rmsnorm_dw": ([(3, 10), (3, 10), (10,)], {"eps": 1e-5}),
    "rope_backward": ([(2, 5, 3, 6)], {"theta": 100.0}),
    "attention_lse": ([(1, 7, 4, 4), (1, 7, 2, 4), (1, 7, 2, 4)], {}),
    "attention_backward": ([(1, 7, 4, 4), (1, 7, 2, 4), (1, 7, 2, 4), (1, 7, 4, 4), (1, 4, 7), (1, 7, 4, 4)], {}),
    "swiglu_backward": ([(3, 11)] * 3, {}),
    "adamw": ([(3, 11)] * 4, {"lr": 1e-2, "beta1": 0.9, "beta2": 0.99, "eps": 1e-8, "weight_decay": 0.1, "step": 3}),
}


# the whole model's tasks (tests/kernels/test_model_ops.py launches each through this table)
MODEL_TASKS = {"embedding", "bias_add", "take_rows", "append_rows", "attention_cached", "argmax",
               "cross_entropy"}  # cross_entropy: tests/exec/model/test_lm_loss.py


def test_names_match_the_runtime_interface():
    assert set(KERNEL_TASKS) == set(CASES) | set(TRAIN_CASES) | MODEL_TASKS
    assert all(t.name == n for n, t in KERNEL_TASKS.items())


@pytest.mark.parametrize("name", sorted(CASES))
def test_launch_on_a_stream_matches_reference(name, rng, rel_err):
    task = KERNEL_TASKS[name]
    shapes, params = CASES[name]
    inputs = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    want = task.reference(inputs, **params)
    assert tuple(want.shape) == task.output_shape(shapes, **params)
    stream = cuda.stream()
    d_in = [cuda.to_device(a, stream=stream) for a in inputs]
    d_out = cuda.device_array(want.shape, np.float32, stream=stream)
    assert task.launch(stream, d_in, [d_out], **params) is None
    stream.synchronize()
    assert rel_err(d_out.copy_to_host(), want) <= 1e-5
    assert task.flops(shapes, **params) > 0
    assert task.bytes_moved(shapes, **params) >= 4 * sum(np.prod(s) for s in shapes)


def test_cost_model_figures():
    lin = KERNEL_TASKS["linear"]
    assert lin.flops([(64, 32), (16, 32)]) == 2 * 64 * 16 * 32
    assert lin.bytes_moved([(64, 32), (16, 32)]) == 4 * (64 * 32 + 16 * 32 + 64 * 16)
    att = KERNEL_TASKS["attention"]
    # causal: T (T + 1) / 2 pairs, 2 matmuls, 2 flops per multiply-add
    assert att.flops([(1, 4, 2, 8), (1, 4, 1, 8), (1, 4, 1, 8)]) == 4 * 2 * 8 * 10


def test_bad_calls_raise():
    task = KERNEL_TASKS["rmsnorm"]
    x = cuda.to_device(np.ones((2, 4), np.float32))
    w = cuda.to_device(np.ones(4, np.float32))
    y = cuda.device_array((2, 4), np.float32)
    with pytest.raises(ValueError, match="unknown params"):
        task.launch(0, [x, w], [y], theta=1.0)
    with pytest.raises(ValueError, match="expected 2 inputs"):
        task.launch(0, [x], [y])
    with pytest.raises(ValueError, match="unknown params"):
        KERNEL_TASKS["attention"].reference([np.ones((1, 2, 1, 2), np.float32)] * 3, scale=2.0)


@pytest.mark.parametrize("name", sorted(TRAIN_CASES))
def test_training_task_launch_matches_reference(name, rng, rel_err):
    task = KERNEL_TASKS[name]
    shapes, params = TRAIN_CASES[name]
    inputs = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    if name == "adamw":
        inputs[3] = np.abs(inputs[3])  # second moments are non-negative
    want = task.reference(inputs, **params)
    want = list(want) if task.n_outputs > 1 else [want]
    assert [tuple(w.shape) for w in want] == task.shapes_out(shapes, **params)
    stream = cuda.stream()
    d_in = [cuda.to_device(a, stream=stream) for a in inputs]
    d_out = [cuda.device_array(w.shape, np.float32, stream=stream) for w in want]
    task.launch(stream, d_in, d_out, **params)
    stream.synchronize()
    for d, w in zip(d_out, want):
        assert rel_err(d.copy_to_host(), w) <= 1e-5
    assert task.flops(shapes, **params) > 0
    with pytest.raises(ValueError, match=f"expected {task.n_outputs} output"):
        task.launch(stream, d_in, d_out + [d_out[0]], **params)

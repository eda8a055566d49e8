"""The whole model's kernels (``kernels/model_ops.py``) equal their numpy references on Numba's
simulator, at shapes that cross a block's width (keys beyond one chunk, rows beyond one block)."""

import numpy as np
import pytest
from numba import cuda

from vmstoolkit.errors import KernelError
from vmstoolkit.kernels import model_ops as M
from vmstoolkit.kernels.tasks import KERNEL_TASKS

rng = np.random.default_rng(0)


def f32(*shape):
    return rng.standard_normal(shape).astype(np.float32)


def run(fn, ins, out_shape, out_dtype=np.float32, **kw):
    d_out = cuda.device_array(out_shape, dtype=out_dtype)
    fn(*[cuda.to_device(a) for a in ins], d_out, **kw)
    return d_out.copy_to_host()


def test_embedding_gathers_rows():
    ids, table = np.array([3, 0, 7, 3], np.int32), f32(9, 5)
    np.testing.assert_array_equal(run(M.embedding, (ids, table), (4, 5)), M.embedding_ref(ids, table))


def test_bias_add_and_rows():
    x, b = f32(3, 6), f32(6)
    np.testing.assert_array_equal(run(M.bias_add, (x, b), (3, 6)), M.bias_add_ref(x, b))
    d_y = cuda.device_array((2, 6), np.float32)
    M.take_rows(cuda.to_device(x), d_y, 1)
    np.testing.assert_array_equal(d_y.copy_to_host(), M.take_rows_ref(x, 1, 3))
    c, n = f32(5, 4), f32(1, 4)
    np.testing.assert_array_equal(run(M.append_rows, (c, n), (6, 4)), M.append_rows_ref(c, n))


def test_argmax_takes_the_first_of_ties_like_torch():
    x = f32(3, 77)
    x[1, 10] = x[1, 50] = 9.0  # a tie: the lower index wins
    got = run(M.argmax, (x,), (3,), np.int32)
    np.testing.assert_array_equal(got, M.argmax_ref(x))
    assert got[1] == 10


@pytest.mark.parametrize("tq,tk,nh,nkv,hd", [(1, 70, 4, 2, 8), (3, 9, 2, 1, 6), (1, 1, 2, 2, 4)])
def test_attention_over_a_cache(tq, tk, nh, nkv, hd):
    q, k, v = f32(1, tq, nh, hd), f32(1, tk, nkv, hd), f32(1, tk, nkv, hd)
    got = run(M.attention_cached, (q, k, v), q.shape)
    np.testing.assert_allclose(got, M.attention_cached_ref(q, k, v), atol=2e-6, rtol=1e-5)


def test_attention_over_a_cache_equals_causal_attention_when_square():
    from vmstoolkit.kernels.reference import attention

    q, k, v = f32(1, 5, 4, 8), f32(1, 5, 2, 8), f32(1, 5, 2, 8)
    np.testing.assert_allclose(M.attention_cached_ref(q, k, v), attention(q, k, v), atol=1e-6)


def test_rope_task_takes_an_offset():
    from vmstoolkit.kernels.reference import rope

    x = f32(1, 1, 2, 8)
    got = KERNEL_TASKS["rope"].reference([x], theta=100.0, offset=5)
    np.testing.assert_allclose(got, rope(f32(1, 6, 2, 8) * 0 + np.concatenate([np.zeros((1, 5, 2, 8), np.float32), x], 1), 100.0)[:, 5:], atol=1e-6)


def test_launchers_refuse_mismatched_shapes():
    with pytest.raises(KernelError, match="append_rows"):
        M.append_rows(cuda.to_device(f32(2, 3)), cuda.to_device(f32(1, 4)), cuda.device_array((3, 3), np.float32))
    with pytest.raises(KernelError, match="int32"):
        M.embedding(cuda.to_device(np.zeros(2, np.int64)), cuda.to_device(f32(4, 3)), cuda.device_array((2, 3), np.float32))


MODEL_CASES = {  # name -> (inputs, params)
    "embedding": (lambda: [np.array([2, 0, 2], np.int32), f32(4, 6)], {}),
    "bias_add": (lambda: [f32(3, 5), f32(5)], {}),
    "take_rows": (lambda: [f32(4, 5)], {"lo": 3, "hi": 4}),
    "append_rows": (lambda: [f32(4, 6), f32(1, 6)], {}),
    "attention_cached": (lambda: [f32(1, 1, 4, 6), f32(1, 5, 2, 6), f32(1, 5, 2, 6)], {}),
    "argmax": (lambda: [f32(2, 40)], {}),
}


@pytest.mark.parametrize("name", sorted(MODEL_CASES))
def test_every_model_task_launches_through_the_table(name):
    task = KERNEL_TASKS[name]
    make, params = MODEL_CASES[name]
    inputs = make()
    want = task.reference(inputs, **params)
    assert tuple(want.shape) == task.output_shape([a.shape for a in inputs], **params)
    d_out = cuda.device_array(want.shape, want.dtype)
    task.launch(0, [cuda.to_device(a) for a in inputs], [d_out], **params)
    np.testing.assert_allclose(d_out.copy_to_host(), want, atol=2e-6, rtol=1e-5)

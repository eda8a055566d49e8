"""The backward kernels and AdamW against their numpy references, in the CUDA simulator (or on a
GPU with VMSTOOLKIT_REAL_GPU=1); the GEMM's backward layouts are tested in test_gemm.py. The
references themselves are checked by finite differences in test_reference_backward.py."""

import numpy as np
import pytest
from numba import cuda

from vmstoolkit.kernels import adamw, attention_backward, rmsnorm, rope, swiglu


def test_rmsnorm_backward():
    """Ragged for the simulator's dw tiles: H 5, 19, 33 against a span of 8 and 8 columns per
    row-factor trip, R 1, 3, 4, 9 against batches of 4."""
    assert {r["grad"] for r in rmsnorm.validate_backward()} == {"dx", "dw", "dw+acc", "dw+="}


def test_rmsnorm_dw_other_tiles():
    """More row lanes, 4 rows per thread, an unroll that leaves a tail of columns (40 = 24 + 16),
    3 batches of 8 rows (the last one of 1), 3 blocks of 16 columns (the last one of 8)."""
    rmsnorm.validate_backward(shapes=((17, 40),), tiles=rmsnorm.DwTiles(8, 2, 2, 8, 3))


def test_rmsnorm_dw_without_rows_is_acc_or_zero():
    x = cuda.to_device(np.zeros((0, 5), np.float32))
    acc = np.arange(5, dtype=np.float32)
    dw = cuda.to_device(np.full(5, np.nan, np.float32))
    rmsnorm.rmsnorm_backward_dw(x, x, dw)
    assert not dw.copy_to_host().any()
    rmsnorm.rmsnorm_backward_dw(x, x, dw, acc=cuda.to_device(acc))
    assert (dw.copy_to_host() == acc).all()


@pytest.mark.parametrize("tiles, match", [
    (dict(rows=6, row_lanes=4), "rows must be a multiple of row_lanes"),
    (dict(col_lanes=64, row_lanes=32), "at most 1024"),
    (dict(unroll=0), "at least 1"),
])
def test_rmsnorm_dw_tiles_errors(tiles, match):
    x = cuda.to_device(np.zeros((2, 4), np.float32))
    with pytest.raises(ValueError, match=match):
        rmsnorm.rmsnorm_backward_dw(x, x, cuda.to_device(np.zeros(4, np.float32)), tiles=rmsnorm.DwTiles(**tiles))


def test_rope_backward_undoes_the_rotation(rng, rel_err):
    rope.validate_backward()
    x = rng.standard_normal((1, 6, 2, 8), dtype=np.float32)
    d = cuda.to_device(x)
    rope.rope(d, d, 500.0)
    rope.rope_backward(d, d, 500.0)  # rotation then its transpose: the identity
    assert rel_err(d.copy_to_host(), x) <= 1e-6


def test_swiglu_backward():
    swiglu.validate_backward()


def test_attention_backward_gqa_ragged():
    recs = attention_backward.validate()
    assert {r["out"] for r in recs} == {"o", "lse", "dq", "dk", "dv"}


def test_attention_backward_other_tiles():
    attention_backward.validate(shapes=((1, 11, 4, 2, 4),), tiles=attention_backward.BackwardTiles(bq=3, bkv=5, bq_dkv=2))


def test_attention_backward_shape_errors():
    q = cuda.to_device(np.zeros((1, 4, 2, 4), np.float32))
    bad_lse = cuda.to_device(np.zeros((1, 4, 2), np.float32))
    with pytest.raises(ValueError, match=r"lse has shape \(1, 4, 2\), expected \(B, nh, T\) = \(1, 2, 4\)"):
        attention_backward.attention_backward(q, q, q, q, bad_lse, q, q, q, q)


def test_adamw_kernel():
    adamw.validate()
    z = cuda.to_device(np.zeros(3, np.float32))
    with pytest.raises(ValueError, match="step counts from 1"):
        adamw.adamw(z, z, z, z, z, z, z, lr=1e-3, step=0)


@pytest.mark.parametrize("hd", [64, 128])
def test_default_backward_tiles_fit_static_shared_memory_at_llama_head_dims(hd):
    """The H200 run found the default tiles needing 66 KB at head_dim 128 (over the 48 KB limit)."""
    attention_backward.BackwardTiles().check(hd)

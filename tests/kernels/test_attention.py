import numpy as np
import pytest
from numba import cuda

from vmstoolkit.kernels import attention as A
from vmstoolkit.kernels import reference as R


def test_validate_ragged_gqa_shapes():
    recs = A.validate()
    assert len(recs) == 4


def test_several_key_tiles_and_query_tiles(rng, rel_err):
    # T = 21 over 8-query / 4-key simulator tiles: 3 query tiles, up to 6 key tiles each.
    b, t, nh, nkv, hd = 1, 21, 4, 1, 4
    q = rng.standard_normal((b, t, nh, hd), dtype=np.float32) * 3  # (B, T, nh, hd)
    k = rng.standard_normal((b, t, nkv, hd), dtype=np.float32) * 3  # (B, T, nkv, hd)
    v = rng.standard_normal((b, t, nkv, hd), dtype=np.float32)
    o = cuda.device_array(q.shape, np.float32)
    A.attention(cuda.to_device(q), cuda.to_device(k), cuda.to_device(v), o)
    want = R.attention(q, k, v)
    assert rel_err(o.copy_to_host(), want) <= 1e-5


def test_h200_tiles_on_a_tiny_problem():
    # The GPU launch shape (32 queries x 16 keys, 128 threads), head_dim 16, two query tiles.
    A.validate(shapes=((1, 40, 2, 1, 16),), tiles=A.AttentionTiles())


def test_gqa_heads_must_divide():
    q = cuda.to_device(np.zeros((1, 4, 3, 4), np.float32))
    kv = cuda.to_device(np.zeros((1, 4, 2, 4), np.float32))
    with pytest.raises(ValueError, match="n_heads=3 is not a multiple of n_kv_heads=2"):
        A.attention(q, kv, kv, cuda.device_array((1, 4, 3, 4), np.float32))


def test_tiles_too_big_for_shared_memory_raise():
    with pytest.raises(ValueError, match="shared memory"):
        A.AttentionTiles(bq=64, bkv=16, rm=4, tpr=8).check(128)

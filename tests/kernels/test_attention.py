"""Both attention kernels (o and the row statistics lse) against the numpy reference, in the CUDA
simulator (or on a GPU with VMSTOOLKIT_REAL_GPU=1): ragged T, GQA ratios 1 to 4, T = 1, several
heads per block, split-KV."""

import numpy as np
import pytest
from numba import cuda

from vmstoolkit.kernels import attention as A
from vmstoolkit.kernels import reference as R

# (B, T, nh, nkv, hd): group 1, 2, 3 and 4; T = 1 and T not a multiple of any tile
SHAPES = ((1, 5, 2, 2, 4), (2, 9, 4, 2, 8), (1, 17, 3, 1, 6), (1, 11, 8, 2, 8), (1, 1, 4, 1, 4))
# Tiles with runs of 4 rows / columns per thread (the GPU's 128-bit loads), 16 threads:
# 16 rows = 4 positions x 4 heads, 8 keys per tile.
RUNS4 = A.FlashTiles(rows=16, heads=4, bkv=8, tr=4, tk=2, to=4)


@pytest.mark.parametrize("variant", (1, 2))
def test_both_variants_on_ragged_gqa_shapes(variant):
    recs = A.validate(shapes=SHAPES, variant=variant)
    assert {r["out"] for r in recs} == {"o", "lse"} and len(recs) == 2 * len(SHAPES)


@pytest.mark.parametrize("splits", (2, 4))
def test_split_kv_with_empty_splits_and_combined_lse(splits):
    # T = 17 over 4-key tiles: the first query tiles have fewer key tiles than splits
    A.validate(shapes=SHAPES[2:], variant=2, splits=splits)


@pytest.mark.parametrize("splits", (1, 3))
def test_runs_of_four_tiles_gqa_1_and_4(splits):
    A.validate(shapes=((1, 21, 8, 2, 16), (2, 13, 4, 4, 16), (1, 1, 4, 1, 16)), tiles=RUNS4, splits=splits)


# The GPU candidates' switches (register double buffering of both loops, base-2 softmax), each
# turned from its default (both loops double-buffered, base e; the tests above run the defaults),
# on the runs-of-4 tiles and the simulator's (runs of 1; hd 6: the score loop's plain path, which
# double buffering needs hd % 4 == 0 to leave). Split-KV combines the splits' partial outputs by
# their row statistics, so base 2 runs with and without it; the other switches, with it. Runs of
# 4: GQA group 4 over 4 query tiles and 2 key tiles (3 splits: one empty), and T = 1.
SWITCHES = ({"dbuf": False}, {"pv_dbuf": False}, {"exp2": True}, {"dbuf": False, "pv_dbuf": False, "exp2": True})


@pytest.mark.parametrize("switches, splits", [(s, 3) for s in SWITCHES] + [({"exp2": True}, 1)])
def test_double_buffered_and_exp2_kernels(switches, splits):
    from dataclasses import replace
    A.validate(shapes=((1, 13, 8, 2, 16), (1, 1, 4, 1, 16)), tiles=replace(RUNS4, **switches), splits=splits)
    A.validate(shapes=(SHAPES[2], SHAPES[3]), tiles=replace(A.SIM_FLASH_TILES, **switches), splits=splits)


def test_several_key_tiles_and_query_tiles(rng, rel_err):
    # T = 29 over the simulator tiles (4 positions x 2 heads, 4 keys): up to 8 key tiles per
    # block, most of them wholly below the diagonal (no mask), GQA group 4, large scores.
    b, t, nh, nkv, hd = 1, 29, 4, 1, 4
    q = rng.standard_normal((b, t, nh, hd), dtype=np.float32) * 3  # (B, T, nh, hd)
    k = rng.standard_normal((b, t, nkv, hd), dtype=np.float32) * 3  # (B, T, nkv, hd)
    v = rng.standard_normal((b, t, nkv, hd), dtype=np.float32)
    want = R.attention(q, k, v)
    for variant in (1, 2):
        o = cuda.device_array(q.shape, np.float32)
        A.attention(cuda.to_device(q), cuda.to_device(k), cuda.to_device(v), o, variant=variant)
        assert rel_err(o.copy_to_host(), want) <= 1e-5


def test_h200_tiles_on_a_tiny_problem():
    # The GPU launch shapes (128 threads), head_dim 16 / 32, GQA group 4, several query tiles.
    A.validate(shapes=((1, 40, 2, 1, 16),), tiles=A.AttentionTiles())
    A.validate(shapes=((1, 20, 4, 1, 32),), tiles=A.FlashTiles(), splits=1)
    for tiles in A.FLASH_CANDIDATES:  # the bench's candidates for the H200
        A.validate(shapes=((1, 20, 4, 1, 32),), tiles=tiles, splits=1)


def test_heads_per_block_divide_the_group():
    t = A.FlashTiles(rows=32, heads=4)
    assert [t.heads_for(g) for g in (1, 2, 3, 4, 8, 6)] == [1, 2, 1, 4, 4, 2]
    launch = A.choose(1, 4096, 32, 8, 128, variant=2)
    assert launch.variant == 2 and launch.heads == (2 if A.simulating() else 4)
    assert A.choose(1, 4096, 32, 8, 128).variant == A.DEFAULT_VARIANT == 2  # measured on the H200


def test_split_rule_fills_the_gpu_only_when_needed():
    tiles = A.FlashTiles()
    target = A.SPLIT_MIN_BLOCKS_SIM if A.simulating() else A.SPLIT_MIN_BLOCKS_PER_SM * A.sm_count()
    assert A._split_count(tiles, 4, 1, 8192, 32) == 1  # 8192 blocks
    assert A._split_count(tiles, 4, 1, 8, 4) == 1  # one key tile: nothing to split
    few = A._split_count(tiles, 4, 1, 64, 4)  # 8 positions of one group: 8 blocks
    assert few == max(1, min(-(-target // 8), 2))  # at most the 2 key tiles of T = 64
    assert A._split_count(tiles, 4, 1, 8, 4) == 1


def test_explicit_workspace_and_workspace_for(rng, rel_err):
    b, t, nh, nkv, hd = 1, 13, 4, 2, 8
    q = rng.standard_normal((b, t, nh, hd), dtype=np.float32)
    k = rng.standard_normal((b, t, nkv, hd), dtype=np.float32)
    v = rng.standard_normal((b, t, nkv, hd), dtype=np.float32)
    ws = cuda.device_array(A.workspace_size(b, t, nh, hd, 3), np.float32)
    o = cuda.device_array(q.shape, np.float32)
    A.attention(cuda.to_device(q), cuda.to_device(k), cuda.to_device(v), o, splits=3, workspace=ws)
    assert rel_err(o.copy_to_host(), R.attention(q, k, v)) <= 1e-5
    assert A.workspace_for(b, t, nh, nkv, hd, splits=1) is None
    assert A.workspace_for(b, t, nh, nkv, hd, splits=2).shape == (A.workspace_size(b, t, nh, hd, 2),)
    with pytest.raises(ValueError, match="workspace has shape"):
        A.attention(cuda.to_device(q), cuda.to_device(k), cuda.to_device(v), o, splits=4, workspace=ws)


def test_variant_and_tile_errors():
    q = cuda.to_device(np.zeros((1, 4, 2, 4), np.float32))
    o = cuda.device_array((1, 4, 2, 4), np.float32)
    with pytest.raises(ValueError, match="unknown attention variant 3"):
        A.attention(q, q, q, o, variant=3)
    with pytest.raises(ValueError, match="variant 1 has no split-KV"):
        A.attention(q, q, q, o, variant=1, splits=2)
    with pytest.raises(ValueError, match="variant 2 takes FlashTiles"):
        A.attention(q, q, q, o, variant=2, tiles=A.SIM_TILES)
    with pytest.raises(ValueError, match="splits=0"):
        A.attention(q, q, q, o, splits=0)
    with pytest.raises(ValueError, match="column groups"):
        A.FlashTiles().check(100)


def test_gqa_heads_must_divide():
    q = cuda.to_device(np.zeros((1, 4, 3, 4), np.float32))
    kv = cuda.to_device(np.zeros((1, 4, 2, 4), np.float32))
    with pytest.raises(ValueError, match="n_heads=3 is not a multiple of n_kv_heads=2"):
        A.attention(q, kv, kv, cuda.device_array((1, 4, 3, 4), np.float32))


def test_tiles_too_big_for_shared_memory_raise():
    with pytest.raises(ValueError, match="shared memory"):
        A.AttentionTiles(bq=64, bkv=16, rm=4, tpr=8).check(128)
    with pytest.raises(ValueError, match="shared memory"):
        A.FlashTiles(rows=64, heads=4, bkv=16, tr=8, tk=2, to=8).check(128)

"""Variant 2 of the attention backward (register-blocked, ``FlashBackwardTiles``) against the
numpy reference in the CUDA simulator: ragged T, GQA groups 1 / 2 / 4, head dims that are and are
not multiples of 4 (128-bit rows or odd rows), tiles that do not divide T. Variant 1 is tested in
test_backward_kernels.py."""

import numpy as np
import pytest
from numba import cuda

from vmstoolkit.kernels import attention_backward as AB
from vmstoolkit.kernels import reference


@pytest.mark.parametrize("shape", [
    (1, 5, 2, 2, 4),  # group 1, T below one tile
    (2, 9, 4, 2, 8),  # group 2, batch 2, ragged T
    (1, 11, 4, 1, 5),  # group 4, hd odd
    (1, 13, 8, 2, 6),  # group 4, hd even, not a multiple of 4
    (1, 6, 2, 1, 32),  # hd 32: the score loops unrolled by 8 steps of 4
])
def test_variant2_matches_reference(shape):
    recs = AB.validate(shapes=(shape,), variant=2)
    assert {r["out"] for r in recs if r["out"].startswith("d")} == {"dq", "dk", "dv"}


@pytest.mark.parametrize("tiles", [
    # 3 x 2 score tiles, one head per block, tiles of 6 (the loops over keys and queries not
    # unrolled by 4), gradient phases of 2 x hd/2 (dq) and 3 x hd/2 (dkv)
    AB.FlashBackwardTiles(rows=6, heads=1, bkv=6, tr=3, tk=2, to=2, keys=6, bq=6, tkk=3, tq=2, tko=3),
    # 1 x 1 score tiles, 16 threads, 4 heads per dq block
    AB.FlashBackwardTiles(rows=4, heads=4, bkv=4, tr=1, tk=1, to=1, keys=4, bq=4, tkk=1, tq=1, tko=1),
])
def test_variant2_other_tiles(tiles):
    AB.validate(shapes=((1, 10, 4, 1, 8), (1, 7, 2, 2, 5)), tiles=tiles)


def test_variant2_runs_of_four_in_the_gradient_phases():
    """4 rows (keys) per thread and, at hd 16, 4 columns: the 128-bit loads of dS / P and of K, dO, Q
    (hd 6: runs of rows only)."""
    tiles = AB.FlashBackwardTiles(rows=8, heads=2, bkv=4, tr=2, tk=2, to=4, keys=8, bq=4, tkk=2, tq=2, tko=4)
    AB.validate(shapes=((1, 11, 4, 2, 16), (1, 9, 4, 1, 6)), tiles=tiles)


def test_variant2_is_deterministic(rng):
    """dk and dv are sums over the group computed by one block each (no atomics): bit-equal runs."""
    b, t, nh, nkv, hd = 1, 9, 4, 1, 4
    q, do = (rng.standard_normal((b, t, nh, hd), dtype=np.float32) for _ in range(2))
    k, v = (rng.standard_normal((b, t, nkv, hd), dtype=np.float32) for _ in range(2))
    o, lse = reference.attention_lse(q, k, v)
    ins = [cuda.to_device(np.ascontiguousarray(a)) for a in (q, k, v, o, lse, do)]
    runs = []
    for _ in range(2):
        outs = [cuda.device_array(a.shape, np.float32) for a in (q, k, v)]
        AB.attention_backward(*ins, *outs, variant=2)
        runs.append([x.copy_to_host() for x in outs])
    for a, b_ in zip(*runs):
        assert np.array_equal(a, b_)


def test_default_is_variant2_and_tiles_pick_the_variant(monkeypatch):
    calls = []
    real = AB.make_flash_backward_kernels
    monkeypatch.setattr(AB, "make_flash_backward_kernels", lambda *a: calls.append(a) or real(*a))
    z = cuda.to_device(np.zeros((1, 3, 2, 4), np.float32))
    lse = cuda.to_device(np.zeros((1, 2, 3), np.float32))
    AB.attention_backward(z, z, z, z, lse, z, z, z, z)
    assert len(calls) == 1  # variant 2, timed on the H200
    AB.attention_backward(z, z, z, z, lse, z, z, z, z, tiles=AB.SIM_TILES)  # variant 1's tiles
    assert len(calls) == 1


def test_default_falls_back_to_variant1_where_variant2_tiles_do_not_fit(monkeypatch):
    monkeypatch.setattr(AB, "simulating", lambda: False)  # the GPU's default tiles
    assert AB.default_variant(64) == AB.default_variant(128) == 2
    assert AB.default_variant(256) == 1  # 69 KB of shared memory at head_dim 256
    assert AB.default_variant(256, AB.FlashBackwardTiles()) == 2  # asked for: its check names the size
    assert AB.default_variant(128, AB.BackwardTiles()) == 1


def test_variant_errors():
    z = cuda.to_device(np.zeros((1, 3, 2, 4), np.float32))
    lse = cuda.to_device(np.zeros((1, 2, 3), np.float32))
    with pytest.raises(ValueError, match="variant=3 is not 1 or 2"):
        AB.attention_backward(z, z, z, z, lse, z, z, z, z, variant=3)
    with pytest.raises(ValueError, match="variant 2 takes FlashBackwardTiles, got BackwardTiles"):
        AB.attention_backward(z, z, z, z, lse, z, z, z, z, variant=2, tiles=AB.BackwardTiles())


@pytest.mark.parametrize("hd", [64, 128])
def test_default_flash_backward_tiles_fit_static_shared_memory(hd):
    t = AB.FlashBackwardTiles()
    t.check(hd)
    assert t.shared_bytes(hd) <= 48 * 1024


def test_flash_backward_tiles_errors():
    with pytest.raises(ValueError, match=r"bytes of shared memory \(> 49152\)"):
        AB.FlashBackwardTiles(rows=32, bkv=32, tr=4, tk=4).check(128)
    with pytest.raises(ValueError, match="rows % tr"):
        AB.FlashBackwardTiles(tr=3).check(128)


def test_flash_backward_tiles_parse():
    t = AB.FlashBackwardTiles.parse("8/2/4/2/2/2/4/8/2/2/2")
    assert (t.rows, t.heads, t.bkv, t.keys, t.bq) == (8, 2, 4, 4, 8)
    with pytest.raises(ValueError, match="'8/2' are not rows/heads/bkv"):
        AB.FlashBackwardTiles.parse("8/2")


@pytest.mark.parametrize("tiles", [AB.FlashBackwardTiles(), *AB.FLASH_BACKWARD_CANDIDATES])
def test_variant2_h200_tile_shapes(tiles):
    """The tile shapes the H200 runs (16 x 16 tiles, 32-64 threads) at a small head dim: GQA group
    4 (4 heads per dq block, as at 32 / 8 heads), T = 17: 2 key tiles and 2 key blocks, the second
    of one key. (Other kv heads than the first: the simulator tiles' tests, same code.)"""
    AB.validate(shapes=((1, 17, 4, 1, 8),), tiles=tiles)

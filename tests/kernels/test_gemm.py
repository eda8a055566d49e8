import numpy as np
import pytest
from numba import cuda

from vmstoolkit.kernels import gemm as G
from vmstoolkit.kernels._util import simulating


@pytest.mark.parametrize("variant", sorted(G.VARIANTS))
def test_variants_match_reference_on_ragged_shapes(variant):
    recs = G.validate(shapes=((8, 8, 4), (5, 7, 9), (17, 3, 13), (16, 24, 8), (1, 1, 1)),
                      variants=(variant,))
    assert len(recs) == 5 and all(r["max_rel_err"] <= 1e-5 for r in recs)


def test_other_tile_shape_with_4x4_micro_tiles():
    tiles = G.GemmTiles(bm=16, bn=16, bk=4, tm=4, tn=4)
    G.validate(shapes=((19, 21, 10), (16, 16, 16)), tiles=tiles)


@pytest.mark.parametrize("tiles", G.GPU_TILES, ids=str)
def test_gpu_tiles_on_a_tiny_ragged_problem(tiles):
    # The launch shapes used on the H200 (256 threads), on one ragged block.
    G.validate(shapes=((3, 5, 19),), tiles=tiles, variants=(G.DEFAULT_VARIANT,))


def test_choose_tiles():
    if simulating():
        assert G.choose_tiles(4096, 4096, 4096).threads <= 64
    else:
        assert G.choose_tiles(4096, 4096, 4096) == G.GPU_TILES[0]
        assert G.choose_tiles(1024, 512, 2048) == G.GPU_TILES[-1]  # 64 blocks of 64 x 128


def test_k_mismatch_dtype_and_output_shape_raise():
    x = cuda.to_device(np.zeros((4, 3), np.float32))
    w = cuda.to_device(np.zeros((5, 2), np.float32))
    with pytest.raises(ValueError, match="K=3"):
        G.gemm(x, w, cuda.device_array((4, 5), np.float32))
    w = cuda.to_device(np.zeros((5, 3), np.float64))
    with pytest.raises(ValueError, match="float64"):
        G.gemm(x, w, cuda.device_array((4, 5), np.float32))
    w = cuda.to_device(np.zeros((5, 3), np.float32))
    with pytest.raises(ValueError, match=r"expected \(M=4, N=5\)"):
        G.gemm(x, w, cuda.device_array((5, 4), np.float32))


def test_bad_tiles_raise():
    with pytest.raises(ValueError):
        G.GemmTiles(bm=8, bn=8, bk=3, tm=2, tn=2).check()  # 8*3 loads over 16 threads
    with pytest.raises(ValueError):
        G.GemmTiles(bm=10, bn=8, bk=4, tm=4, tn=2).check()

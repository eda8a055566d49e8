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


@pytest.mark.parametrize("variant", (3, 4))
@pytest.mark.parametrize("tiles", G.V3_TILES, ids=str)
def test_v3_candidate_tiles_on_a_tiny_ragged_problem(tiles, variant):
    # The 256-thread shapes that experiments/gemm_sweep.py times, on one ragged block.
    G.validate(shapes=((3, 5, 19),), tiles=tiles, variants=(variant,))


@pytest.mark.parametrize("variant", (3, 4))
def test_v3_interior_and_edge_tiles_odd_and_even_slice_counts(variant):
    # 3 x 3 blocks: interior ones take the unchecked fetch, edge ones the checked one; 4 and 3
    # k slices end the two-slice loop on either buffer.
    tiles = G.GemmTiles(bm=16, bn=32, bk=8, tm=4, tn=4)  # 32 threads, 4 + 8 loads per thread
    G.validate(shapes=((40, 70, 32), (40, 70, 21), (32, 64, 16)), tiles=tiles, variants=(variant,))


def test_v3_rejects_slices_it_cannot_unroll():
    with pytest.raises(ValueError, match="multiple of 4"):
        G.make_gemm_v3(G.GemmTiles(bm=8, bn=8, bk=2, tm=2, tn=2))


def test_max_registers():
    assert G.max_registers(256, 2) == 128 and G.max_registers(256, 1) == 255
    assert G.max_registers(192, 2) == 168


def test_choose_follows_the_measured_rule():
    if simulating():
        assert G.choose(4096, 4096, 4096).tiles == G.SIM_TILES
        return
    assert G.choose(4096, 4096, 4096) == G.GemmLaunch(3, G.BIG_TILES_V3)  # 1024 big tiles
    assert G.choose(1024, 2048, 2048) == G.GemmLaunch(4, G.BIG_TILES_V4)  # 128 big tiles
    small = G.choose(1024, 512, 2048)  # 32 big tiles: small tiles, split k
    assert small.tiles == G.SMALL_TILES and small.splits > 1


@pytest.mark.parametrize("splits", (2, 3, 5))
def test_split_k_matches_reference_on_ragged_shapes(splits):
    """K counted in k slices of the tiles in use (4 wide under the simulator, 16 on a GPU):
    4 slices with a part-full last one, 10, and 3 (a split may hold one slice)."""
    t3 = G.choose(8, 8, 64, splits=2).tiles  # the tiles of the launcher's split-K path
    t4 = G.SIM_TILES if simulating() else G.BIG_TILES_V4
    b = t3.bk
    G.validate(shapes=((5, 7, 3 * b + 1), (17, 9, 10 * b), (8, 8, 2 * b + 1)), tiles=t3, variants=(3,),
               splits=min(splits, 3))
    G.validate(shapes=((17, 9, 10 * t4.bk),), tiles=t4, variants=(4,), splits=splits)


def test_split_k_argument_errors():
    x = cuda.to_device(np.zeros((4, 8), np.float32))
    w = cuda.to_device(np.zeros((5, 8), np.float32))
    y = cuda.device_array((4, 5), np.float32)
    with pytest.raises(ValueError, match="no split-K"):
        G.gemm(x, w, y, variant=1, splits=2)
    with pytest.raises(ValueError, match="splits=9"):
        G.gemm(x, w, y, variant=3, tiles=G.SIM_TILES, splits=9)  # K=8: 2 slices of 4


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

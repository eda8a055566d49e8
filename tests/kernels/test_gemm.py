"""The GEMM kernel (forward y = x w^T and the backward layouts dx = dy w, dw = dy^T x) against the
numpy references, in the CUDA simulator (or on a GPU with VMSTOOLKIT_REAL_GPU=1)."""

import numpy as np
import pytest
from numba import cuda

from vmstoolkit.kernels import gemm as G
from vmstoolkit.kernels import gemm_rules as GR
from vmstoolkit.kernels._util import simulating, sm_count

RAGGED = ((8, 8, 4), (5, 7, 9), (17, 3, 13), (16, 24, 8), (1, 1, 1))


@pytest.mark.parametrize("variant", sorted(G.VARIANTS))
def test_variants_match_reference_on_ragged_shapes(variant):
    recs = G.validate(shapes=RAGGED, variants=(variant,))
    assert len(recs) == 5 and all(r["max_rel_err"] <= 1e-5 for r in recs)


def test_backward_layouts_with_and_without_accumulation():
    recs = G.validate_backward(shapes=RAGGED)
    assert {r["case"] for r in recs} == {"dx", "dx+acc", "dw", "dw+acc"} and len(recs) == 20


def test_other_tile_shape_with_4x4_micro_tiles():
    tiles = G.GemmTiles(bm=16, bn=16, bk=4, tm=4, tn=4)
    G.validate(shapes=((19, 21, 10), (16, 16, 16)), tiles=tiles, variants=(3, 5))
    G.validate_backward(shapes=((19, 21, 10),), tiles=tiles)


def test_small_tiles_on_a_tiny_ragged_problem():
    # the small-tile path's 256-thread shape as a GPU runs it, on one ragged block
    G.validate(shapes=((3, 5, 19),), tiles=G.SMALL_TILES, variants=(3,))


@pytest.mark.parametrize("variant, tiles", [(5, t) for t in G.V5_TILES],
                         ids=lambda x: x.label() if isinstance(x, G.GemmTiles) else f"v{x}")
def test_double_buffered_variant_on_the_proposed_tiles_forward_and_backward(variant, tiles):
    # double-buffered fragments on the shapes the sweep times: one ragged block, 2 k slices and a
    # part-full third (forward), 1 slice (dx: K = 7 rows of w), 2 and a part-full third (dw)
    m, n = tiles.bm - 3, tiles.bn - 1
    G.validate(shapes=((m, n, 2 * tiles.bk + 3),), tiles=tiles, variants=(variant,))
    G.validate_backward(shapes=((2 * tiles.bk + 3, 7, n),), tiles=tiles, variant=variant)


@pytest.mark.parametrize("variant", (5,))
@pytest.mark.parametrize("bk", (4, 8, 16))
def test_double_buffered_variants_slice_depths_and_counts(bk, variant):
    # 1, 3, 7 trips of the 2-step fragment loop then 1 unrolled step; 1 to 4 k slices (the
    # two-slice loop ending on either buffer): 4 on a 2 x 2 grid of interior tiles, 3, 2 and 1 on
    # a 2 x 2 grid of one interior tile and three edge ones. Backward: dx over 2 x 2 tiles (two
    # interior) and dw over 3 x 2 (two interior), 1 to 10 slices. 8 x 16 tiles of 8 threads: the
    # paths of 16 x 32 at a quarter of the simulator's work.
    tiles = G.GemmTiles(bm=8, bn=16, bk=bk, tm=4, tn=4)
    shapes = ((16, 32, 4 * bk), (9, 17, 3 * bk - 1), (9, 17, 2 * bk), (9, 17, bk - 2))
    G.validate(shapes=shapes, tiles=tiles, variants=(variant,))
    G.validate_backward(shapes=((16, 20, 18), (5, 3 * bk + 1, 9)), tiles=tiles, variant=variant)


@pytest.mark.parametrize("variant", (5,))
def test_double_buffered_variants_split_k_forward_and_backward(variant):
    # 3 splits of 5 k slices hold 2, 2 and 1 (a first, a middle and a last split; an even and an
    # odd count): forward on 2 x 2 ragged tiles (the last slice part-full) and on whole tiles,
    # backward dw over 3 splits of 2, 2, 1 and dx over 3 of 1 (35 x 19 x 9), then dx over 2, 2, 1
    # and dw over 2 of 1 (9 x 40 x 17)
    tiles = G.GemmTiles(bm=8, bn=16, bk=8, tm=4, tn=4)
    G.validate(shapes=((11, 19, 4 * 8 + 3), (16, 32, 5 * 8)), tiles=tiles, variants=(variant,), splits=3)
    G.validate_backward(shapes=((4 * 8 + 3, 19, 9), (9, 5 * 8, 17)), tiles=tiles, variant=variant, splits=3)


def test_interior_only_build_matches_on_whole_tiles(rng, rel_err):
    # scripts/sass_report.py --hot counts this build's main loop: it must compute the same GEMM
    # wherever every tile lies inside the matrices (2 x 2 tiles, 3 k slices)
    t = G.GemmTiles(bm=16, bn=32, bk=8, tm=4, tn=4)
    xv = rng.standard_normal((2 * t.bm, 3 * t.bk), dtype=np.float32)
    wv = rng.standard_normal((2 * t.bn, 3 * t.bk), dtype=np.float32)
    for v in sorted(G.VARIANTS):
        k = G.get_kernel(v, t, "nn", edge_checks=False)
        d_y = cuda.device_array((2 * t.bm, 2 * t.bn), np.float32)
        k[(2, 2, 1), t.threads](cuda.to_device(xv), cuda.to_device(wv), d_y, d_y, 3)
        assert rel_err(d_y.copy_to_host(), xv @ wv.T) <= 1e-5


@pytest.mark.parametrize("tiles", (G.SKINNY_N_TILES, G.SKINNY_M_TILES), ids=G.GemmTiles.label)
@pytest.mark.parametrize("variant, splits", ((G.SKINNY_VARIANT, None), (G.SKINNY_VARIANT, 2)))
def test_skinny_tiles_forward_and_backward_on_ragged_shapes(tiles, variant, splits):
    # the "skinny" rule's 128 x 16 / 16 x 128 tiles (128 threads of 4 x 4) on a ragged 16-wide
    # output: 2 tiles along the long side (the second part-full), 3 k slices (the last part-full).
    # Outputs kept small: under the simulator a split launch's zero or copy fill costs ~0.3 ms
    # per output element.
    long_, thin = max(tiles.bm, tiles.bn) + 5, 5
    m, n = (long_, thin) if tiles.bn < tiles.bm else (thin, long_)
    k = 2 * tiles.bk + 5
    whole = (long_, 16, 2 * tiles.bk) if tiles.bn < tiles.bm else (16, long_, 2 * tiles.bk)  # 1 interior tile
    G.validate(shapes=((m, n, k), whole), tiles=tiles, variants=(variant,), splits=splits)
    # dx = dy w: output (m, k') with reduction n'; dw = dy^T x: output (n', k') with reduction m'.
    # The short side k' = 21 gives 2 k slices (the second part-full) where it is the reduction.
    kb = tiles.bk + 5
    G.validate_backward(shapes=((m, kb, n),) if tiles.bn < tiles.bm else ((kb, m, n),), tiles=tiles,
                        variant=variant, splits=splits)


def test_skinny_rule_on_lora_shapes():
    R = G.rule_launch
    # rank-16 LoRA at 2048 tokens, 4096 features: x A^T (and dy B) are 2048 x 16 with K = 4096:
    # the proposed rule puts them on 64 x 64 tiles, 3/4 of the FMAs on padding
    assert R(2048, 16, 4096, rule="proposed").tiles == G.SMALL_TILES
    assert R(2048, 16, 4096, rule="skinny") == G.GemmLaunch(5, G.SKINNY_N_TILES, 32)  # 16 tiles x 32 splits
    assert R(4096, 16, 2048, rule="skinny") == G.GemmLaunch(5, G.SKINNY_N_TILES, 16)  # dw of h B^T
    assert R(16, 4096, 2048, rule="skinny") == G.GemmLaunch(5, G.SKINNY_M_TILES, 16)  # dw of x A^T
    # K = 16 (h B^T and dx of x A^T) and wide outputs: the proposed rule's choice
    for shape in ((2048, 4096, 16), (4096, 4096, 4096), (2048, 1024, 4096), (33, 4096, 4096)):
        assert R(*shape, rule="skinny") == R(*shape, rule="proposed")
    # a split keeps >= MIN_SKINNY_SLICES slices; forced splits are kept
    assert R(2048, 16, 256, rule="skinny").splits == 2
    assert R(2048, 16, 16, rule="skinny").splits == 1
    assert R(2048, 16, 4096, splits=3, rule="skinny").splits == 3


def test_small_warp_tiles_with_strided_vectors():
    # 2 warps of 8 x 8 (1 x 2 micro-tiles, no runs of 4); B fetched as 2 vectors per thread.
    tiles = G.GemmTiles(bm=8, bn=16, bk=8, tm=1, tn=2, wm=8, wn=8)
    G.validate(shapes=((9, 17, 13), (16, 32, 24)), tiles=tiles, variants=(3,))
    G.validate_backward(shapes=((9, 17, 13),), tiles=tiles)


@pytest.mark.parametrize("variant", (3, 5))
def test_interior_and_edge_tiles_odd_and_even_slice_counts(variant):
    # 3 x 3 blocks: interior ones take the unchecked fetch, edge ones the checked one; 4 and 3
    # k slices end the two-slice loop on either buffer.
    tiles = G.GemmTiles(bm=16, bn=32, bk=8, tm=4, tn=4)  # 32 threads, 4 + 8 loads per thread
    G.validate(shapes=((40, 70, 32), (40, 70, 21), (32, 64, 16)), tiles=tiles, variants=(variant,))


def test_backward_interior_and_edge_tiles():
    # the transposed fetches (vectors along rows) on full and partial tiles: dx over 9 k slices
    # (the last part-full), dw over 4
    tiles = G.GemmTiles(bm=16, bn=32, bk=8, tm=4, tn=4)
    G.validate_backward(shapes=((32, 70, 40),), tiles=tiles)


def test_tiles_the_kernel_cannot_unroll_or_group_raise():
    with pytest.raises(ValueError, match="multiple of 4"):
        G.make_gemm(G.GemmTiles(bm=8, bn=8, bk=2, tm=2, tn=2))
    with pytest.raises(ValueError, match="not a warp of 32"):
        G.GemmTiles(bm=64, bn=64, bk=8, tm=4, tn=4, wm=32, wn=32).check()
    with pytest.raises(ValueError, match="both wm and wn"):
        G.GemmTiles(bm=64, bn=64, bk=8, tm=4, tn=4, wm=32).check()


def test_max_registers():
    assert G.max_registers(256, 2) == 128 and G.max_registers(256, 1) == 255
    assert G.max_registers(192, 2) == 168 and G.max_registers(128, 2) == 255


def test_every_layout_follows_the_skinny_rule_which_is_proposed_above_skinny_max():
    R = G.rule_launch
    # the H200 sweep 5 of 2026-12-01 timed "proposed" in every layout (79-89% of cuBLAS against
    # 61-84%); sweep 6 the skinny tiles on LoRA's 16-wide outputs (41.7-44.1% against 24.9-39.2,
    # a tie at dy B): every layout runs "skinny", which is "proposed" for wider outputs
    assert GR.DEFAULT_RULE == "skinny"
    for shape in ((4096, 4096, 4096), (2048, 1024, 4096), (1024, 512, 2048), (2048, 4096, 16)):
        for layout in G.LAYOUTS:
            assert R(*shape, layout=layout) == R(*shape, rule="proposed")
    for layout in G.LAYOUTS:
        assert R(2048, 16, 4096, layout=layout) == G.GemmLaunch(5, G.SKINNY_N_TILES, 32)
        assert R(16, 4096, 2048, layout=layout) == G.GemmLaunch(5, G.SKINNY_M_TILES, 16)
    with pytest.raises(ValueError, match="unknown GEMM layout 'xx'"):
        R(8, 8, 8, layout="xx")
    # proposed: variant 13 (5 with 16-byte loads and stores) at 4 warps of 64 x 64 from 3/4 of a wave
    # (2 blocks per SM) up
    big = G.GemmLaunch(13, G.PROPOSED_TILES)
    for shape in ((4096, 4096, 4096), (2048, 4096, 4096), (2048, 11008, 4096), (2048, 4096, 11008),
                  (4096, 1024, 2048)):  # the 7B block's forward shapes, dw of k/v (256 tiles)
        assert R(*shape, rule="proposed") == big
    # under 3/4 of a wave the rule splits k where the waves it saves outweigh the splits' cost
    # (the H200's sweep 6, experiments/results/gemm-h200/run6/): 128 tiles (k/v GQA8, 1B q/o and
    # down) split in 2 (256 blocks, one wave); 72 tiles in 3 (216); the 1B gate/up's 352 tiles
    # (1.33 waves unsplit) in 3 (4 full waves); the 7B gate/up's 1376 (5.2 waves) stays whole:
    # splitting saves under SPLIT_GAIN there
    assert R(2048, 1024, 4096, rule="proposed") == G.GemmLaunch(13, G.PROPOSED_TILES, 2)
    assert R(1024, 2048, 5632, rule="proposed") == G.GemmLaunch(13, G.PROPOSED_TILES, 2)
    assert R(1152, 1024, 4096, rule="proposed") == G.GemmLaunch(13, G.PROPOSED_TILES, 3)
    assert R(1024, 5632, 2048, rule="proposed") == G.GemmLaunch(13, G.PROPOSED_TILES, 3)
    # each split keeps >= MIN_SPLIT_SLICES k slices: K = 512 is 32 slices, 2 splits at most
    assert R(1152, 1024, 512, rule="proposed").splits == 2
    assert R(1024, 5632, 256, rule="proposed").splits == 1
    # 32 tiles (the 1B k/v with GQA4, 1024 x 512): the big tiles split MAX_SPLITS ways
    assert R(1024, 512, 2048, rule="proposed") == G.GemmLaunch(13, G.PROPOSED_TILES, 4)
    # outputs that MAX_SPLITS splits of big tiles leave under half the SMs: variant 3 on small
    # tiles, k split to about two blocks per SM keeping >= MIN_SMALL_SLICES slices
    assert R(512, 512, 2048, rule="proposed") == G.GemmLaunch(3, G.SMALL_TILES, 4)  # 64 small tiles
    assert R(64, 64, 2048, rule="proposed") == G.GemmLaunch(3, G.SMALL_TILES, 16)  # 128 slices / 8
    assert R(2048, 1024, 4096, splits=3, rule="proposed") == G.GemmLaunch(13, G.PROPOSED_TILES, 3)


def test_rules_scale_with_the_device_sm_count(monkeypatch):
    """The thresholds come from the device's SM count (the H200's 132 only under the simulator):
    half the SMs, half the blocks that fill a wave, so a launch of 132 tiles is no longer split."""
    if not simulating():
        pytest.skip("the simulator's SM count")
    assert sm_count() == 132 and GR.split_target_blocks() == 264
    assert GR.rule_launch(2048, 1024, 4096).splits == 2  # 128 tiles: under a wave of 264
    monkeypatch.setattr(GR, "sm_count", lambda: 66)
    assert GR.split_target_blocks() == 132
    assert GR.rule_launch(2048, 1024, 4096).splits == 1  # 128 tiles fill a wave of 132


def test_variant_table_rows_are_consistent():
    """One row per variant; a variant with 16-byte accesses has a scalar twin, down to one without."""
    for v, row in G.VARIANTS.items():
        assert row.number == v
        assert (row.scalar_twin is not None) == row.vector_loads
        assert not row.staged_stores or row.vector_loads
        seen = {v}
        while G.VARIANTS[v].scalar_twin is not None:
            v = G.VARIANTS[v].scalar_twin
            assert v in G.VARIANTS and v not in seen
            seen.add(v)
        assert not G.VARIANTS[v].vector_loads


def test_proposed_splits_follow_the_wave_cost():
    # cost(s): waves of SPLIT_TARGET_BLOCKS blocks per split, times 1 + SPLIT_COST per extra split
    c = G.split_cost
    t = GR.split_target_blocks()
    assert c(t, 1) == 1.0 and c(t // 2, 2) == pytest.approx((1 + G.SPLIT_COST) / 2)  # one wave of half-deep blocks
    assert c(t + 1, 1) == 2.0  # one block over a wave costs a wave
    for blocks in range(sm_count() // 2, 6 * t):  # the chosen split is never worse than unsplit
        s = G.proposed_splits(blocks, 1 << 20)
        assert 1 <= s <= G.MAX_SPLITS
        assert s == 1 or c(blocks, s) < (1 - G.SPLIT_GAIN) * c(blocks, 1)
        assert all(c(blocks, s) <= c(blocks, r) for r in range(1, G.MAX_SPLITS + 1)) or s == 1
    assert G.proposed_splits(t, 1 << 20) == 1  # whole waves are never split


def test_unknown_rule_raises():
    with pytest.raises(ValueError, match="unknown GEMM launch rule 'fast'"):
        G.choose(64, 64, 64, rule="fast")


def test_choose_runs_the_rule_variant():
    if simulating():  # the rule's variant on the tiny tiles
        for layout in G.LAYOUTS:
            assert G.choose(4096, 4096, 4096, layout=layout) == G.GemmLaunch(13, G.SIM_TILES)
            assert G.choose(64, 64, 64, layout=layout) == G.GemmLaunch(3, G.SIM_TILES)
        return
    c = lambda *s: G.choose(*s, layout="nt")  # noqa: E731
    assert c(4096, 4096, 4096) == G.GemmLaunch(13, G.PROPOSED_TILES)
    small = c(256, 512, 2048)  # 8 big tiles: small tiles, split k
    assert small.tiles == G.SMALL_TILES and small.splits > 1


@pytest.mark.parametrize("splits", (2, 3, 5))
def test_split_k_matches_reference_on_ragged_shapes(splits):
    """K counted in k slices of the tiles in use (4 wide under the simulator, 16 on a GPU):
    4 slices with a part-full last one, 10, and 3 (a split may hold one slice)."""
    t3 = G.choose(8, 8, 64, splits=2).tiles  # the tiles of the launcher's split-K path
    t5 = G.SIM_TILES if simulating() else G.PROPOSED_TILES
    b = t3.bk
    G.validate(shapes=((5, 7, 3 * b + 1), (17, 9, 10 * b), (8, 8, 2 * b + 1)), tiles=t3, variants=(3,),
               splits=min(splits, 3))
    G.validate(shapes=((17, 9, 10 * t5.bk),), tiles=t5, variants=(5,), splits=splits)


@pytest.mark.parametrize("splits", (2, 3))
def test_split_k_backward_starts_from_acc(splits):
    # the blocks add into an output first set to the existing gradient (or zero)
    b = G.choose(8, 8, 64, splits=2).tiles.bk
    G.validate_backward(shapes=((5 * b + 3, 6, 9), (7, 5, 4 * b)), splits=splits)


def test_backward_accumulates_in_place_with_and_without_split_k(rng, rel_err):
    dy = rng.standard_normal((13, 5), dtype=np.float32)  # (M, N)
    x = rng.standard_normal((13, 3), dtype=np.float32)  # (M, K)
    g = rng.standard_normal((5, 3), dtype=np.float32)  # (N, K): dw += dy^T x in place
    for splits in (None, 2):
        d_g = cuda.to_device(g)
        G.linear_dw(cuda.to_device(dy), cuda.to_device(x), d_g, acc=d_g, splits=splits)
        assert rel_err(d_g.copy_to_host(), g + dy.T @ x) <= 1e-5


def test_split_k_and_variant_argument_errors():
    x = cuda.to_device(np.zeros((4, 8), np.float32))
    w = cuda.to_device(np.zeros((5, 8), np.float32))
    y = cuda.device_array((4, 5), np.float32)
    with pytest.raises(ValueError, match="unknown GEMM variant 1"):
        G.gemm(x, w, y, variant=1)
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


def test_backward_shape_errors():
    a = cuda.to_device(np.zeros((4, 3), np.float32))
    with pytest.raises(ValueError, match="linear_dx"):
        G.linear_dx(a, a, cuda.device_array((4, 3), np.float32))
    with pytest.raises(ValueError, match="linear_dw"):
        G.linear_dw(a, cuda.to_device(np.zeros((5, 3), np.float32)), cuda.device_array((3, 3), np.float32))


def test_bad_tiles_raise():
    with pytest.raises(ValueError):
        G.GemmTiles(bm=8, bn=8, bk=3, tm=2, tn=2).check()  # 8*3 loads over 16 threads
    with pytest.raises(ValueError):
        G.GemmTiles(bm=10, bn=8, bk=4, tm=4, tn=2).check()


# --- variant 11: 16-byte global loads (kernels/_vector.py) ---------------------------------------

VEC_TILES = G.GemmTiles(bm=16, bn=16, bk=4, tm=4, tn=4)  # 16 threads, 4 elements of A and of B each: one vector


def test_aligned16_reads_base_row_stride_and_column_stride():
    from vmstoolkit.kernels._vector import aligned16

    d = cuda.to_device(np.zeros((6, 12), np.float32))
    assert aligned16(d)
    assert not aligned16(cuda.to_device(np.zeros((6, 13), np.float32)))  # rows of 52 bytes
    assert not aligned16(d[:, 1:9])  # starts 4 bytes into a row
    assert aligned16(d[:, 4:12])  # starts 16 bytes in, rows still 48 bytes apart
    assert not aligned16(d[:, ::2])  # columns 8 bytes apart
    assert aligned16(cuda.to_device(np.zeros((1, 3), np.float32)))  # one row: its stride never used


def test_loaded_variant_falls_back_to_scalar_loads_on_unaligned_operands():
    ok = cuda.to_device(np.zeros((5, 8), np.float32))
    odd = cuda.to_device(np.zeros((5, 9), np.float32))
    assert G.loaded_variant(11, ok, ok) == 11
    assert G.loaded_variant(11, ok, odd) == G.VARIANTS[11].scalar_twin == 5
    assert G.loaded_variant(11, ok[:, 1:5], ok) == 5
    assert G.loaded_variant(5, ok, ok) == 5


def test_vector_loads_forward_and_backward_on_aligned_ragged_shapes():
    # K and N multiples of 4 (aligned rows), M and the tile counts ragged: 2 x 2 tiles of which one
    # is interior (the 16-byte path) and 3 edges (the checked scalar path), 3 k slices
    G.validate(shapes=((19, 20, 12), (32, 32, 8)), tiles=VEC_TILES, variants=(11,))
    G.validate(shapes=((19, 20, 12),), tiles=VEC_TILES, variants=(11,), splits=2)
    G.validate_backward(shapes=((19, 20, 12), (21, 16, 36)), tiles=VEC_TILES, variant=11)


def test_vector_path_reads_every_interior_vector_and_nothing_else(monkeypatch):
    # the interior fetches go through load4 (one call per 4 elements), the edge tiles' do not
    import vmstoolkit.kernels._vector as V

    calls = []

    def counting_load4(a, r, c):
        calls.append((r, c))
        return V.load4(a, r, c)

    monkeypatch.setattr(G, "load4", counting_load4)
    t = VEC_TILES
    kernel = G.make_gemm(t, frag_db=True, vector_loads=True)
    m, n, k = 2 * t.bm, t.bn + 4, 3 * t.bk  # one interior tile, one edge tile; 3 k slices
    x = np.arange(m * k, dtype=np.float32).reshape(m, k) / 100
    w = np.ones((n, k), np.float32)
    d_y = cuda.device_array((m, n), np.float32)
    kernel[(2, 2, 1), t.threads](cuda.to_device(x), cuda.to_device(w), d_y, d_y, 3)
    assert np.allclose(d_y.copy_to_host(), x @ w.T, rtol=1e-5)
    # the check is per operand: x's 16-row slices lie inside in all 4 blocks, w's 16-row slices in
    # the 2 blocks of the first column only; each slice is one vector per thread (3 slices)
    assert len(calls) == (4 + 2) * 3 * t.threads


# --- variant 13: whole output tiles staged through shared memory, 16-byte stores ----------------

# 2 warps, each a 16 x 16 warp tile of 8 x 4 threads with 2 x 4 micro-tiles: the staged path's
# shape (runs of 4 columns per thread) at the simulator's scale
STAGE_TILES = G.GemmTiles(bm=16, bn=32, bk=4, tm=2, tn=4, wm=16, wn=16)


def test_stage_pitch_spreads_a_warps_stores_over_the_banks():
    assert G._stage_pitch(16, 8, 4) == 20  # the proposed tiles: 8 x 4 threads, no two on a bank
    banks = {(r * 20 + c) % 32 for r in range(8) for c in range(4)}
    assert len(banks) == 32
    assert G._stage_pitch(4, 8, 4) >= 4


def test_staged_stores_forward_and_backward_with_edge_tiles_accumulation_and_splits():
    # rows of 16-byte multiples; tile grids with interior tiles (staged) and edge tiles (scalar)
    G.validate(shapes=((19, 36, 8), (32, 64, 12)), tiles=STAGE_TILES, variants=(13,))
    G.validate(shapes=((19, 36, 8),), tiles=STAGE_TILES, variants=(13,), splits=2)  # atomics
    G.validate_backward(shapes=((20, 36, 64),), tiles=STAGE_TILES, variant=13)  # dx, dw, each +acc


def test_staged_path_stores_every_interior_vector_once_and_nothing_else(monkeypatch):
    import vmstoolkit.kernels._vector as V

    calls = []

    def counting_store4(a, r, c, *v):
        calls.append((int(r), int(c)))
        V.store4(a, r, c, *v)

    monkeypatch.setattr(G, "store4", counting_store4)
    t = STAGE_TILES
    kernel = G.make_gemm(t, frag_db=True, vector_loads=True, staged_stores=True)
    m, n, k = 2 * t.bm, t.bn + 4, 2 * t.bk  # 2 interior tiles, 2 edge tiles (4 columns)
    x = np.arange(m * k, dtype=np.float32).reshape(m, k) / 100
    w = np.linspace(-1, 1, n * k, dtype=np.float32).reshape(n, k)
    d_y = cuda.to_device(np.full((m, n), np.nan, np.float32))
    kernel[(2, 2, 1), t.threads](cuda.to_device(x), cuda.to_device(w), d_y, d_y, 2)
    assert np.allclose(d_y.copy_to_host(), x @ w.T, rtol=1e-5)
    want = {(r, c) for r in range(m) for c in range(0, t.bn, 4)}  # the interior tiles' vectors
    assert len(calls) == len(want) and set(calls) == want


def test_loaded_variant_13_needs_an_aligned_output_too():
    ok = cuda.to_device(np.zeros((5, 8), np.float32))
    odd = cuda.to_device(np.zeros((5, 9), np.float32))
    assert G.loaded_variant(13, ok, ok, ok) == 13
    assert G.loaded_variant(13, ok, ok, ok[:, 1:5]) == 11  # output starts mid-vector: 11's stores
    assert G.loaded_variant(13, ok, ok, ok, odd) == 11  # an accumulator with rows of 36 bytes
    assert G.loaded_variant(13, odd, ok, ok) == 5  # an operand too: scalar loads as well


def test_plan_fills_the_rule_choice_and_drops_empty_splits():
    t = G.GemmTiles(bm=16, bn=16, bk=4, tm=4, tn=4)
    # K = 20: 5 slices; 4 splits would be 2 + 2 + 1 + 0 -> 3 splits of 2, 2, 1
    assert G.plan(32, 32, 20, tiles=t, variant=11, splits=4) == G.GemmLaunch(11, t, 3)
    assert G.plan(32, 32, 20, tiles=t, variant=5, splits=5) == G.GemmLaunch(5, t, 5)
    auto = G.choose(32, 32, 20, layout="nt")
    assert G.plan(32, 32, 20, layout="nt") == auto  # nothing given: the layout's rule
    with pytest.raises(ValueError, match="splits=6 must be between 1 and the 5 k slices of K=20"):
        G.plan(32, 32, 20, tiles=t, splits=6)
    with pytest.raises(ValueError, match="splits=0"):
        G.plan(32, 32, 20, tiles=t, splits=0)

"""The wgmma GEMM's layouts on the CPU (no warpgroup MMA runs under the simulator): the fetch code
the kernel is generated from puts every element of a staged slice where the descriptors that the
kernel builds make the hardware read it (:mod:`vmstoolkit.kernels.wgmma_layout`'s model of the
PTX ISA's canonical layouts), each element exactly once, and the accumulator map is a bijection.
The simulator then runs the whole generated kernel through the intrinsics' twins. The GPU checks
are ``tests/gpu/test_gemm_wgmma_gpu.py``."""

import numpy as np
import pytest

from vmstoolkit.errors import KernelError
from vmstoolkit.kernels import gemm_bf16 as GB
from vmstoolkit.kernels import gemm_staging as GS
from vmstoolkit.kernels import gemm_wgmma as GW
from vmstoolkit.kernels import wgmma_layout as WL

TILE = 0x4400  # a shared address on a 1024-byte atom


class _Pitched:
    """Stands for a device array in the generated fetch set-up (it reads ``.strides`` alone)."""

    def __init__(self, pitch):
        self.strides = (2 * pitch, 2)


def _fetch_offsets(trans: bool, rows: int, threads: int) -> dict:
    """Run the generated set-up of one operand's fetch for every thread: {element offset in the
    stage: (shared offset d, the chunk's first (row-or-k, col) in the tile)}."""
    lines = GS.fetch_setup(GW.STAGING, GW.WgmmaTiles(bm=threads // 2), "a", trans, rows, "M")
    code = compile("\n".join(lines), "<fetch>", "exec")
    written = {}
    for tid in range(threads):
        env = {"tid": tid, "r0_a": 0, "kbeg": 0, "M": 10 ** 6, "a": _Pitched(4096), "min": min, "max": max}
        exec(code, env)  # noqa: S102 - the kernel's own generated lines
        for i in range(rows * WL.BK // 8 // threads):
            d = env[f"da{i}"]
            off = env[f"oa{i}"]
            # global element offset -> (k, mn) for "t" (stored (K, rows)), (row, k) for "n"
            key = divmod(off, 4096)
            assert d not in written, ("two chunks written to one place", d, key)
            written[d] = key
    return written


@pytest.mark.parametrize("rows", [64, 128, 256])
def test_kmajor_fetch_lands_where_the_descriptor_reads(rows):
    written = _fetch_offsets(False, rows, 256 if rows >= 128 else 128)
    assert sorted(written) == list(range(0, rows * WL.BK, 8))  # every 16-byte chunk once
    for d, (r, k) in written.items():
        for e in range(8):
            assert 2 * (d + e) == WL.kmajor_offset(r, k + e)
    lbo, sbo = WL.fields(False)
    for step in range(WL.BK // WL.K_STEP):
        for first in range(0, rows, 64):  # a warpgroup's A rows, or all of B at once
            n = 64 if rows > 64 else rows
            start = TILE + first * WL.ROW_BYTES + WL.step_offset(False, step)
            got = WL.reads(WL.descriptor(start, lbo, sbo), n, False)
            want = [[TILE + WL.kmajor_offset(first + r, 16 * step + k) for k in range(16)] for r in range(n)]
            assert (got == np.array(want)).all(), (rows, step, first)
    got = WL.reads(WL.descriptor(TILE + WL.step_offset(False, 2), lbo, sbo), rows, False)  # B: all rows
    assert (got == np.array([[TILE + WL.kmajor_offset(r, 32 + k) for k in range(16)] for r in range(rows)])).all()


@pytest.mark.parametrize("rows", [64, 128, 256])
def test_mnmajor_fetch_lands_where_the_descriptor_reads(rows):
    written = _fetch_offsets(True, rows, 256 if rows >= 128 else 128)
    assert sorted(written) == list(range(0, rows * WL.BK, 8))
    for d, (k, mn) in written.items():
        for e in range(8):
            assert 2 * (d + e) == WL.mnmajor_offset(mn + e, k)
    lbo, sbo = WL.fields(True)
    for step in range(WL.BK // WL.K_STEP):
        start = TILE + WL.step_offset(True, step)
        got = WL.reads(WL.descriptor(start, lbo, sbo), rows, True)  # B: every panel from one descriptor
        want = [[TILE + WL.mnmajor_offset(mn, 16 * step + k) for k in range(16)] for mn in range(rows)]
        assert (got == np.array(want)).all(), (rows, step)
        for wg in range(rows // 64):  # A: warpgroup wg's panel
            got = WL.reads(WL.descriptor(start + wg * WL.BK * WL.ROW_BYTES, lbo, sbo), 64, True)
            want = [[TILE + WL.mnmajor_offset(64 * wg + m, 16 * step + k) for k in range(16)] for m in range(64)]
            assert (got == np.array(want)).all(), (rows, step, wg)


def test_the_swizzle_spreads_a_chunk_column_over_the_banks():
    """What the 128-byte swizzle is for: the 8 rows of one 16-byte chunk column of an atom, as
    both layouts write them, fall in 8 different 16-byte bank groups."""
    for c in range(8):
        assert len({WL.kmajor_offset(r, 8 * c) % 128 // 16 for r in range(8)}) == 8
        assert len({WL.mnmajor_offset(8 * c, k) % 128 // 16 for k in range(8)}) == 8


def test_descriptor_fields():
    d = WL.descriptor(0x4410, 8192, 1024)
    assert d & 0x3FFF == 0x441 and (d >> 16) & 0x3FFF == 512 and (d >> 32) & 0x3FFF == 64 and d >> 62 == 1
    with pytest.raises(KernelError, match="128-byte swizzle"):
        WL.reads(WL.descriptor(0, 16, 1024, mode=0), 64, False)


@pytest.mark.parametrize("n", [8, 128, 256])
def test_accumulators_have_one_owner_each(n):
    own = WL.accumulator_owner(n)
    cells = {tuple(x) for x in own.reshape(-1, 2)}
    assert cells == {(r, c) for r in range(64) for c in range(n)}
    for t in range(128):  # warp w owns rows 16w .. 16w + 15 (its m16 block, as in mma.sync)
        assert set(own[t, :, 0]) <= set(range(16 * (t // 32), 16 * (t // 32) + 16))


def test_tiles_are_checked():
    GW.WgmmaTiles().check()
    GW.WgmmaTiles(128, 256, 4, ahead=1).check()
    assert GW.WgmmaTiles(128, 128, 3, blocks=2).max_registers == 128 and GW.WgmmaTiles().max_registers == 255
    assert GW.WgmmaTiles(stages=4, ahead=1).prefetch == 2 and GW.WgmmaTiles(stages=4).prefetch == 3
    for bad, why in ((GW.WgmmaTiles(bm=96), "bm"), (GW.WgmmaTiles(bn=100), "bn"), (GW.WgmmaTiles(stages=1), "stages"),
                     (GW.WgmmaTiles(stages=2, ahead=1), "stages"), (GW.WgmmaTiles(ahead=2), "ahead"),
                     (GW.WgmmaTiles(stages=4, blocks=2), "do not fit"),
                     (GW.WgmmaTiles(bm=256, bn=256, stages=4), "shared memory")):
        with pytest.raises(KernelError, match=why):
            bad.check()


def test_the_launchers_keep_mma_sync_by_default_on_the_simulator():
    from numba import cuda

    x, w = cuda.to_device(np.zeros((4, 8), np.uint16)), cuda.to_device(np.zeros((3, 8), np.uint16))
    assert not GW.usable(None, True) and GW.usable(GW.GPU_WGMMA, True) and not GW.usable(GW.GPU_WGMMA, False)
    y = cuda.device_array((4, 3), np.float32)
    GB.gemm_bf16(x, w, y)
    assert not y.copy_to_host().any()


@pytest.mark.parametrize("tiles", [GW.WgmmaTiles(64, 64, 3), GW.WgmmaTiles(64, 64, 4, ahead=1)],
                         ids=lambda t: t.label())
def test_the_generated_kernel_on_the_simulator(tiles):
    """The whole generated kernel through the intrinsics' twins (each MMA reads the block's shared
    array by the descriptor model): every layout, m and n past one tile and ragged, k over three
    slices and ragged, bf16 and fp32 outputs, and split k."""
    from numba import cuda

    from mma_cases import layout_cases

    m, n, k = 70, 80, 136  # two row tiles (one partial), two column tiles (one partial), slices of 64, 64 and 8
    x, w, dy, cases = layout_cases(np.random.default_rng(7), m, n, k)
    for layout, fn, a, b, shape in cases:
        want = GB.reference(layout, a, b)
        out = cuda.device_array(shape, np.float32)
        fn(cuda.to_device(a), cuda.to_device(b), out, tiles=tiles)
        assert np.max(np.abs(out.copy_to_host() - want)) <= 1e-5 * np.max(np.abs(want)), layout
    out16 = cuda.device_array((m, n), np.uint16)
    GB.gemm_bf16(cuda.to_device(x), cuda.to_device(w), out16, tiles=tiles)
    from vmstoolkit.kernels import mma_layout

    want = GB.reference("nn", x, w)
    assert np.max(np.abs(mma_layout.bf16_value(out16.copy_to_host()) - want)) <= 2 ** -8 * np.max(np.abs(want))
    out = cuda.device_array((m, n), np.float32)
    GB.gemm_bf16(cuda.to_device(x), cuda.to_device(w), out, tiles=tiles, splits=2)
    assert np.max(np.abs(out.copy_to_host() - want)) <= 1e-5 * np.max(np.abs(want))


_PTX_BODY = r"""
from vmstoolkit.kernels import gemm_wgmma as GW
A2, F2 = types.Array(types.int16, 2, "A"), types.Array(types.float32, 2, "A")
for layout, bn, ahead in (("nn", 128, 0), ("nt", 256, 1), ("tt", 128, 1)):
    fn = GW.python_kernel(GW.WgmmaTiles(bn=bn, ahead=ahead), layout)
    ptx, _ = cuda.compile_ptx(fn, (A2, A2, F2, F2, types.int64), cc=(9, 0, "a"))
    print("PTX", layout, bn, ".target sm_90a" in ptx, ptx.count(f"wgmma.mma_async.sync.aligned.m64n{bn}k16.f32.bf16.bf16"),
          ptx.count("fence.proxy.async.shared::cta"), ptx.count(f"wgmma.wait_group.sync.aligned {ahead}"))
"""


def test_kernel_compiles_to_sm90a_ptx():
    """The real kernel through Numba's typing and NVVM for sm_90a (numba-cuda builds a 9.0 device's
    kernels for compute_90a): 4 MMAs a slice, the proxy fence and the waits. Needs a CUDA
    toolkit's NVVM and NVRTC (no GPU); skipped where there is none."""
    import ptx_probe

    out = ptx_probe.run(_PTX_BODY)
    lines = [x.split() for x in out.splitlines() if x.startswith("PTX")]
    # wait 0 once in the loop and once after it (ahead 0); wait 1 in the loop (ahead 1)
    assert [x[1:] for x in lines] == [["nn", "128", "True", "4", "1", "2"], ["nt", "256", "True", "4", "1", "1"],
                                      ["tt", "128", "True", "4", "1", "1"]], out


# (output rows, output columns, what the H100 sweep found best of the two) for the 7B block's 15
# GEMMs: forward y (tokens x out features), dx (tokens x in), dw (out x in), 2048 tokens
SHAPES_7B = [(4096, 4096, "wide"), (2048, 4096, "wide"), (2048, 1024, "narrow"), (2048, 11008, "wide"),
             (2048, 4096, "wide"), (4096, 4096, "wide"), (4096, 4096, "wide"), (2048, 4096, "wide"),
             (4096, 4096, "wide"), (2048, 4096, "wide"), (1024, 4096, "wide"), (2048, 4096, "wide"),
             (11008, 4096, "wide"), (2048, 11008, "wide"), (4096, 11008, "wide")]


def test_the_default_wgmma_tiles_follow_the_sweep():
    """Note [wgmma tiles by shape]: wide tiles where their blocks fill a wave of 132 SMs (dw of
    k/v: 128 blocks, 90% of one), narrow ones where they would leave half the SMs idle."""
    got = ["wide" if GW.choose_tiles(m, n, 132) is GW.WIDE else "narrow" for m, n, _ in SHAPES_7B]
    assert got == [want for _, _, want in SHAPES_7B]
    assert GW.choose_tiles(64, 256, 132) is GW.NARROW and GW.choose_tiles(8192, 8192, 132) is GW.WIDE
    GW.WIDE.check()
    GW.NARROW.check()

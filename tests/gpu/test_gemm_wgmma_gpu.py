"""On an sm_90 GPU only: the wgmma bf16 GEMM (``gemm_wgmma``, through the ``gemm_bf16`` launchers
with wgmma tiles) against torch in every layout, at ragged and aligned sizes, every tile shape the
sweep times, bf16 and float32 outputs, split k, an accumulator, pitched views whose rows end
mid-chunk, and outputs that are views (their neighbours untouched).

    VMSTOOLKIT_REAL_GPU=1 python -m pytest tests/gpu/test_gemm_wgmma_gpu.py -q
"""

import os

import pytest

torch = pytest.importorskip("torch")

from torch_bf16 import bf, err, nb, run_layouts  # noqa: E402 - after the importorskip

pytestmark = pytest.mark.skipif(
    os.environ.get("VMSTOOLKIT_REAL_GPU") != "1" or not torch.cuda.is_available()
    or torch.cuda.get_device_capability() != (9, 0),
    reason="needs an sm_90 GPU, torch and VMSTOOLKIT_REAL_GPU=1")

F32_RTOL = 2e-5  # fp32 accumulation in another order than cuBLAS's
BF16_RTOL = 1.6e-2  # a bf16 rounding of each output, ours and torch's


@pytest.fixture(autouse=True)
def _fp32():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)


def _tiles():
    from vmstoolkit.kernels import gemm_wgmma as GW

    return [GW.WgmmaTiles(128, 128, 4), GW.WgmmaTiles(128, 256, 4, ahead=1), GW.WgmmaTiles(128, 128, 3, blocks=2),
            GW.WgmmaTiles(128, 128, 5, ahead=1), GW.WgmmaTiles(64, 128, 4), GW.WgmmaTiles(128, 256, 4)]


@pytest.mark.parametrize("m, n, k", [(64, 128, 64), (1000, 520, 1032), (1000, 520, 1032 + 64 * 7), (8, 8, 8)])
def test_every_layout_and_tile_float32_out(m, n, k):
    """One slice, several slices, partial tiles in m and n (1000 = 7 x 128 + 104), and a problem
    smaller than a tile."""
    x, w, dy = bf(m, k), bf(n, k), bf(m, n)
    for tiles in _tiles():
        ours, want = run_layouts(x, w, dy, tiles=tiles)
        errs = {name: err(a, b) for name, a, b in zip(("y", "dx", "dw"), ours, want)}
        assert max(errs.values()) <= F32_RTOL, (tiles.label(), errs)


def test_bf16_out_split_k_and_acc():
    from numba import cuda

    from vmstoolkit.kernels import gemm_bf16 as GB
    from vmstoolkit.kernels import gemm_wgmma as GW

    m, n, k = 1000, 520, 1032
    x, w, dy = bf(m, k), bf(n, k), bf(m, n)
    for tiles in _tiles()[:2]:
        ours, want = run_layouts(x, w, dy, torch.bfloat16, tiles=tiles)
        for name, a, b in zip(("y", "dx", "dw"), ours, want):
            assert not a.isnan().any(), (tiles.label(), name)
            assert err(a, b) <= BF16_RTOL, (tiles.label(), name, err(a, b))
    m, n, k = 264, 264, 4096  # dx and dw sum over 264: five 64-deep slices, room for 4 splits
    x, w, dy = bf(m, k), bf(n, k), bf(m, n)
    for splits in (2, 4):
        ours, want = run_layouts(x, w, dy, splits=splits, tiles=GW.GPU_WGMMA)
        for name, a, b in zip(("y", "dx", "dw"), ours, want):
            assert err(a, b) <= F32_RTOL, (splits, name, err(a, b))
    acc = torch.randn(m, n, device="cuda")
    y = torch.empty(m, n, device="cuda")
    for splits in (1, 2):
        GB.gemm_bf16(nb(x), nb(w), nb(y), acc=nb(acc), splits=splits, tiles=GW.GPU_WGMMA)
        cuda.synchronize()
        assert err(y, acc + x.float() @ w.float().T) <= F32_RTOL, splits


def test_views_pitches_and_unaligned_operands():
    """Operands that are views with aligned rows (offset 8, every other row), rows that end mid-chunk
    (k = 1027 in a 1040-wide array: the last chunk stops at the row's end), an output that is a
    view; an unaligned operand (offset 3) asked for wgmma tiles is refused with the reason."""
    from numba import cuda

    from vmstoolkit.errors import KernelError
    from vmstoolkit.kernels import gemm_bf16 as GB
    from vmstoolkit.kernels import gemm_wgmma as GW

    m, n, k = 300, 200, 520
    big_x, big_w = bf(2 * m, k + 16), bf(n, k + 16)
    x, w = big_x[::2, 8:8 + k], big_w[:, 8:8 + k]
    wide = torch.full((m, n + 24), 7.0, device="cuda")
    GB.gemm_bf16(nb(x), nb(w), nb(wide[:, 8:8 + n]), tiles=GW.GPU_WGMMA)
    cuda.synchronize()
    assert err(wide[:, 8:8 + n], x.float() @ w.float().T) <= F32_RTOL
    assert (wide[:, :8] == 7).all() and (wide[:, 8 + n:] == 7).all()
    # rows of 1027 and 517 elements with a pitch of 1040: aligned, ending mid-chunk
    xr, wr, dyr = bf(1000, 1040)[:, :1027], bf(517, 1040)[:, :1027], bf(1000, 1040)[:, :517]
    ours, want = run_layouts(xr, wr, dyr, tiles=GW.GPU_WGMMA)
    for name, a, b in zip(("y", "dx", "dw"), ours, want):
        assert err(a, b) <= F32_RTOL, (name, err(a, b))
    with pytest.raises(KernelError, match="aligned"):
        GB.gemm_bf16(nb(big_x[:, 3:3 + k]), nb(w), nb(torch.empty(2 * m, n, device="cuda")), tiles=GW.GPU_WGMMA)


def test_default_takes_wgmma_on_sm90(monkeypatch):
    """The launchers' default on an sm_90 device is the wgmma kernel (and its results are right);
    with ``VMSTOOLKIT_WGMMA=0``, mma.sync."""
    from vmstoolkit.kernels import gemm_wgmma as GW

    x, w = bf(256, 512), bf(384, 512)
    monkeypatch.delenv("VMSTOOLKIT_WGMMA", raising=False)
    assert GW.usable(None, True) and not GW.usable(None, False)
    ours, want = run_layouts(x, w, bf(256, 384))
    assert max(err(a, b) for a, b in zip(ours, want)) <= F32_RTOL
    x, w = bf(2048, 256), bf(2048, 256)  # 128 blocks of 128 x 256: the wide tiles by default
    assert GW.choose_tiles(2048, 2048, 132) is GW.WIDE
    ours, want = run_layouts(x, w, bf(2048, 2048))
    assert max(err(a, b) for a, b in zip(ours, want)) <= F32_RTOL
    monkeypatch.setenv("VMSTOOLKIT_WGMMA", "0")
    assert not GW.usable(None, True)

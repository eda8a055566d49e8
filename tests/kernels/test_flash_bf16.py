"""The bf16 flash-attention forward (``kernels/flash_bf16.py``) under the simulator: the generated
kernel runs the intrinsics' twins (one warp, 16-key tiles), so these check its index math, the
cp.async / element-wise fetches, the causal masking on diagonal tiles, GQA, ragged T and the lse
against ``bf16.reference_attention`` and the lane model (``flash_model``). The PTX route itself
is checked by ``cuda.compile_ptx`` where a CUDA toolkit's NVVM is found (skipped otherwise), and on
the GPU by ``tests/gpu/test_flash_bf16_gpu.py``.

Cost: the twins cost O(warp) Python per mma (a block barrier each); about 30 s of CPU for the file,
most of it the backward's two cases and the two-warp masking case (the smallest shapes that
cross a tile boundary with two warps and a GQA group)."""

import math

import numpy as np
import pytest

from vmstoolkit.errors import KernelError
from vmstoolkit.kernels import bf16 as B
from vmstoolkit.kernels import flash_bf16 as FB
from vmstoolkit.kernels import flash_model as FM
from vmstoolkit.kernels import reference


def _inputs(rng, b, t, nh, nkv, d):
    q = B.to_bits(rng.standard_normal((b, t, nh, d)))
    k = B.to_bits(rng.standard_normal((b, t, nkv, d)))
    v = B.to_bits(rng.standard_normal((b, t, nkv, d)))
    return q, k, v


def _run(q, k, v, with_lse=True, **kw):
    from numba import cuda

    b, t, nh, d = q.shape
    o = cuda.to_device(np.full(q.shape, 0x7FC0, np.uint16))  # NaN bits: every output must be written
    lse = cuda.to_device(np.full((b, nh, t), np.nan, np.float32)) if with_lse else None
    FB.flash_attention_bf16(cuda.to_device(q), cuda.to_device(k), cuda.to_device(v), o, lse, **kw)
    return o.copy_to_host(), (lse.copy_to_host() if with_lse else None)


def _check_out(got_bits, q, k, v):
    """Bit-equal to the lane model (the twins compute what it computes, in its order), and within
    one bf16 ulp of the scale of the exact reference (P rounded to bf16 as the mma takes it: the
    flash kernel rounds P against the running max, not the row's final one, so a few percent of
    the outputs of rows that walk several tiles differ by an ulp)."""
    got = B.values(got_bits)
    assert not np.isnan(got).any()
    assert np.array_equal(got, FM.forward(q, k, v))
    want = B.reference_attention(B.values(q), B.values(k), B.values(v), round_p=True)
    rel = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
    assert rel <= 2 * B.UNIT_ROUNDOFF, rel
    return got


@pytest.mark.parametrize("b, t, nh, nkv, d", [(1, 37, 2, 1, 16), (1, 18, 4, 2, 16), (2, 9, 1, 1, 32), (1, 20, 1, 1, 64), (1, 5, 1, 1, 128)])
def test_forward_equals_the_reference_and_lse(rng, b, t, nh, nkv, d):
    q, k, v = _inputs(rng, b, t, nh, nkv, d)
    o, lse = _run(q, k, v)
    got = _check_out(o, q, k, v)
    _, want_lse = reference.attention_lse(*(B.values(x).astype(np.float64) for x in (q, k, v)))
    assert np.max(np.abs(lse - want_lse)) <= 1e-5 * max(1.0, np.max(np.abs(want_lse)))
    assert np.allclose(lse, FM.forward(q, k, v, with_lse=True)[1], rtol=1e-6, atol=1e-6)
    # and the test sees a wrong key/value head (GQA)
    if nkv > 1:
        bad, _ = _run(q, np.ascontiguousarray(k[:, :, ::-1]), np.ascontiguousarray(v[:, :, ::-1]), with_lse=False)
        assert np.mean(B.values(bad) != got) > 0.2


def test_mask_only_on_diagonal_tiles_sees_every_tile(rng):
    """Two warps, 16-key tiles: the second block (rows 32-44) walks two tiles wholly below its
    first row unmasked and one that crosses it; in the first, warp 0 (rows 0-15) walks a tile
    that is wholly masked for it. Every query sees exactly its causal prefix (a future key with
    a huge value would show in the output)."""
    b, t, nh, nkv, d = 1, 45, 1, 1, 32
    q, k, v = _inputs(rng, b, t, nh, nkv, d)
    tiles = FB.FlashBf16Tiles(warps=2, bkv=16)
    o, _ = _run(q, k, v, tiles=tiles)
    _check_out(o, q, k, v)
    v2 = v.copy()
    v2[0, -1] = B.to_bits(np.full(d, 1000.0))  # the last key: only the last row may see it
    o2, _ = _run(q, k, v2, tiles=tiles)
    assert np.array_equal(o2[0, :-1], o[0, :-1])
    assert not np.array_equal(o2[0, -1], o[0, -1])


def test_elementwise_fetch_of_views(rng):
    """q a view with a head stride that is not a multiple of 8 elements (no cp.async), k, v views
    into a wider array; the element-wise fetch gives the same bits as the cp.async one."""
    b, t, nh, nkv, d = 1, 11, 2, 2, 16
    q, k, v = _inputs(rng, b, t, nh, nkv, d)
    o_async, _ = _run(q, k, v)
    o_elem, _ = _run(q, k, v, cp_async=False)
    assert np.array_equal(o_async, o_elem)
    from numba import cuda

    wide = np.zeros((b, t, nh, d + 3), np.uint16)
    wide[..., 3:] = q
    dq = cuda.to_device(wide)[..., 3:]  # base not 16-byte aligned
    o = cuda.to_device(np.zeros(q.shape, np.uint16))
    FB.flash_attention_bf16(dq, cuda.to_device(k), cuda.to_device(v), o)
    assert np.array_equal(o.copy_to_host(), o_async)
    with pytest.raises(KernelError, match="cp_async=True"):
        FB.flash_attention_bf16(dq, cuda.to_device(k), cuda.to_device(v), o, cp_async=True)


def test_rejects_bad_input():
    from numba import cuda

    z = lambda *s: cuda.to_device(np.zeros(s, np.uint16))  # noqa: E731
    with pytest.raises(KernelError, match="n_kv_heads"):
        FB.flash_attention_bf16(z(1, 4, 3, 16), z(1, 4, 2, 16), z(1, 4, 2, 16), z(1, 4, 3, 16))
    with pytest.raises(KernelError, match="head_dim"):
        FB.flash_attention_bf16(z(1, 4, 2, 24), z(1, 4, 1, 24), z(1, 4, 1, 24), z(1, 4, 2, 24))
    with pytest.raises(KernelError, match="bf16 bits"):
        FB.flash_attention_bf16(cuda.to_device(np.zeros((1, 4, 2, 16), np.float32)), z(1, 4, 1, 16),
                                z(1, 4, 1, 16), z(1, 4, 2, 16))
    with pytest.raises(KernelError, match="lse"):
        FB.flash_attention_bf16(z(1, 4, 2, 16), z(1, 4, 1, 16), z(1, 4, 1, 16), z(1, 4, 2, 16),
                                lse=cuda.to_device(np.zeros((1, 4, 2), np.float32)))
    with pytest.raises(KernelError, match="output"):
        FB.flash_attention_bf16(z(1, 4, 2, 16), z(1, 4, 1, 16), z(1, 4, 1, 16), z(1, 5, 2, 16))
    with pytest.raises(KernelError, match="shared memory"):
        FB.FlashBf16Tiles(warps=8, bkv=256).check(128)


def test_swizzle_stays_inside_the_row():
    for d in (16, 32, 48, 64, 80, 128, 256):
        cpr = d // 8
        m = FB.swizzle_mask(d)
        for r in range(16):
            assert sorted(c ^ (r & m) for c in range(cpr)) == list(range(cpr)), d
    assert FB.swizzle_mask(128) == 7 and FB.swizzle_mask(64) == 7
    assert math.isclose(FB.LOG2E * FB.LN2, 1.0)


_PTX_PROBE = r"""from vmstoolkit.kernels import flash_bf16 as FB
u4, f3 = types.Array(types.uint16, 4, "A"), types.Array(types.float32, 3, "A")
for d in (64, 128):
    ptx, _ = cuda.compile_ptx(FB.python_kernel(d, FB.GPU_TILES), (u4, u4, u4, u4, f3, types.float32, types.int64),
                              cc=(9, 0))
    need = ("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32", "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16",
            "cp.async.cg.shared.global", "cp.async.wait_group 1", "ex2.approx.ftz.f32", "shfl.sync.bfly",
            "cvt.rn.bf16x2.f32", ".shared .align 16")
    missing = [n for n in need if n not in ptx]
    print("PTX", d, ptx.count("mma.sync"), "mma", "missing:", missing)
sc = (types.float32, types.float32, types.int64)
k_dq, k_dkv = FB.python_backward_kernels(128, FB.GPU_TILES)
for name, fn, sig in (("dq", k_dq, (u4,) * 4 + (f3, f3, u4) + sc), ("dkv", k_dkv, (u4,) * 4 + (f3, f3, u4, u4) + sc)):
    ptx, _ = cuda.compile_ptx(fn, sig, cc=(9, 0))
    print("BWD", name, "mma.sync.aligned.m16n8k16" in ptx and "ldmatrix.sync.aligned.m8n8.x4.trans" in ptx)
f4 = types.Array(types.float32, 4, "C")
fused = FB._build(FB._dkvq_source(128, FB.GPU_TILES, True, True), "<fused>")
ptx, _ = cuda.compile_ptx(fused, (u4,) * 4 + (f3, f3, u4, u4, f4, f4, f4) + sc, cc=(9, 0))
print("BWD fused", "red.global.add.v2.f32" in ptx and "mma.sync.aligned.m16n8k16" in ptx)
"""


def test_kernel_compiles_to_ptx_for_sm90():
    """The real (not simulated) forward at D 64 and 128 and backward at D 128 (both kernels, and the fused
    one with a block per query head) through Numba's typing and NVVM for sm_90:
    catches typing errors before a GPU run. Needs a CUDA toolkit's NVVM and NVRTC (no GPU);
    skipped without them. ~30 s of CPU where it runs."""
    import ptx_probe

    stdout = ptx_probe.run(_PTX_PROBE)
    assert [x for x in stdout.splitlines() if x.startswith("BWD")] == ["BWD dq True", "BWD dkv True", "BWD fused True"], stdout
    lines = [x for x in stdout.splitlines() if x.startswith("PTX")]
    assert len(lines) == 2, stdout
    for line in lines:
        assert line.endswith("missing: []"), line
    # S and P V per 64-key tile: D/16 * 8 + D/16 * 8 mma (D/2 + D/2 per 16-row warp, unrolled)
    assert lines[0].split()[2] == str(64 // 16 * 8 * 2) and lines[1].split()[2] == str(128 // 16 * 8 * 2), lines


def _check_gradients(q, k, v, do, o, lse, grads):
    """dq, dk, dv (device bf16 bits) against ``reference.attention_backward`` in float64 on the same
    bf16 values and the forward's o and lse: every element written, within 2 bf16 ulps of the scale."""
    f64 = lambda x: B.values(x).astype(np.float64)  # noqa: E731
    want = reference.attention_backward(f64(q), f64(k), f64(v), f64(o.copy_to_host()),
                                        lse.copy_to_host().astype(np.float64), f64(do))
    for name, g, w in zip(("dq", "dk", "dv"), grads, want):
        got = B.values(g.copy_to_host())
        assert not np.isnan(got).any(), name
        rel = float(np.max(np.abs(got - w)) / np.max(np.abs(w)))
        assert rel <= 2 * B.UNIT_ROUNDOFF, (name, rel)


@pytest.mark.parametrize("t, nh, nkv, d, warps, dkv_warps", [(21, 2, 1, 16, 1, 1), (24, 2, 1, 32, 2, 2), (37, 2, 1, 32, 1, 2)])
def test_backward_equals_the_reference(rng, t, nh, nkv, d, warps, dkv_warps):
    """dq, dk, dv (the dq kernel and the dk/dv kernel, GQA groups summed in registers) against
    ``reference.attention_backward`` in float64 on the same bf16 values, the forward's o and lse:
    within 2 bf16 ulps of the scale (P and dS are rounded to bf16 for the mma, each gradient once).
    Two warps: the dk/dv kernel's 32 keys walk query tiles of 16 that cross them; the last case gives
    the dk/dv kernel tiles of its own (``dkv_tiles``)."""
    from numba import cuda

    tiles = FB.FlashBf16Tiles(warps=warps, bkv=16)
    q, k, v = _inputs(rng, 1, t, nh, nkv, d)
    do = B.to_bits(rng.standard_normal(q.shape))
    dev = [cuda.to_device(x) for x in (q, k, v, do)]
    o = cuda.to_device(np.zeros(q.shape, np.uint16))
    lse = cuda.to_device(np.zeros((1, nh, t), np.float32))
    FB.flash_attention_bf16(dev[0], dev[1], dev[2], o, lse, tiles=tiles)
    grads = [cuda.to_device(np.full(x.shape, 0x7FC0, np.uint16)) for x in (q, k, v)]  # NaN: all must be written
    FB.flash_attention_bf16_backward(dev[0], dev[1], dev[2], o, lse, dev[3], *grads, tiles=tiles,
                                     dkv_tiles=FB.FlashBf16Tiles(warps=dkv_warps, bkv=16))
    _check_gradients(q, k, v, do, o, lse, grads)


@pytest.mark.parametrize("t, nh, nkv, d, warps, bkv, split", [(21, 2, 1, 16, 1, 16, False), (37, 4, 2, 32, 2, 16, False),
                                                              (29, 2, 1, 32, 1, 32, False), (37, 4, 2, 32, 2, 16, True),
                                                              (21, 2, 1, 16, 1, 16, True)])
def test_fused_backward_equals_the_reference(rng, t, nh, nkv, d, warps, bkv, split):
    """The fused backward (dK, dV and dQ in one kernel, dQ's partials added atomically in fp32):
    the same bound against the float64 reference. The cases: one warp per 16-query tile; two warps
    sharing one row group's dQ columns (GQA groups of 2); one warp taking two row groups; and a
    block per query head (``split_heads``, dK and dV added atomically too, into views)."""
    from numba import cuda

    tiles = FB.FlashBf16Tiles(warps=warps, bkv=bkv)
    q, k, v = _inputs(rng, 1, t, nh, nkv, d)
    do = B.to_bits(rng.standard_normal(q.shape))
    dev = [cuda.to_device(x) for x in (q, k, v, do)]
    o = cuda.to_device(np.zeros(q.shape, np.uint16))
    lse = cuda.to_device(np.zeros((1, nh, t), np.float32))
    FB.flash_attention_bf16(dev[0], dev[1], dev[2], o, lse, tiles=FB.SIM_TILES)
    # split: the gradients are views of wider arrays (the conversions' 4-D path)
    wide = [cuda.to_device(np.full((*x.shape[:-1], d + 16 * split), 0x7FC0, np.uint16)) for x in (q, k, v)]
    grads = [w[..., :d] for w in wide]
    acc = cuda.to_device(np.full(q.shape, np.nan, np.float32))  # must be zeroed by the launch itself
    FB.flash_attention_bf16_backward(dev[0], dev[1], dev[2], o, lse, dev[3], *grads, dkv_tiles=tiles, fused=True,
                                     dq_accum=acc, split_heads=split)
    _check_gradients(q, k, v, do, o, lse, grads)


def test_fused_backward_refuses_tiles_that_cannot_share_dq():
    from numba import cuda

    z = lambda *s: cuda.to_device(np.zeros(s, np.uint16))  # noqa: E731
    q, k = z(1, 8, 2, 32), z(1, 8, 1, 32)
    lse = cuda.to_device(np.zeros((1, 2, 8), np.float32))
    with pytest.raises(KernelError, match="fused backward needs the warps"):  # 2 warps, 3 row groups of 16 queries
        FB.flash_attention_bf16_backward(q, k, k, q, lse, q, q, k, k, fused=True,
                                         dkv_tiles=FB.FlashBf16Tiles(warps=2, bkv=48))
    with pytest.raises(KernelError, match="split_heads=True needs fused=True"):
        FB.flash_attention_bf16_backward(q, k, k, q, lse, q, q, k, k, split_heads=True)
    with pytest.raises(KernelError, match="dq_accum has shape"):
        FB.flash_attention_bf16_backward(q, k, k, q, lse, q, q, k, k, fused=True, dkv_tiles=FB.SIM_TILES,
                                         dq_accum=cuda.to_device(np.zeros((1, 8, 2, 16), np.float32)))


def test_backward_rejects_bad_input():
    from numba import cuda

    z = lambda *s: cuda.to_device(np.zeros(s, np.uint16))  # noqa: E731
    lse = cuda.to_device(np.zeros((1, 2, 4), np.float32))
    q, k = z(1, 4, 2, 16), z(1, 4, 1, 16)
    with pytest.raises(KernelError, match="lse"):
        FB.flash_attention_bf16_backward(q, k, k, q, None, q, q, k, k)
    with pytest.raises(KernelError, match="dk has shape"):
        FB.flash_attention_bf16_backward(q, k, k, q, lse, q, q, q, k)
    with pytest.raises(KernelError, match="dsum"):
        FB.flash_attention_bf16_backward(q, k, k, q, lse, q, q, k, k, dsum=cuda.to_device(np.zeros((1, 2, 5), np.float32)))


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("tiles", ["4/64", "8/64", "4/32"])
def test_backward_static_shared_memory_fits_and_matches_the_launch(d, tiles):
    """Each backward kernel's static shared arrays fit the 48 KiB a kernel may declare statically,
    and a kernel whose arrays are dynamic is launched with dynamic bytes (the count the launcher
    uses says so): the dK/dV kernel's statistics once took the D 64 kernel to 50,176 static bytes,
    which ptxas refuses (found offline by scripts/sass_report.py)."""
    import re

    t = FB.FlashBf16Tiles(*map(int, tiles.split("/")))
    size = {"uint16": 2, "float32": 4}
    kernels = [("dq", FB._dq_source(d, t, True), FB.backward_smem_bytes(d, t)[0]),
               ("dkv", FB._dkv_source(d, t, True), FB.backward_smem_bytes(d, t)[1])]
    kernels += [(f"fused split={sp}", FB._dkvq_source(d, t, True, sp), FB.fused_smem_bytes(d, t))
                for sp in (False, True)]
    for name, src, launch_bytes in kernels:
        arrays = [(int(n), ty) for n, ty in re.findall(r"cuda\.shared\.array\((\d+), (\w+)", src)]
        static = sum(n * size[ty] for n, ty in arrays)
        dynamic = any(n == 0 for n, _ in arrays)
        assert static <= FB.STATIC_SMEM, (name, static)
        assert dynamic == (launch_bytes > FB.STATIC_SMEM), (name, arrays, launch_bytes)
        if not dynamic:
            assert static == launch_bytes, (name, static, launch_bytes)

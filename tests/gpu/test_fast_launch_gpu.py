"""On a real GPU only: kernels launched through the fast path (``kernels/_launch.py``: one
``cuLaunchKernel`` with a parameter block packed as Numba packs it) give bit for bit what Numba's
own launches give, for every argument kind the runtime passes: float32 and bf16-bits arrays,
C-contiguous and strided views ("A" layout), float32 / float64 / int64 scalars, dynamic shared
memory (the bf16 GEMM and flash attention), split k (a zero fill and atomics), a stream other
than the default one. And the planned launches did run (their count grew).

    VMSTOOLKIT_REAL_GPU=1 python -m pytest tests/gpu/test_fast_launch_gpu.py -q
"""

import os

import pytest

torch = pytest.importorskip("torch")

from torch_bf16 import bf, nb  # noqa: E402 - after the importorskip

pytestmark = pytest.mark.skipif(
    os.environ.get("VMSTOOLKIT_REAL_GPU") != "1" or not torch.cuda.is_available(),
    reason="needs a CUDA GPU, torch and VMSTOOLKIT_REAL_GPU=1")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def both(fn):
    """``fn()`` (which returns the tensors it wrote) once to compile and plan, then with the plans
    off (Numba's launches) and on: the two results and the planned launches of the last run."""
    from numba import cuda

    from vmstoolkit.kernels import _launch as L

    fn()
    cuda.synchronize()
    prev = L.set_active(False)
    try:
        numba_out = [t.clone() for t in fn()]
        cuda.synchronize()
    finally:
        L.set_active(prev)
    n0 = L.fast_launch_count()
    fast_out = [t.clone() for t in fn()]
    cuda.synchronize()
    return numba_out, fast_out, L.fast_launch_count() - n0


def same(numba_out, fast_out, planned):
    assert planned > 0, "no launch went through a plan"
    for a, b in zip(numba_out, fast_out):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.dtype == torch.bfloat16 else \
            torch.equal(a, b)


def test_fp32_gemm_plain_split_k_and_a_strided_view():
    from vmstoolkit.kernels import gemm as G

    x, w = torch.randn(300, 520, device="cuda"), torch.randn(200, 520, device="cuda")
    wide = torch.randn(300, 530, device="cuda")
    view = wide[:, 3:3 + 520]  # an "A"-layout operand: row stride 530
    y1, y2, y3 = (torch.empty(300, 200, device="cuda") for _ in range(3))

    def run():  # splits=1: the launch rule splits k at this small output, and split k adds with atomics
        G.gemm(nb(x), nb(w), nb(y1), splits=1)
        G.gemm(nb(x), nb(w), nb(y2), splits=2)
        G.gemm(nb(view), nb(w), nb(y3), splits=1)
        return [y1, y2, y3]

    numba_out, fast_out, planned = both(run)
    # split k adds with atomics, in whichever order the blocks finish: equal to fp32 noise only
    same([numba_out[0], numba_out[2]], [fast_out[0], fast_out[2]], planned)
    torch.testing.assert_close(fast_out[1], numba_out[1], rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(fast_out[0], x @ w.T, rtol=1e-4, atol=1e-3)


def test_scalars_of_every_kind_on_another_stream():
    from numba import cuda

    from vmstoolkit.kernels import model_ops, rmsnorm, rope

    s = cuda.stream()
    x, w = torch.randn(64, 256, device="cuda"), torch.rand(256, device="cuda") + 0.5
    q = torch.randn(1, 37, 4, 64, device="cuda")
    logits = torch.randn(5, 1000, device="cuda")
    y, r = torch.empty_like(x), torch.empty_like(q)
    top = torch.empty(5, dtype=torch.int32, device="cuda")

    def run():
        rmsnorm.rmsnorm(nb(x), nb(w), nb(y), eps=1e-5, stream=s)  # float32 scalar
        rope.rope(nb(q), nb(r), theta=500000.0, offset=11, stream=s)  # float64 and int64 scalars
        model_ops.argmax(nb(logits), nb(top), stream=s)
        s.synchronize()
        return [y, r, top]

    same(*both(run))
    assert torch.equal(top.long(), logits.argmax(-1))


def test_bf16_gemm_and_flash_attention_with_dynamic_shared_memory():
    from vmstoolkit.kernels import flash_bf16 as FB, gemm_bf16 as GB

    x, w = bf(512, 1024), bf(384, 1024)
    y = torch.empty(512, 384, device="cuda")
    q, k, v = bf(1, 256, 8, 128), bf(1, 256, 2, 128), bf(1, 256, 2, 128)
    o = torch.empty_like(q)

    def run():
        GB.gemm_bf16(nb(x), nb(w), nb(y))
        FB.flash_attention_bf16(*(nb(t) for t in (q, k, v, o)))
        return [y, o]

    same(*both(run))
    torch.testing.assert_close(y, x.float() @ w.float().T, rtol=2e-3, atol=2e-2)

"""On a real GPU only: generated kernels (the bf16 GEMM, flash attention) compiled in one process
load from the CUDA kernel cache (``VMSTOOLKIT_CUDA_CACHE=1``) in the next, with the same results,
in a fraction of the time.

    VMSTOOLKIT_REAL_GPU=1 python -m pytest tests/gpu/test_cuda_cache_gpu.py -q
"""

import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.skipif(
    os.environ.get("VMSTOOLKIT_REAL_GPU") != "1" or not torch.cuda.is_available(),
    reason="needs a CUDA GPU, torch and VMSTOOLKIT_REAL_GPU=1")

_PROGRAM = r"""
import json, time
import torch
from numba import cuda
from vmstoolkit.kernels import flash_bf16 as FB, gemm_bf16 as GB
torch.manual_seed(0)
x, w = torch.randn(300, 512, device="cuda").bfloat16(), torch.randn(200, 512, device="cuda").bfloat16()
y = torch.empty(300, 200, device="cuda")
q, k, v = (torch.randn(1, 128, h, 64, device="cuda").bfloat16() for h in (4, 2, 2))
o = torch.empty_like(q)
t0 = time.perf_counter()
GB.gemm_bf16(cuda.as_cuda_array(x.view(torch.int16)), cuda.as_cuda_array(w.view(torch.int16)), cuda.as_cuda_array(y))
FB.flash_attention_bf16(*(cuda.as_cuda_array(t.view(torch.int16)) for t in (q, k, v, o)))
cuda.synchronize()
print(json.dumps({"s": time.perf_counter() - t0, "y": y.double().sum().item(), "o": o.double().sum().item()}))
"""


def test_a_second_process_loads_the_kernels(tmp_path):
    env = {**os.environ, "VMSTOOLKIT_CUDA_CACHE": "1", "VMSTOOLKIT_CACHE_DIR": str(tmp_path)}
    runs = []
    for _ in range(2):
        r = subprocess.run([sys.executable, "-c", _PROGRAM], capture_output=True, text=True, env=env, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        runs.append(json.loads(r.stdout.strip().splitlines()[-1]))
    first, second = runs
    assert (first["y"], first["o"]) == (second["y"], second["o"])
    cached = list(tmp_path.rglob("*.nbi"))
    assert cached, "no index file was written"
    assert second["s"] < first["s"] / 3, runs

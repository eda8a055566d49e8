"""Reproduce numba-cuda's crash at exit on two GPUs, and check the guard against it.

    python experiments/numba_multi_gpu_exit.py VARIANT      # on a machine with two GPUs

VARIANT names what the process does before exiting, words joined by ``_``:
``one``/``two`` (launch 16 kernels on GPU 0, or on GPUs 0 and 1), ``vmm`` (also open a vmstoolkit
``CudaDriver`` per GPU with peer access), ``close`` (``numba.cuda.close()``), ``flush`` (drop
the kernels and flush numba's pending deallocations), ``guard``
(:func:`vmstoolkit.exec.backends.numba_exit.guard_library_unload`). The exit status is the
result: 139 (segfault) or 134 (abort) without the guard on two GPUs, 0 with it
(``experiments/results/offload-h200/README.md``, run 6).
"""
import faulthandler
import sys

import numpy as np

faulthandler.enable()
v = sys.argv[1]
gpus = (0, 1) if "two" in v else (0,)
from numba import cuda  # noqa: E402

kernels = []
for i in range(16):  # distinct kernels: more pending unloads than numba's flush threshold (10)
    exec(f"@cuda.jit\ndef k{i}(x):\n    j = cuda.grid(1)\n    if j < x.size:\n        x[j] += {i}\n")
    kernels.append(eval(f"k{i}"))
if "vmm" in v:
    from vmstoolkit.pools.drivers import make_driver

    ds = [make_driver("cuda", device=g, peers=gpus) for g in gpus]
for g in gpus:
    with cuda.gpus[g]:
        x = cuda.to_device(np.zeros(256, np.float32))
        for k in kernels:
            k[1, 256](x)
        cuda.synchronize()
if "vmm" in v:
    for d in ds:
        d.close()
if "close" in v:
    cuda.close()
if "flush" in v:
    import gc

    del x, kernels
    for name in list(globals()):
        if name.startswith("k") and name[1:].isdigit():
            del globals()[name]
    gc.collect()
    for g in gpus:
        with cuda.gpus[g]:
            cuda.current_context().deallocations.clear()
if "guard" in v:
    from vmstoolkit.exec.backends.numba_exit import guard_library_unload

    guard_library_unload()
print("end of script", v, flush=True)

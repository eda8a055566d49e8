"""Where a kernel launch's host time goes, on a real GPU (issue 32: decode is host-bound).

Decode of a 7B-shaped checkpoint at its full budget ran 4,385 vertices in 1.65 s, about 0.3 ms
of host time a vertex, 88 ms a token where reading the weights takes about 3 ms
(``experiments/results/run-model-h200``); ``gemm_sweep.py``'s host column puts a GEMM launch at
70-120 us. This splits one launch into its layers, each timed over many launches queued on one
stream (the GPU is never waited for inside the timed loop), so that the cost can be cut where
it is:

- ``gemm_bf16``: the whole call the runtime makes (argument checks, launch rule, the launch);
- ``dispatch``: ``kernel[grid, block, stream](*args)`` with the kernel and launch already chosen;
- both through ``kernels/_launch.py``'s plans (one ``cuLaunchKernel``) and, as ``*_numba``,
  through Numba's dispatcher (``_launch.set_active(False)``);
- ``overload``: the compiled kernel's ``launch(args, ...)``, past the dispatcher's type lookup;
- ``typeof``: the dispatcher's typing of the arguments alone;
- ``view``: a ``DeviceNDArray`` over a raw pointer, as the runtime's backend makes per buffer
  (once per buffer and shape: it caches them); ``as_cuda_array``: numba's view of a torch tensor;
- ``event``: ``cuda.event()`` and its ``record`` (the backend records one per vertex);
- ``rmsnorm`` / ``swiglu``: two small kernels' whole calls.

At decode (M = 1) and prefill (M = 2048) shapes of a 7B block's q projection (N = K = 4096).
Then a cProfile of the ``gemm_bf16`` call, top 25 by cumulative time.

    python3 experiments/launch_cost_gpu.py --out DIR      # writes DIR/launch_cost.json
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time
from pathlib import Path


def per_call_us(fn, n: int) -> float:
    from numba import cuda

    fn()  # compile / warm
    cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    host = time.perf_counter() - t
    cuda.synchronize()
    return host / n * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--n", type=int, default=2000, help="launches per figure")
    args = ap.parse_args()
    import numpy as np
    import torch
    from numba import cuda
    from numba.cuda.cudadrv import driver
    from numba.cuda.cudadrv.devicearray import DeviceNDArray

    from vmstoolkit.kernels import _launch as L
    from vmstoolkit.kernels import gemm_bf16 as GB
    from vmstoolkit.kernels import rmsnorm as RN
    from vmstoolkit.kernels import swiglu as SW

    def nb(t):
        return cuda.as_cuda_array(t.view(torch.int16) if t.dtype == torch.bfloat16 else t)

    rows, stream = [], cuda.stream()
    for m in (1, 2048):
        n = k = 4096
        x = torch.randn(m, k, device="cuda").bfloat16()
        w = torch.randn(n, k, device="cuda").bfloat16()
        y = torch.empty(m, n, device="cuda")
        dx, dw, dy = nb(x), nb(w), nb(y)
        launch = GB.choose(m, n, k, None, False)
        t = launch.tiles
        kernel = GB.make_gemm_bf16(t, False, False, False, False, launch.splits > 1, True)
        slices = -(-k // t.bk)
        per = -(-slices // launch.splits)
        grid = (-(-n // t.bn), -(-m // t.bm), -(-slices // per))
        kargs = (dx, dw, dy, dy, per)
        argtypes = tuple(kernel.typeof_pyval(a) for a in kargs)
        kernel.compile(argtypes)
        overload = kernel.overloads[argtypes]
        ctx = cuda.current_context()
        ptr = dy.device_ctypes_pointer.value
        h = torch.randn(m, n, device="cuda")
        g = torch.randn(n, device="cuda")
        o = torch.empty(m, n, device="cuda")
        up = torch.randn(m, n, device="cuda")
        row = {"M": m, "N": n, "K": k, "tiles": t.label(), "splits": launch.splits, "n": args.n}
        row["gemm_bf16_us"] = per_call_us(lambda: GB.gemm_bf16(dx, dw, dy, stream=stream), args.n)
        row["dispatch_us"] = per_call_us(lambda: kernel[grid, t.threads, stream](*kargs), args.n)
        prev = L.set_active(False)  # the same two through Numba's dispatcher, as before kernels/_launch.py
        try:
            row["gemm_bf16_numba_us"] = per_call_us(lambda: GB.gemm_bf16(dx, dw, dy, stream=stream), args.n)
            row["dispatch_numba_us"] = per_call_us(lambda: kernel[grid, t.threads, stream](*kargs), args.n)
        finally:
            L.set_active(prev)
        row["overload_us"] = per_call_us(lambda: overload.launch(kargs, grid, (t.threads, 1, 1), stream, 0), args.n)
        row["typeof_us"] = per_call_us(lambda: tuple(kernel.typeof_pyval(a) for a in kargs), args.n)
        row["as_cuda_array_us"] = per_call_us(lambda: nb(h), args.n)
        row["view_us"] = per_call_us(lambda: DeviceNDArray((m, n), (4 * n, 4), np.dtype(np.float32),
                                                           gpu_data=driver.MemoryPointer(ctx, ptr, 4 * m * n)), args.n)
        row["event_us"] = per_call_us(lambda: cuda.event(timing=False).record(stream), args.n)
        nh, ng, no, nu = nb(h), nb(g), nb(o), nb(up)
        try:  # the small kernels' whole calls
            row["rmsnorm_us"] = per_call_us(lambda: RN.rmsnorm(nh, ng, no, stream=stream), args.n)
        except Exception as e:  # a failure is a figure missing, not the run's end
            row["rmsnorm_error"] = f"{type(e).__name__}: {e}"
        try:
            row["swiglu_us"] = per_call_us(lambda: SW.swiglu(nh, nu, no, stream=stream), args.n)
        except Exception as e:
            row["swiglu_error"] = f"{type(e).__name__}: {e}"
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(500):
            GB.gemm_bf16(dx, dw, dy, stream=stream)
        prof.disable()
        cuda.synchronize()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(25)
        row["profile"] = buf.getvalue()
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "profile"}), flush=True)
        print(row["profile"], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "launch_cost.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

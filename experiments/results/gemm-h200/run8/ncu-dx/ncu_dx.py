"""One launch each of our GEMM (the rule's launch: variant 11) and of cuBLAS fp32 at dx of k/v GQA8
(dx = dy w, dy 2048 x 1024, w 1024 x 4096: output 2048 x 4096, K = 1024) and at dx 4096^3: for ncu.
Also prints the host time per launch of each (no profiler: run it without ncu for that)."""
import sys, time, torch
from numba import cuda
torch.backends.cuda.matmul.allow_tf32 = False
from vmstoolkit.kernels import gemm as G
shapes = {"kv": (2048, 1024, 4096), "4096": (4096, 4096, 4096)}
probs = []
for name, (m, n, k) in shapes.items():
    dy = torch.randn(m, n, device="cuda"); w = torch.randn(n, k, device="cuda"); dx = torch.empty(m, k, device="cuda")
    d = [cuda.as_cuda_array(t) for t in (dy, w, dx)]
    probs.append((name, (lambda d=d: G.linear_dx(*d)), (lambda dy=dy, w=w, dx=dx: torch.matmul(dy, w, out=dx))))
for _, ours, cub in probs:  # warm-up and compile
    ours(); ours(); cub(); cub()
torch.cuda.synchronize()
if "--host" in sys.argv:
    for name, ours, cub in probs:
        for lab, fn in (("ours", ours), ("cuBLAS", cub)):
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(20):
                fn()
            h = (time.perf_counter() - t) / 20 * 1e6
            torch.cuda.synchronize()
            print(f"host {name} {lab}: {h:.1f} us per launch")
    sys.exit()
for name, ours, cub in probs:
    ours(); cub()
torch.cuda.synchronize()

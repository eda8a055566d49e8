"""A user's program under a vmstoolkit allocator, breaking the allocator contract where PyTorch's
own allocator holds: run by ``test_dropin.py`` in a fresh process per allocator (an allocator
is installed before PyTorch's first CUDA allocation). Prints one JSON object of findings.

    python tests/gpu/dropin_program.py NAME [KEY=VALUE ...]     # NAME "default": PyTorch's own
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

TRIALS = 5
N = 64 * 2**20 // 4  # 64 MiB of float32
SPIN = 200_000_000  # GPU cycles of torch.cuda._sleep: ~0.1 s, far longer than the host takes


def side_stream_reuse() -> int:
    """A tensor made and read on a side stream is freed on the host while the reads are queued;
    the default stream allocates the same size and writes at once. Wrong results out of TRIALS."""
    side = torch.cuda.Stream()
    wrong = 0
    for _ in range(TRIALS):
        with torch.cuda.stream(side):
            x = torch.ones(N, device="cuda")
            torch.cuda._sleep(SPIN)
            total = x.sum()
        del x  # freed while the side stream still has to read it
        y = torch.full((N,), 7.0, device="cuda")  # default stream, same size, written at once
        torch.cuda.synchronize()
        wrong += int(total.item() != N)
        del y, total
    return wrong


def record_stream_reuse() -> int:
    """A tensor made on the default stream, read on a side stream, ``record_stream(side)``, freed,
    and its size allocated again at once on the default stream and written."""
    side = torch.cuda.Stream()
    wrong = 0
    for _ in range(TRIALS):
        x = torch.ones(N, device="cuda")
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.cuda._sleep(SPIN)
            total = x.sum()
        x.record_stream(side)
        del x
        y = torch.full((N,), 7.0, device="cuda")
        torch.cuda.synchronize()
        wrong += int(total.item() != N)
        del y, total
    return wrong


def out_of_memory() -> dict:
    """400 GiB on a 141 GiB card raises torch.OutOfMemoryError, and work goes on afterwards."""
    r = {"raised": None, "message": "", "after": False}
    try:
        t = torch.empty(400 * 2**30, dtype=torch.uint8, device="cuda")
        t.fill_(1)
        torch.cuda.synchronize()
        r["raised"] = "nothing"
    except torch.OutOfMemoryError as e:
        r["raised"], r["message"] = "OutOfMemoryError", str(e)[:300]
    except Exception as e:  # noqa: BLE001 - the finding is the type
        r["raised"], r["message"] = type(e).__name__, str(e)[:300]
    a = torch.ones(2**28, device="cuda")
    r["after"] = bool(a.sum().item() == 2**28)
    return r


class _HugeGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2 + torch.empty(400 * 2**30, dtype=torch.uint8, device=g.device).sum()  # cannot fit


def oom_in_backward() -> str:
    x = torch.ones(1024, device="cuda", requires_grad=True)
    try:
        _HugeGrad.apply(x).sum().backward()
        return "nothing"
    except torch.OutOfMemoryError:
        return "OutOfMemoryError"
    except Exception as e:  # noqa: BLE001 - the type is the verdict; the message and stack say why
        traceback.print_exc()
        return f"{type(e).__name__}: {str(e)[:300]}"


def exception_through_temporaries() -> str:
    """A Python exception raised while a CUDA temporary sits on the evaluation stack (it is freed
    as the exception unwinds the frame) reaches the caller as itself."""

    def fail():
        raise KeyError("raised by the user's code")

    try:
        _ = torch.ones(1 << 20, device="cuda") * 2 + fail()
        return "nothing"
    except KeyError:
        return "KeyError"
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        return f"{type(e).__name__}: {str(e)[:300]}"


def statistics(handle) -> dict:
    """Every torch.cuda memory function works and equals the allocator's own figures."""
    out: dict = {}
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    keep = [torch.empty(s, dtype=torch.uint8, device="cuda") for s in (100, 3 << 20, 40 << 20)]
    out["memory_allocated"] = torch.cuda.memory_allocated()
    out["max_memory_allocated"] = torch.cuda.max_memory_allocated()
    out["memory_reserved"] = torch.cuda.memory_reserved()
    out["max_memory_reserved"] = torch.cuda.max_memory_reserved()
    out["summary_lines"] = len(torch.cuda.memory_summary().splitlines())
    if handle is not None:
        mine = handle.memory_stats()
        out["handle_allocated"] = mine["allocated_bytes.all.current"]
        out["handle_reserved"] = mine["reserved_bytes.all.current"]
        out["handle_max_allocated"] = mine["allocated_bytes.all.peak"]
    del keep
    out["after_free_allocated"] = torch.cuda.memory_allocated()
    before = torch.cuda.memory_reserved()
    torch.cuda.empty_cache()
    out["empty_cache_gave_back"] = before - torch.cuda.memory_reserved()
    return out


def cuda_graph() -> bool:
    """A captured MLP replays to what eager computes."""
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256)).cuda()
    x = torch.randn(64, 256, device="cuda")
    eager = mlp(x)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            mlp(x)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = mlp(x)
    g.replay()
    torch.cuda.synchronize()
    return bool(torch.allclose(y, eager))


def snapshot(handle) -> dict:
    if handle is None:
        return {}
    handle.record_history()
    a = torch.empty(5 << 20, device="cuda")
    b = torch.empty(700, device="cuda")
    del a, b
    handle.record_history(False)
    path = Path(tempfile.mkdtemp()) / "run.pickle.gz"
    handle.dump_snapshot(path)
    from vmstoolkit.trace.loader import load_trace

    t = load_trace(path)
    return {"events": len(t.alloc_free_events())}


def main() -> None:
    name = sys.argv[1]
    opts = {}
    for kv in sys.argv[2:]:
        k, v = kv.split("=", 1)
        opts[k] = {"True": True, "False": False}.get(v, int(v) if v.lstrip("-").isdigit() else v)
    handle = None
    t0 = time.perf_counter()
    if name != "default":
        import vmstoolkit.integrations.torch as vt

        handle = vt.install(name, **opts)
    result = {"allocator": name, "options": opts, "install_s": time.perf_counter() - t0,
              "shim": bool(getattr(handle, "raises", False)), "shim_reason": getattr(handle, "shim_reason", "")}
    for key, fn in (("side_stream_wrong", side_stream_reuse), ("record_stream_wrong", record_stream_reuse),
                    ("oom", out_of_memory), ("oom_in_backward", oom_in_backward), ("exception_through_temporaries", exception_through_temporaries),
                    ("cuda_graph", cuda_graph)):
        try:
            result[key] = fn()
        except Exception as e:  # noqa: BLE001 - reported, not hidden
            result[key] = f"error: {type(e).__name__}: {str(e)[:200]}"
    for key, fn in (("stats", statistics), ("snapshot", snapshot)):
        try:
            result[key] = fn(handle)
        except Exception as e:  # noqa: BLE001
            result[key] = f"error: {type(e).__name__}: {str(e)[:200]}"
    print(json.dumps(result))


if __name__ == "__main__":
    main()

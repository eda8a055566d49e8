"""A user's program meeting more of PyTorch under a vmstoolkit allocator (issue 34): one CASE per
process, run by ``test_surface.py``; prints one JSON object of findings on its last line.

    python tests/gpu/surface_program.py CASE NAME [KEY=VALUE ...]     # NAME "default": PyTorch's own

CASE: compile_inference, compile_training, graphs, snapshot, fraction, clients, mempool, exit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import traceback
from pathlib import Path

import torch

GiB = 1 << 30


def model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 1024),
                               torch.nn.LayerNorm(1024), torch.nn.Linear(1024, 256)).cuda()


def compile_inference(handle) -> dict:
    """reduce-overhead (CUDA graph trees) against eager; eager tensors made between replays intact."""
    m = model()
    fast = torch.compile(m, mode="reduce-overhead")
    out = {"equal": [], "eager_intact": True}
    with torch.no_grad():
        for i in range(6):
            x = torch.randn(64, 256, device="cuda", generator=torch.Generator("cuda").manual_seed(i))
            y = fast(x).clone()
            keep = torch.full((1 << 20,), float(i), device="cuda")  # allocated between replays
            out["equal"].append(bool(torch.allclose(y, m(x), atol=1e-3, rtol=1e-3)))
            z = fast(x + 1).clone()
            out["eager_intact"] &= bool((keep == i).all())
            out["equal"].append(bool(torch.allclose(z, m(x + 1), atol=1e-3, rtol=1e-3)))
    out["ok"] = all(out["equal"]) and out["eager_intact"]
    return out


def compile_training(handle) -> dict:
    """A training step compiled with reduce-overhead ends where eager ends (same init, data, SGD)."""
    def run(compiled):
        m = model(1)
        opt = torch.optim.SGD(m.parameters(), lr=1e-2)
        f = torch.compile(m, mode="reduce-overhead") if compiled else m
        losses = []
        for i in range(6):
            g = torch.Generator("cuda").manual_seed(100 + i)
            x = torch.randn(32, 256, device="cuda", generator=g)
            t = torch.randn(32, 256, device="cuda", generator=g)
            loss = torch.nn.functional.mse_loss(f(x), t)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(float(loss))
        return losses, [p.detach().clone() for p in m.parameters()]

    el, ep = run(False)
    cl, cp = run(True)
    diff = max(float((a - b).abs().max()) for a, b in zip(ep, cp))
    return {"eager_losses": el, "compiled_losses": cl, "max_param_diff": diff,
            "ok": diff < 1e-3 and all(abs(a - b) < 1e-3 for a, b in zip(el, cl))}


def graphs(handle) -> dict:
    """Private pools with PyTorch's semantics: a graph's freed memory is not given to eager
    tensors, a second graph shares the pool, reset gives the memory back."""
    lin = torch.nn.Linear(2048, 2048).cuda()
    x = torch.randn(256, 2048, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            lin(x)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    g1 = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g1):
        tmp = lin(x) * 3  # freed inside the capture: the pool's, not the program's
        y1 = (tmp + 1).relu()
        del tmp
    g2 = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g2, pool=g1.pool()):  # shares g1's pool
        y2 = lin(y1) - 1
    eager = [torch.full((256, 2048), 5.0, device="cuda") for _ in range(8)]  # between replays
    ptrs_eager = {e.data_ptr() for e in eager}
    intact = True
    for _ in range(3):
        g1.replay()
        g2.replay()
        torch.cuda.synchronize()
        intact &= all(bool((e == 5).all()) for e in eager)
    ref1 = (lin(x) * 3 + 1).relu()
    ref2 = lin(ref1) - 1
    equal = bool(torch.allclose(y1, ref1, atol=1e-3) and torch.allclose(y2, ref2, atol=1e-3))
    del ref1, ref2
    out = {"equal": equal,
           "eager_intact": intact, "eager_in_graph_memory": bool(ptrs_eager & {y1.data_ptr(), y2.data_ptr()}),
           "pool_id": list(g1.pool())}
    held = torch.cuda.memory_allocated()
    del y1, y2, eager
    g1.reset()
    g2.reset()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    out["given_back"] = held - torch.cuda.memory_allocated()
    out["left_over_vs_start"] = torch.cuda.memory_allocated() - base
    # cuBLAS keeps the workspace it made during the first capture (for the capture stream): what
    # stays is compared with PyTorch's own allocator's in the test
    out["ok"] = out["equal"] and intact and not out["eager_in_graph_memory"] and out["given_back"] > 0
    return out


def snapshot(handle) -> dict:
    """PyTorch's own snapshot functions, read by _memory_viz and by vmstoolkit replay."""
    from torch.cuda import _memory_viz as viz

    torch.cuda.memory._record_memory_history(max_entries=100_000, stacks="python")
    m = model()
    x = torch.randn(128, 256, device="cuda")
    m(x).sum().backward()
    keep = torch.empty(3 << 20, device="cuda")
    path = Path(tempfile.mkdtemp()) / "run.pickle"
    torch.cuda.memory._dump_snapshot(str(path))
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    enabled_after = torch._C._cuda_isHistoryEnabled()
    trace = snap["device_traces"][0]
    lines = lambda flamegraph_lines: flamegraph_lines  # noqa: E731 (no flamegraph.pl download)
    out = {"events": len(trace), "with_frames": sum(1 for e in trace if e.get("frames")),
           "segments": len(snap["segments"]), "memory_snapshot": len(torch.cuda.memory_snapshot()),
           "enabled_after_stop": enabled_after,
           "user_frame": any(f["name"] == "snapshot" for e in trace for f in e.get("frames", []))}
    try:
        out["viz"] = {"trace": len(viz.trace(snap)), "segsum": len(viz.segsum(snap)),
                      "segments": len(viz.segments(snap, format_flamegraph=lines)),
                      "trace_plot": len(viz.trace_plot(snap)), "segment_plot": len(viz.segment_plot(snap))}
    except Exception as e:  # noqa: BLE001
        out["viz"] = f"error: {type(e).__name__}: {e}"
    p = subprocess.run([sys.executable, "-m", "vmstoolkit", "replay", str(path), "-a", "vms", "-a", "pytorch-caching"],
                       capture_output=True, text=True, timeout=300)
    out["replay_rc"] = p.returncode
    out["replay_err"] = p.stderr[-500:]
    del keep
    out["record"] = record_command(handle)
    out["ok"] = (out["events"] > 10 and out["record"].get("events", 0) > 2 and out["with_frames"] > 0 and out["user_frame"] and isinstance(out["viz"], dict)
                 and p.returncode == 0 and out["memory_snapshot"] > 0 and not enabled_after)
    return out


def record_command(handle) -> dict:
    """``vmstoolkit record -- python PROGRAM`` where PROGRAM installs this allocator itself."""
    if handle is None:
        return {"events": 3}
    out = Path(tempfile.mkdtemp()) / "rec.pickle.gz"
    prog = ("import vmstoolkit.integrations.torch as vt, torch; "
            f"vt.install({handle.allocator_name!r}); "
            "xs = [torch.ones(1 << 20, device='cuda') for _ in range(4)]; del xs[1:]; torch.cuda.synchronize()")
    p = subprocess.run([sys.executable, "-m", "vmstoolkit", "record", "--out", str(out), "--", sys.executable, "-c", prog],
                       capture_output=True, text=True, timeout=300)
    r = {"rc": p.returncode, "stderr": p.stderr[-600:]}
    if out.exists():
        from vmstoolkit.trace.loader import load_trace

        r["events"] = len(load_trace(out).alloc_free_events())
    return r


def fraction(handle) -> dict:
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(0.05)
    out = {"get": torch.cuda.get_per_process_memory_fraction()}
    try:
        t = torch.empty(int(0.06 * total), dtype=torch.uint8, device="cuda")
        t.fill_(1)
        out["raised"] = "nothing"
    except torch.OutOfMemoryError as e:
        out["raised"], out["message"] = "OutOfMemoryError", str(e)[:400]
    small = torch.ones(int(0.01 * total) // 4, device="cuda")
    out["below_cap_works"] = bool((small == 1).all())
    del small
    torch.cuda.set_per_process_memory_fraction(1.0)
    big = torch.empty(int(0.06 * total), dtype=torch.uint8, device="cuda")  # what was refused, now lifted
    out["lifted"] = big.numel() > 0
    del big
    out["ok"] = out["raised"] == "OutOfMemoryError" and out["get"] == 0.05 and out["lifted"] and out["below_cap_works"]
    return out


PER_SAMPLE = 3 * GiB  # what one sample of the clients' synthetic workload holds


class Hog(torch.nn.Module):
    """A model whose step needs PER_SAMPLE bytes per sample (so the batch that fits is known)."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(8))

    def forward(self, x=None, labels=None, **kw):
        n = x.shape[0]
        buf = torch.empty(n * PER_SAMPLE // 4, device=x.device)
        buf.fill_(1.0)
        loss = (self.w.sum() * buf[:8].sum()) / 1e6
        del buf
        return {"loss": loss}


def clients(handle) -> dict:
    out: dict = {}
    from accelerate.utils import find_executable_batch_size

    tried = []

    @find_executable_batch_size(starting_batch_size=256)
    def step(batch_size):
        tried.append(batch_size)
        x = torch.empty(batch_size * PER_SAMPLE // 4, device="cuda")
        x.fill_(1.0)
        del x
        torch.cuda.synchronize()
        return batch_size

    out["accelerate"] = {"final": step(), "tried": tried}
    try:
        torch.empty(1 << 44, dtype=torch.uint8, device="cuda")
    except Exception as e:  # noqa: BLE001
        err = e
    out["message"] = str(err)[:200]
    try:
        from lightning.pytorch.utilities.memory import is_oom_error
    except ImportError:
        from pytorch_lightning.utilities.memory import is_oom_error
    out["lightning_is_oom_error"] = bool(is_oom_error(err))
    from accelerate.utils.memory import should_reduce_batch_size

    out["accelerate_should_reduce"] = bool(should_reduce_batch_size(err))
    del err
    torch.cuda.empty_cache()
    out["trainer"] = trainer_batch()
    return out


def trainer_batch():
    from transformers import Trainer, TrainingArguments

    class Data(torch.utils.data.Dataset):
        def __len__(self):
            return 512

        def __getitem__(self, i):
            return {"x": torch.ones(4), "labels": torch.zeros(1)}

    args = TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=256, auto_find_batch_size=True,
                             max_steps=1, report_to=[], save_strategy="no", logging_strategy="no",
                             disable_tqdm=True, dataloader_num_workers=0)
    trainer = Trainer(model=Hog(), args=args, train_dataset=Data())
    trainer.train()
    return {"final": trainer._train_batch_size}


def mempool(handle) -> dict:
    """The MemPool route beside the global one (no install: PyTorch's own allocator)."""
    import vmstoolkit.integrations.torch as vt

    out: dict = {}
    for name in ("paged", "vms"):
        r: dict = {}
        with vt.use_pool(name) as pool:
            kv = torch.full((64, 1 << 20), 2.0, device="cuda")  # a KV cache's worth, 256 MiB
            w = torch.randn(1024, 1024, device="cuda")
            y = (w @ w.T).sum()
        outside = torch.ones(1 << 20, device="cuda")
        h = pool.vmstoolkit
        st = h.memory_stats()
        r["pool_reserved_by_vmstoolkit"] = st["allocated_bytes.all.current"]
        r["kv_in_pool"] = any(seg["segment_pool_id"] == pool.id for seg in torch.cuda.memory_snapshot())
        r["values"] = bool((kv == 2).all()) and bool(torch.isfinite(y))
        r["torch_allocated"] = torch.cuda.memory_allocated()
        del kv, w, y, outside
        r["use_count"] = pool.use_count()
        del pool
        torch.cuda.empty_cache()
        r["after_empty_cache"] = h.memory_stats()["allocated_bytes.all.current"]
        r["ok"] = r["values"] and r["pool_reserved_by_vmstoolkit"] >= 256 << 20
        out[name] = r
    out["ok"] = all(r["ok"] for r in out.values() if isinstance(r, dict))
    return out


def barrier(phase: str = "compiled", timeout: float = 180.0) -> None:
    """Wait until VMSTOOLKIT_SURFACE_BARRIER_N processes have reached ``phase``
    (VMSTOOLKIT_SURFACE_BARRIER: a shared folder); nothing without it."""
    import time

    where, n = os.environ.get("VMSTOOLKIT_SURFACE_BARRIER"), int(os.environ.get("VMSTOOLKIT_SURFACE_BARRIER_N", "0"))
    if not where or n <= 1:
        return
    where = os.path.join(where, phase)
    os.makedirs(where, exist_ok=True)
    Path(where, str(os.getpid())).touch()
    t0 = time.monotonic()
    while len(os.listdir(where)) < n and time.monotonic() - t0 < timeout:
        time.sleep(0.2)


def exit_case(handle) -> dict:
    """The program of issue 34 item 6: torch.compile'd training, a CUDA graph, a device filled until
    it refuses, threads; the exit status is the test's (and VMSTOOLKIT_SHIM_TRACE counts late calls)."""
    m = model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    f = torch.compile(m)
    for _ in range(3):
        f(torch.randn(64, 256, device="cuda")).sum().backward()
        opt.step()
        opt.zero_grad()
    g = torch.cuda.CUDAGraph()
    x = torch.randn(64, 256, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        m(x)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        y = m(x)
    g.replay()
    torch.cuda.synchronize()
    barrier()  # processes run side by side: fill the device only once all of them are past compiling
    hog, refused = [], False
    try:
        while True:
            hog.append(torch.empty(8 * GiB, dtype=torch.uint8, device="cuda"))
    except torch.OutOfMemoryError:
        refused = True
    filled = len(hog)
    del hog
    torch.cuda.empty_cache()  # PyTorch's own allocator caches the fill otherwise, and the processes beside it starve
    barrier("freed")  # every process has given its fill back before the threads allocate again

    def worker():
        for _ in range(50):
            torch.randn(1 << 16, device="cuda").sum().item()

    ts = [threading.Thread(target=worker) for _ in range(3)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    # left live at exit, freed while the interpreter finalizes (module globals), as in the user's program
    _KEPT.extend([torch.randn(1 << 20, device="cuda"), g, y, m, f, opt])
    torch.cuda.synchronize()
    return {"filled_gib": 8 * filled, "refused": refused, "y": float(y.detach().sum()), "ok": refused}


_KEPT: list = []


CASES = {"compile_inference": compile_inference, "compile_training": compile_training, "graphs": graphs,
         "snapshot": snapshot, "fraction": fraction, "clients": clients, "mempool": mempool, "exit": exit_case}


def main() -> None:
    case, name = sys.argv[1], sys.argv[2]
    opts = {}
    for kv in sys.argv[3:]:
        k, v = kv.split("=", 1)
        opts[k] = {"True": True, "False": False}.get(v, int(v) if v.lstrip("-").isdigit() else v)
    handle = None
    if name != "default" and case != "mempool":
        import vmstoolkit.integrations.torch as vt

        handle = vt.install(name, **opts)
    result = {"case": case, "allocator": name, "options": opts, "shim": bool(getattr(handle, "raises", False)),
              "torch": torch.__version__}
    try:
        result.update(CASES[case](handle))
    except Exception as e:  # noqa: BLE001 - the finding, with its stack on stderr
        traceback.print_exc()
        result["error"] = f"{type(e).__name__}: {str(e)[:600]}"
        result["ok"] = False
    print(json.dumps(result), flush=True)
    if os.environ.get("VMSTOOLKIT_SURFACE_OUT"):
        with open(os.environ["VMSTOOLKIT_SURFACE_OUT"], "a") as f:
            f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()

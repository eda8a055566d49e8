"""Training under a GPU budget on the H200 (issue 17), side by side with PyTorch eager, in one run.

    python experiments/train_offload_gpu.py --out experiments/results/train-offload-h200
    python experiments/train_offload_gpu.py --dry-run --out /tmp/x   # CPU: sim backend, tiny shapes
    # full fine-tuning at 256 tokens (transfer-bound), then at 2048 with PyTorch at a quarter:
    python experiments/train_offload_gpu.py --out OUT --variants full --seq 256 2048 --torch-seq 2048 \
        --torch-budgets quarter

For each variant (LoRA, full fine-tuning) of a 16-block, 4096-wide LLaMA (LLaMA-7B widths) at
batch 1, sequence 2048, writes to ``<out>/train_offload.jsonl`` one JSON object per measurement:

- ``direct``: the whole training graph with our Numba kernels, every tensor its own device
  array, launched back to back on one stream (the equality reference and the compute time;
  with ``--breakdown``, ``op_s``: seconds per op kind from one more pass timed with CUDA events);
- ``runtime``: our memory graph at half and a quarter of the no-offload working set, event-driven
  and fixed-order: step time (best and all ``--repeats``), lower bound (max of the direct compute
  time, H2D bytes / measured bandwidth, D2H bytes / bandwidth) and which term bounds it
  (``transfer_bound`` when a copy term exceeds compute), bytes moved, and the largest gradient
  difference against ``direct`` (gradients read back from the updated first moments);
- ``torch``: PyTorch eager on the same model and values at the same budget, in a subprocess
  (``torch.cuda.set_per_process_memory_fraction``): frozen / trainable weights kept in pinned CPU
  memory and copied to the GPU per block inside ``torch.utils.checkpoint`` (so backward's
  recompute copies them again), block inputs saved with
  ``torch.autograd.graph.save_on_cpu(pin_memory=True)``, gradients landing on the CPU parameters
  and AdamW stepping on the CPU (``foreach=True``) for full fine-tuning; LoRA adapters and their
  AdamW state stay on the GPU. Its step time includes the optimizer step, like ours; its
  gradients are compared with ours too.

With ``--timeline``, ``<out>/timeline_<variant>_s<seq>_<budget>.json`` and ``.png``: each
executor's first run vertex by vertex (CUDA events around every vertex; the sim backend's own
spans in a dry run), the two schedules one above the other.

``<out>/summary.json`` collects the side-by-side step times. Needs numba-cuda and cuda-bindings
(our kernels) and torch (the baseline; ``--skip-torch`` without it).
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import json
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from vmstoolkit.exec.compiler import working_set
from vmstoolkit.exec.experiment import sweep_budgets
from vmstoolkit.exec.graph import LlamaConfig
from vmstoolkit.exec.ops import reference_forward
from vmstoolkit.exec.plots import save_schedules
from vmstoolkit.exec.graph import TensorKind
from vmstoolkit.exec.train_graph import build_train_step, gradient_sources, grads_from_updates, random_train_values

FRACTIONS = {"half": 0.5, "quarter": 0.25}


def config(a, seq: int) -> LlamaConfig:
    if a.dry_run:
        return LlamaConfig(n_blocks=2, seq=16 if seq == a.seq[0] else 8, hidden=32, heads=4, kv_heads=2, ffn=48)
    return LlamaConfig(n_blocks=a.blocks, seq=seq, hidden=a.hidden, heads=a.heads, kv_heads=a.kv_heads or a.heads,
                       ffn=a.ffn)


RENAMED = {"makespan_s": "step_s", "makespans_s": "steps_s", "max_abs_err": "max_abs_grad_err",
           "ref_max_abs": "grad_max_abs"}
"""This script's names for :func:`~vmstoolkit.exec.experiment.sweep_budgets`' row keys."""


def max_grad_err(a: dict, b: dict) -> float:
    return max(float(np.max(np.abs(a[n] - b[n]))) for n in b)


def host_bytes_needed(tg) -> int:
    """Host memory this script holds for one variant at once, at most: the weights, inputs and
    moments (pinned in place, shared with the runtime), a pinned slot for every output (a step's
    updated state leaves the GPU at small budgets), and two sets of gradients (the reference and
    one run's). Before this count the full variant at 16 x 4096 kept four copies of its 39 GB of
    state and the H200 machine's 128 GB host killed the process."""
    g = tg.graph
    state = sum(t.nbytes for t in g.tensors if t.kind is not TensorKind.ACTIVATION)
    outs = sum(g.tensors[t].nbytes for t in g.outputs)
    return state + outs + 2 * tg.trainable_bytes()


def available_host_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux), else None."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def run_ours(tg, values, emit, a, variant, seq):
    """direct, then each budget x executor; returns {budget_name: budget bytes}.

    On the GPU, ``values`` are pinned in place first (``PinnedPool.pin``: the dict's arrays are
    replaced by pinned copies), so the direct run and every backend read one set of host arrays;
    each backend takes them as they are (``pin="in_place"``) and borrows its offload slots from
    one ``PinnedPool``, pinned by the first run and reused by every later one. The runtime never
    writes ``values`` (a step's updated weights and moments are new tensors), so each repeat
    starts from the same state and the first run's gradient check compares like with like."""
    graph = tg.graph
    ws = working_set(graph)
    budgets = {name: int(ws * f) for name, f in FRACTIONS.items()}
    emit({"kind": "working_set", "variant": variant, "working_set": ws, "budgets": budgets,
          "trainable_bytes": tg.trainable_bytes()})
    if a.dry_run:
        from vmstoolkit.exec.backends.sim import CostModel, SimBackend

        ref = reference_forward(graph, values)
        compute_s, bw, pool = None, None, None
    else:
        from numba import cuda

        from vmstoolkit.exec.backends.cuda import copy_bandwidth, direct_forward
        from vmstoolkit.exec.backends.host_memory import PinnedPool

        pool = PinnedPool()
        pool.pin(values)  # in place: one set of pinned arrays for the direct run and every backend
        ref, compute_s, *per_op = direct_forward(graph, values, repeats=a.repeats, outputs=gradient_sources(tg),
                                                 breakdown=a.breakdown)
        gc.collect()
        cuda.current_context().deallocations.clear()  # give the direct run's memory back now
        bw = copy_bandwidth()
        emit({"kind": "direct", "variant": variant, "compute_s": compute_s, **bw,
              **({"op_s": per_op[0]} if per_op else {})})
    want = grads_from_updates(tg, values, ref)
    del ref

    def make_backend(rep: int):
        if a.dry_run:
            return SimBackend(seed=rep, jitter=0.05, numerics=True, values=values)
        from vmstoolkit.exec.backends.cuda import CudaBackend

        # --timeline: CUDA events around every vertex of the first (checked) run only
        return CudaBackend(values, pin="in_place", pool=pool, timeline=a.timeline and rep == 0)

    def read(be):
        return grads_from_updates(tg, values, be.result(gradient_sources(tg)))

    timelines: dict[str, dict] = {}  # budget name -> executor -> (memory graph, seconds, spans) of its first run

    def observe(be, res, fields, ex, i):
        if i == 0:
            timelines.setdefault(fields["budget_name"], {})[ex] = (be.mg, res.makespan_s, list(be.spans))

    def lower_bound(mg):
        if a.dry_run:
            return CostModel().lower_bound(mg)
        h2d = mg.reloaded_bytes / bw["h2d"]
        d2h = mg.offloaded_bytes / bw["d2h"]
        return {"compute_s": compute_s, "h2d_s": h2d, "d2h_s": d2h, "lower_bound_s": max(compute_s, h2d, d2h)}
    fields = [({"kind": "runtime", "variant": variant, "budget_name": name, "budget": budget, "working_set": ws},
               budget) for name, budget in budgets.items()]
    try:
        for row in sweep_budgets(graph, fields, make_backend, lower_bound, repeats=1 if a.dry_run else a.repeats,
                                 reference=want, read=read, rtol=1e-4, keep_going=True, check_runs=1,
                                 observe=observe if a.timeline else None):
            if "lower_bound_s" in row:
                row["transfer_bound"] = max(row["h2d_s"], row["d2h_s"]) > row["compute_s"]
            if "makespan_s" in row:  # a training step: its makespan is the step time
                row = {RENAMED.get(k, k): v for k, v in row.items()}
                row["ratio_to_lower_bound"] = row["step_s"] / row["lower_bound_s"]
            if pool is not None:
                row["pinned_slot_bytes"] = pool.stats.allocated_bytes
            emit(row)
    finally:
        if pool is not None:
            pool.close()  # the slots; the pinned values live on in ``values``
    for name, runs in timelines.items():
        save_schedules(a.out, budgets[name], runs, "simulated" if a.dry_run else "GPU, CUDA events",
                       stem=f"timeline_{variant}_s{seq}_{name}")
    return budgets, want


# ---- PyTorch eager baseline (run in its own process: --torch-only) --------------------------


def torch_step(cfg: LlamaConfig, variant: str, rank: int, budget: int, seed: int, repeats: int,
               model: str | None = None) -> dict:
    """One PyTorch eager training step under ``budget`` bytes of GPU memory (module docstring);
    the same values as ours (``random_train_values`` of the same graph and seed, or with ``model``
    a checkpoint folder's weights as ``vmstoolkit run train`` reads them: ``train_values``)."""
    import torch
    from torch.utils.checkpoint import checkpoint

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    tg = build_train_step(cfg, variant, rank=rank)
    if model is not None:
        from vmstoolkit.exec.model import load_model
        from vmstoolkit.exec.model.train import train_token_ids, train_values

        ckpt = load_model(model)
        values = train_values(ckpt, tg, train_token_ids(ckpt, cfg.seq, seed), seed=seed, copy=True)
    else:
        values = random_train_values(tg, seed)
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total))
    dev = torch.device("cuda")
    names = {t.name: t.id for t in tg.graph.tensors}
    lora = variant == "lora"
    opt_cfg = tg.adamw
    cpu = {}  # frozen or trainable weights on the CPU, pinned
    gpu = {}  # LoRA adapters on the GPU
    for t in tg.graph.tensors:
        if t.id not in values or t.name in ("x", "dout") or t.name.endswith((".adam_m", ".adam_v")):
            continue
        a = torch.from_numpy(values[t.id])
        if lora and t.name in tg.params:
            gpu[t.name] = torch.nn.Parameter(a.to(dev))
        else:
            cpu[t.name] = torch.nn.Parameter(a.pin_memory(), requires_grad=not lora)
    params = list(gpu.values()) if lora else list(cpu.values())
    opt = torch.optim.AdamW(params, lr=opt_cfg.lr, betas=(opt_cfg.beta1, opt_cfg.beta2), eps=opt_cfg.eps,
                            weight_decay=opt_cfg.weight_decay, foreach=True)
    x0 = torch.from_numpy(values[names["x"]]).to(dev)
    dout = torch.from_numpy(values[names["dout"]]).to(dev)
    del values  # the pinned copies above are what the step uses
    b, t, nh, nkv, hd = cfg.batch, cfg.seq, cfg.heads, cfg.kv_heads, cfg.head_dim

    def rope(x):
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64, device=dev) / hd))
        emb = torch.outer(torch.arange(t, dtype=torch.float64, device=dev), inv)
        emb = torch.cat([emb, emb], -1)
        cos, sin = emb.cos().float()[None, :, None], emb.sin().float()[None, :, None]
        return x * cos + torch.cat([-x[..., hd // 2:], x[..., : hd // 2]], -1) * sin

    def block(x, i):
        p = f"b{i}."
        w = {k[len(p):]: v.to(dev, non_blocking=True) for k, v in cpu.items() if k.startswith(p)}

        def proj(name, xin):
            y = torch.nn.functional.linear(xin, w[name])
            if lora:
                y = y + torch.nn.functional.linear(torch.nn.functional.linear(xin, gpu[p + name + ".lora_a"]),
                                                   gpu[p + name + ".lora_b"])
            return y

        def norm(z, wn):
            return z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + cfg.eps) * wn

        xn = norm(x, w["attn_norm"])
        q = rope(proj("wq", xn).view(b, t, nh, hd)).transpose(1, 2)
        k = rope(proj("wk", xn).view(b, t, nkv, hd)).transpose(1, 2)
        v = proj("wv", xn).view(b, t, nkv, hd).transpose(1, 2)
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=nkv != nh)
        h = x + proj("wo", o.transpose(1, 2).reshape(b * t, nh * hd))
        hn = norm(h, w["ffn_norm"])
        return h + proj("wd", torch.nn.functional.silu(proj("wg", hn)) * proj("wu", hn))

    def step():
        opt.zero_grad(set_to_none=True)
        x = x0
        with torch.autograd.graph.save_on_cpu(pin_memory=True):
            for i in range(cfg.n_blocks):
                x = checkpoint(block, x, i, use_reentrant=False)
        (x * dout).sum().backward()
        grads = {n: (gpu.get(n) if lora else cpu.get(n)).grad.detach().cpu().numpy().copy() for n in tg.params}
        opt.step()
        torch.cuda.synchronize()
        return grads

    times, grads = [], None
    state0 = {k: v.detach().clone() for k, v in (gpu if lora else cpu).items()}
    for _ in range(repeats):
        with torch.no_grad():  # the same starting point every repeat
            for k, v in (gpu if lora else cpu).items():
                v.copy_(state0[k])
        opt.state.clear()
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        g = step()
        times.append(time.perf_counter() - t0)
        grads = grads or g
    return {"step_s": min(times), "steps_s": times, "peak_bytes": torch.cuda.max_memory_allocated(),
            "grads": grads}


def run_torch(cfg, variant, budgets, want, emit, a):
    for name, budget in budgets.items():
        if name not in a.torch_budgets:
            continue
        row = {"kind": "torch", "variant": variant, "budget_name": name, "budget": budget}
        npz = a.out / f"torch_{variant}_{name}.npz"
        cmd = [sys.executable, __file__, "--torch-only", "--variant", variant, "--budget", str(budget),
               "--out", str(a.out), "--npz", str(npz), "--blocks", str(cfg.n_blocks), "--seq", str(cfg.seq),
               "--hidden", str(cfg.hidden), "--heads", str(cfg.heads), "--kv-heads", str(cfg.kv_heads),
               "--ffn", str(cfg.ffn), "--rank", str(a.rank), "--seed", str(a.seed), "--repeats", str(a.repeats)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        if proc.returncode != 0 or not lines:
            row["error"] = (proc.stderr or proc.stdout)[-2000:]
        else:
            row.update(json.loads(lines[-1]))
            got = dict(np.load(npz))
            row["max_abs_grad_err_vs_ours"] = max_grad_err({k: got[k] for k in want}, want)
        emit(row)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--dry-run", action="store_true", help="CPU only: sim backend, tiny shapes, no torch")
    ap.add_argument("--variants", nargs="+", default=["lora", "full"], choices=["lora", "full"])
    ap.add_argument("--blocks", type=int, default=16)
    ap.add_argument("--seq", type=int, nargs="+", default=[2048],
                    help="sequence lengths, run one after the other in this process (kernels compile once); "
                         "the PyTorch baseline runs at --torch-seq only")
    ap.add_argument("--torch-seq", type=int, default=None, help="the --seq at which PyTorch runs (default: the first)")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=None)
    ap.add_argument("--ffn", type=int, default=11008)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-torch", action="store_true")
    ap.add_argument("--timeline", action="store_true",
                    help="record each (budget, executor)'s first run vertex by vertex (CUDA events on the GPU) and "
                         "save timeline_<variant>_s<seq>_<budget>.json/.png: the executors' schedules one above the other")
    ap.add_argument("--breakdown", action="store_true",
                    help="time the direct run's vertices with CUDA events: seconds per op kind (op_s)")
    ap.add_argument("--attn-bwd-variant", type=int, default=None, choices=[1, 2],
                    help="attention backward kernels of every run (default: the kernel module's)")
    ap.add_argument("--torch-budgets", nargs="+", default=list(FRACTIONS), choices=list(FRACTIONS),
                    help="budgets at which the PyTorch baseline runs (each is a process of its own)")
    ap.add_argument("--torch-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", default=None, help=argparse.SUPPRESS)  # with --torch-only: a checkpoint's weights
    ap.add_argument("--variant", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--budget", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--npz", type=Path, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.attn_bwd_variant is not None:
        from vmstoolkit.kernels import attention_backward

        attention_backward.DEFAULT_VARIANT = a.attn_bwd_variant
    faulthandler.enable()
    a.out.mkdir(parents=True, exist_ok=True)
    cfg = config(a, a.seq[0])
    if a.torch_only:
        if a.model is not None:  # the checkpoint's shape, eps and rope_theta
            from vmstoolkit.exec.model import load_model
            from vmstoolkit.exec.model.train import train_config

            cfg = train_config(load_model(a.model), a.seq[0])
        res = torch_step(cfg, a.variant, a.rank, a.budget, a.seed, a.repeats, model=a.model)
        np.savez(a.npz, **res.pop("grads"))
        print(json.dumps(res), flush=True)
        return 0
    rows_path = a.out / "train_offload.jsonl"
    rows_path.write_text("")
    rows = []

    t0 = time.perf_counter()

    def emit(row):
        row = {"command": " ".join(sys.argv), "config": asdict(cfg), "seq": cfg.seq,
               "t_s": round(time.perf_counter() - t0, 1), **row}
        rows.append(row)
        with rows_path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps({k: v for k, v in row.items() if k not in ("traceback", "command", "config")}), flush=True)

    for seq in a.seq:
        cfg = config(a, seq)
        for variant in a.variants:
            tg = build_train_step(cfg, variant, rank=a.rank)
            need, have = host_bytes_needed(tg), available_host_bytes()
            if not a.dry_run and have is not None and need > have:
                emit({"kind": "skipped", "variant": variant,
                      "error": f"{variant} at seq {seq} needs about {need / 1e9:.1f} GB of host memory "
                               f"and {have / 1e9:.1f} GB are available"})
                continue
            values = random_train_values(tg, a.seed)
            budgets, want = run_ours(tg, values, emit, a, variant, seq)
            del values
            gc.collect()
            if not a.dry_run:  # free our pinned host copies before the baseline takes its own
                from numba import cuda

                cuda.current_context().deallocations.clear()
            if a.dry_run or a.skip_torch or seq != (a.torch_seq or a.seq[0]):
                emit({"kind": "torch", "variant": variant,
                      "skipped": "dry run" if a.dry_run else "--skip-torch" if a.skip_torch else "not --torch-seq"})
            else:
                run_torch(cfg, variant, budgets, want, emit, a)
    side = {}
    for r in rows:
        if "step_s" in r and r["kind"] in ("runtime", "torch"):
            key = f"{r['variant']} seq {r['seq']} {r['budget_name']}"
            side.setdefault(key, {})[r.get("executor", "torch eager")] = r["step_s"]
            if r["kind"] == "runtime":
                side[key]["lower_bound_s"] = r["lower_bound_s"]
                side[key]["transfer_bound"] = r["transfer_bound"]
    summary = {"command": " ".join(sys.argv), "config": asdict(cfg), "seqs": a.seq, "wall_s": time.perf_counter() - t0,
               "step_s": side,
               "all_equal": all(r.get("equal", True) for r in rows if r["kind"] == "runtime" and "error" not in r),
               "errors": [r["error"][:300] for r in rows if "error" in r]}
    (a.out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary["step_s"], indent=1))
    return 0 if summary["all_equal"] and not summary["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())

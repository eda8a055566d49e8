"""The offload experiment on the H200, side by side with Hugging Face accelerate, in one run.

    python experiments/offload_gpu.py --out experiments/results/offload-h200 [--gpus 2] [--blocks 16]
    python experiments/offload_gpu.py --dry-run --out /tmp/x     # CPU: sim backend, tiny shapes

Writes ``<out>/offload.jsonl`` (one JSON object per measurement), ``<out>/summary.json`` and
``<out>/makespan.png``. Measurements, all on the same model shape and prompt:

- ``direct``: the block-by-block forward with our Numba kernels, every weight resident, kernels
  launched back to back on one stream with no events: the equality reference and the compute time;
- ``runtime``: our memory graph at budgets full (the no-offload working set), half, a quarter
  and an eighth of the working set (issue 18's table; ``--budgets`` also takes half and a quarter
  of the weights, the earlier runs' budgets); executors event-driven (host callback and event
  polling) and fixed-order; each checked equal to ``direct``, with its lower bound's terms
  (compute, H2D, D2H) and ``transfer_bound`` when a copy term exceeds compute;
- ``accelerate``: ``infer_auto_device_map`` with GPU ``max_memory`` = the same budgets, then
  ``dispatch_model``, forward of ``inputs_embeds`` (skipped, and said so, without torch). Its
  ``full`` row is the all-on-GPU cuBLAS time.

With ``--timeline``, ``<out>/timeline_<budget>.json`` and ``.png``: each executor's first run at
that budget vertex by vertex (CUDA events; the sim backend's spans in a dry run), one above the
other.

The ``runtime`` rows come from the product's sweep
(:func:`vmstoolkit.exec.experiment.sweep_budgets`, the loop of ``vmstoolkit experiment offload``),
given what this script adds: every run's outputs checked against ``direct``, both ways of
learning of completions (``OFFLOAD_NOTIFY``, one sweep each), and budgets named by weights as
well as by working set. The values are pinned once, in place, and every run borrows its offload
slots from one ``PinnedPool``.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import json
import sys
import time
from pathlib import Path

from vmstoolkit.exec.compiler import working_set
from vmstoolkit.exec.experiment import sweep_budgets
from vmstoolkit.exec.graph import LlamaConfig, build_llama, random_weights
from vmstoolkit.exec.ops import reference_forward
from vmstoolkit.exec.plots import save_schedules


REPEATS = int(os.environ.get("OFFLOAD_REPEATS", "3"))  # makespan = best of this many runs


BUDGETS = ("full", "half_ws", "quarter_ws", "eighth_ws", "half_weights", "quarter_weights")
DEFAULT_BUDGETS = BUDGETS[:4]  # issue 18's table: full, half, a quarter and an eighth of the working set


def budgets(graph, ws, names=DEFAULT_BUDGETS):
    w = graph.weight_bytes()
    every = {"full": ws, "half_ws": ws // 2, "quarter_ws": ws // 4, "eighth_ws": ws // 8,
             "half_weights": w // 2, "quarter_weights": w // 4}
    return {n: every[n] for n in names}


def run_ours(graph, values, ref, emit, dry: bool, parts: int, names=DEFAULT_BUDGETS, timeline_out: Path | None = None):
    ws = working_set(graph)
    pool = None
    if dry:
        from vmstoolkit.exec.backends.sim import CostModel, SimBackend

        def backend(notify):
            return lambda rep: SimBackend(seed=0, jitter=0.05, numerics=True, values=values)

        def lb(mg):
            return CostModel().lower_bound(mg)
        notifies = ["sim"]
    else:
        from vmstoolkit.exec.backends.cuda import CudaBackend, measure_lower_bound
        from vmstoolkit.exec.backends.host_memory import PinnedPool

        pool = PinnedPool()
        pool.pin(values)  # in place, once: every run reads these arrays and borrows the pool's slots

        def backend(notify):  # --timeline: CUDA events around every vertex of the first run only
            return lambda rep: CudaBackend(values, notify=notify, pin="in_place", pool=pool,
                                           timeline=timeline_out is not None and rep == 0)

        def lb(mg):
            return measure_lower_bound(mg, values)
        # both ways of learning of completions, measured side by side (OFFLOAD_NOTIFY narrows it)
        notifies = os.environ.get("OFFLOAD_NOTIFY", "poll,callback").split(",")
    sizes = budgets(graph, ws, names)
    fields = [({"kind": "runtime", "budget_name": name, "budget": budget, "working_set": ws, "parts": parts,
                "fits_without_offload": budget >= ws}, budget) for name, budget in sizes.items()]
    timelines: dict[str, dict] = {}  # budget name -> "executor (notify)" -> (memory graph, makespan, spans), first run

    def observe(be, res, fields, ex, i):
        if i == 0:
            label = f"{ex} ({fields['notify']})"
            timelines.setdefault(fields["budget_name"], {})[label] = (be.mg, res.makespan_s, list(be.spans))
    try:
        for notify in notifies:  # compiling again per notify costs milliseconds; the lower bound is cached
            for row in sweep_budgets(graph, [({**f, "notify": notify}, b) for f, b in fields], backend(notify), lb,
                                     repeats=1 if dry else REPEATS, reference=ref, keep_going=True,
                                     observe=observe if timeline_out is not None else None):
                if "makespan_s" in row:
                    row["ratio_to_lower_bound"] = row["makespan_s"] / row["lower_bound_s"]
                    row["transfer_bound"] = max(row["h2d_s"], row["d2h_s"]) > row["compute_s"]
                emit(row)
    finally:
        if pool is not None:
            pool.close()  # the slots; the pinned values live on in ``values``
    for name, runs in timelines.items():
        save_schedules(timeline_out, sizes[name], runs, "simulated" if dry else "GPU, CUDA events",
                       stem=f"timeline_{name}")


def run_accelerate(cfg: LlamaConfig, graph, ws, emit, seed: int, names=DEFAULT_BUDGETS):
    try:
        import torch
        from accelerate import dispatch_model, infer_auto_device_map
        from transformers import LlamaConfig as HFConfig
        from transformers.models.llama.modeling_llama import LlamaModel
    except ImportError as e:
        emit({"kind": "accelerate", "skipped": f"not installed: {e}"})
        return
    if not torch.cuda.is_available():
        emit({"kind": "accelerate", "skipped": "no CUDA device for torch"})
        return
    hf = HFConfig(hidden_size=cfg.hidden, intermediate_size=cfg.ffn, num_attention_heads=cfg.heads,
                  num_key_value_heads=cfg.kv_heads, num_hidden_layers=cfg.n_blocks, vocab_size=128,
                  max_position_embeddings=cfg.seq, rms_norm_eps=cfg.eps, torch_dtype="float32")
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 against fp32: the same arithmetic as ours
    torch.set_float32_matmul_precision("highest")
    torch.manual_seed(seed)
    x = torch.randn(cfg.batch, cfg.seq, cfg.hidden)
    # One set of random CPU weights for every budget: building the 13 GiB model with its default
    # initialisation takes about a minute per budget on the CPU. Each budget gets a fresh module
    # on the meta device whose parameters are these tensors (no copy).
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in LlamaModel(hf).state_dict().items()}
    weights = {k: (torch.ones(shp) if k.endswith("norm.weight") else torch.empty(shp).uniform_(-0.02, 0.02))
               for k, shp in shapes.items()}
    for name, budget in budgets(graph, ws, names).items():
        row = {"kind": "accelerate", "budget_name": name, "budget": budget}
        try:
            with torch.device("meta"):
                model = LlamaModel(hf)
            model.rotary_emb = type(model.rotary_emb)(config=hf)  # computed buffers, not in the state dict
            model.load_state_dict(weights, assign=True)
            model.eval()
            if name == "full":
                model = model.to("cuda:0")
                device_map = "all on cuda:0"
            else:
                dm = infer_auto_device_map(model, max_memory={0: budget, "cpu": 400 * 2**30},
                                           no_split_module_classes=["LlamaDecoderLayer"])
                model = dispatch_model(model, device_map=dm)
                device_map = {k: str(v) for k, v in dm.items()}
            xin = x.to("cuda:0")
            times = []
            with torch.no_grad():
                for _ in range(4):  # first is warm-up
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    model(inputs_embeds=xin)
                    torch.cuda.synchronize()
                    times.append(time.perf_counter() - t0)
            row.update(wall_s=min(times[1:]), walls_s=times, device_map=device_map,
                       tf32=bool(torch.backends.cuda.matmul.allow_tf32))
            del model
            torch.cuda.empty_cache()
        except Exception as e:
            row.update(error=f"{type(e).__name__}: {e}")
        emit(row)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--dry-run", action="store_true", help="CPU only: sim backend, tiny shapes, no accelerate")
    ap.add_argument("--gpus", type=int, default=1)
    ap.add_argument("--blocks", type=int, default=16)
    ap.add_argument("--parts", type=int, default=1)
    ap.add_argument("--seq", type=int, default=None, help="prompt length (default: LlamaConfig's 2048)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-accelerate", action="store_true")
    ap.add_argument("--budgets", nargs="+", choices=BUDGETS, default=list(DEFAULT_BUDGETS),
                    help="budgets by name: fractions of the working set (_ws) or of the weights (_weights)")
    ap.add_argument("--timeline", action="store_true",
                    help="record each executor's first run at each budget vertex by vertex (CUDA events) and save "
                         "timeline_<budget>.json/.png")
    a = ap.parse_args(argv)
    faulthandler.enable()  # a crash (seen at exit with two GPUs) prints the Python stacks
    a.out.mkdir(parents=True, exist_ok=True)
    if a.dry_run:
        cfg = LlamaConfig(n_blocks=4, seq=16, hidden=64, heads=4, kv_heads=4, ffn=128)
    else:
        cfg = LlamaConfig(n_blocks=a.blocks, **({"seq": a.seq} if a.seq else {}))
    graph = build_llama(cfg, parts=a.parts, n_gpus=a.gpus)
    values = random_weights(graph, a.seed)
    rows_path = a.out / "offload.jsonl"
    rows = []

    def emit(row):
        row = {"command": " ".join(sys.argv), "gpus": a.gpus, "blocks": cfg.n_blocks, **row}
        rows.append(row)
        with rows_path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps({k: v for k, v in row.items() if k not in ("traceback", "device_map", "command")}),
              flush=True)

    rows_path.write_text("")
    t0 = time.perf_counter()
    if a.dry_run:
        ref = reference_forward(graph, values)
        emit({"kind": "direct", "backend": "numpy", "compute_s": time.perf_counter() - t0})
    else:
        from vmstoolkit.exec.backends.cuda import copy_bandwidth, direct_forward

        ref, compute_s = direct_forward(graph, values)
        emit({"kind": "direct", "backend": "cuda", "compute_s": compute_s, **copy_bandwidth()})
    ref = {t: ref[t] for t in graph.outputs}
    run_ours(graph, values, ref, emit, a.dry_run, a.parts, a.budgets, a.out if a.timeline else None)
    if a.dry_run or a.skip_accelerate:
        emit({"kind": "accelerate", "skipped": "dry run" if a.dry_run else "--skip-accelerate"})
    else:
        run_accelerate(cfg, graph, working_set(graph), emit, a.seed, a.budgets)
    summary = {"command": " ".join(sys.argv), "config": cfg.__dict__, "parts": a.parts, "gpus": a.gpus,
               "wall_s": time.perf_counter() - t0, "rows": len(rows),
               "all_equal": all(r.get("equal", True) for r in rows if r["kind"] == "runtime" and "error" not in r)}
    (a.out / "summary.json").write_text(json.dumps(summary, indent=2))
    try:
        from vmstoolkit.exec.experiment import plot_makespan

        ok = [dict(r, executor=f"{r['executor']} ({r['notify']})") for r in rows
              if r["kind"] == "runtime" and "makespan_s" in r]
        plot_makespan(ok, a.out / "makespan.png")
    except Exception as e:  # the figure is a convenience; the JSON is the result
        print(f"figure failed: {e}", file=sys.stderr)
    return 0 if summary["all_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())

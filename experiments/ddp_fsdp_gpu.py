"""DDP and FSDP2 on two GPUs under each allocator mode: peak reserved per rank, step time, losses.

    python experiments/ddp_fsdp_gpu.py --out DIR [--modes default,expandable,paged:aliases=true,slack_pages=64]
        [--repeats 4] [--gpus 2] [--steps 16] [--warmup 4]

Each repeat runs every mode once, interleaved, each as its own ``torchrun`` (an allocator is
installed before PyTorch's first CUDA allocation, on every rank). Inside one process: an 8-layer
OPT (hidden 2048, random weights from its config, no download) trained with bf16 autocast and
AdamW, first under DDP, then (memory given back, peaks reset) under FSDP2 (``fully_shard`` per
layer and on the whole model). Batch and sequence length change every step, from one seeded list,
the same in every mode. Then, per rank, the rest of the drop-in contract (``checks``): PyTorch's own
snapshot functions over one DDP step, ``set_per_process_memory_fraction`` refusing a request past it
with a catchable ``torch.OutOfMemoryError`` in PyTorch's words, a CUDA graph replaying to eager's
result with eager tensors allocated between replays intact, and ``torch.compile(mode="reduce-overhead")``
equal to eager; torchrun's exit status says the ranks ended cleanly. Rows go to ``DIR/train.jsonl``, one per (process, strategy), in the
format ``experiments/pool_runs.py`` pools (``variant`` = ddp | fsdp2, ``mode``, ``step_times``):

    python experiments/pool_runs.py DIR/train.jsonl --variant fsdp2 --mode paged:aliases=true,slack_pages=64 --steps-per-round 4
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

from common import allocator_mode, split_modes
from vmstoolkit.errors import ConfigError

NATIVE_MODES = ("default", "expandable")  # the PyTorch modes this script runs; the others name vmstoolkit allocators


def shapes(steps: int, seed: int = 0) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    return [(rng.choice([2, 4, 6, 8]), rng.choice([256, 384, 512, 768, 1024])) for _ in range(steps)]


def checks(torch, wrapped, ids) -> dict:
    """The drop-in contract beyond DDP/FSDP2 on this rank: each check's verdict, or its error."""
    out: dict = {}

    def check(name, fn):
        try:
            out[name] = fn()
        except Exception as e:  # noqa: BLE001 - recorded, the run goes on
            out[name] = f"error: {type(e).__name__}: {str(e)[:300]}"

    def history():
        torch.cuda.memory._record_memory_history(max_entries=100_000, stacks="python")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            wrapped(input_ids=ids, labels=ids).loss.backward()
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        trace = snap["device_traces"][torch.cuda.current_device()]
        return {"events": len(trace), "with_frames": sum(1 for e in trace if e.get("frames")),
                "segments": len(snap["segments"])}

    def fraction():
        torch.cuda.set_per_process_memory_fraction(0.05)
        try:
            torch.empty(int(0.06 * torch.cuda.get_device_properties(0).total_memory), dtype=torch.uint8, device="cuda")
            return "not refused"
        except torch.OutOfMemoryError as e:
            return str(e)[:60]
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0)

    def graph():
        lin = torch.nn.Linear(512, 512).cuda()
        x = torch.randn(64, 512, device="cuda")
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            lin(x)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y = lin(x).relu() * 2
        keep = [torch.full((64, 512), 3.0, device="cuda") for _ in range(4)]  # eager, between replays
        g.replay()
        g.replay()
        torch.cuda.synchronize()
        return bool(torch.allclose(y, lin(x).relu() * 2)) and all(bool((k == 3).all()) for k in keep)

    def reduce_overhead():
        mlp = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256)).cuda()
        fast = torch.compile(mlp, mode="reduce-overhead")
        x = torch.randn(32, 256, device="cuda")
        with torch.no_grad():
            for _ in range(4):
                y = fast(x).clone()
            return bool(torch.allclose(y, mlp(x), atol=1e-4))

    for name, fn in (("history", history), ("fraction", fraction), ("cuda_graph", graph),
                     ("reduce_overhead", reduce_overhead)):
        check(name, fn)
    return out


def worker(args) -> None:
    mode = args.mode
    spec = allocator_mode(mode, NATIVE_MODES)
    if mode == "expandable":
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    import torch

    handle = None
    if spec is not None:
        import vmstoolkit.integrations.torch as vt

        handle = vt.install(spec.name, **spec.options)
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP
    from transformers import OPTConfig, OPTForCausalLM

    rank = int(os.environ["RANK"])
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    cfg = OPTConfig(hidden_size=2048, num_hidden_layers=8, num_attention_heads=32, ffn_dim=8192,
                    vocab_size=50272, max_position_embeddings=2048)
    plan = shapes(args.warmup + args.steps)
    rows = []
    for strategy in ("ddp", "fsdp2"):
        torch.manual_seed(0)
        model = OPTForCausalLM(cfg).cuda()
        if strategy == "ddp":
            wrapped = DDP(model, device_ids=[local])
        else:
            for layer in model.model.decoder.layers:
                fully_shard(layer)
            wrapped = fully_shard(model)
        opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-4)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        times, losses = [], []
        for step, (b, t) in enumerate(plan):
            g = torch.Generator(device="cuda").manual_seed(1000 * step + rank)
            ids = torch.randint(0, cfg.vocab_size, (b, t), device="cuda", generator=g)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = wrapped(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            losses.append(float(loss.detach()))
        rows.append({"variant": strategy, "mode": mode, "rank": rank, "step_times": times, "losses": losses,
                     "peak_reserved": torch.cuda.max_memory_reserved(), "peak_allocated": torch.cuda.max_memory_allocated(),
                     "shim": handle.raises if handle else None})
        if strategy == "ddp" and args.checks:
            rows[-1]["checks"] = checks(torch, wrapped, ids)
        del wrapped, model, opt, loss
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    all_rows = [None] * dist.get_world_size()
    dist.all_gather_object(all_rows, rows)
    if rank == 0:
        with open(args.out / "train.jsonl", "a") as f:
            for per_rank in all_rows:
                for r in per_rank:
                    f.write(json.dumps(r) + "\n")
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--modes", default="default,expandable,paged:aliases=true,slack_pages=64",
                    help="PyTorch's default and expandable modes, or vmstoolkit allocators as NAME:KEY=VALUE,...")
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--no-checks", dest="checks", action="store_false",
                    help="skip the per-rank drop-in checks (snapshot, fraction, CUDA graph, reduce-overhead)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.worker:
        worker(args)
        return 0
    modes = split_modes(args.modes)
    for mode in modes:
        try:
            allocator_mode(mode, NATIVE_MODES)
        except ConfigError as e:
            ap.error(str(e))
    for rep in range(args.repeats):
        for mode in modes:
            t0 = time.perf_counter()
            cmd = ["torchrun", "--standalone", f"--nproc_per_node={args.gpus}", __file__, "--worker", "--mode", mode,
                   "--out", str(args.out), "--steps", str(args.steps), "--warmup", str(args.warmup)]
            if not args.checks:
                cmd.append("--no-checks")
            p = subprocess.run(cmd, capture_output=True, text=True)
            print(f"repeat {rep} {mode}: rc {p.returncode} in {time.perf_counter() - t0:.0f} s", flush=True)
            with open(args.out / "exits.jsonl", "a") as f:  # status 0: every rank ended cleanly
                f.write(json.dumps({"repeat": rep, "mode": mode, "returncode": p.returncode}) + "\n")
            if p.returncode:
                print(p.stderr[-2500:], flush=True)
                with open(args.out / "train.jsonl", "a") as f:
                    f.write(json.dumps({"mode": mode, "error": p.stderr[-800:]}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

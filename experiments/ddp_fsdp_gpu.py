"""DDP and FSDP2 under each allocator mode, on one GPU or several, with the allocator contract checked on every rank.

Peaks, step times and losses of both strategies, and the rest of PyTorch's allocator contract.

    python experiments/ddp_fsdp_gpu.py --out DIR [--modes default,expandable,paged:aliases=true,slack_pages=64]
        [--gpus 1|2|...] [--repeats 4] [--steps 16] [--warmup 4] [--parallel 1] [--checks all|none|NAME,...]
    python experiments/ddp_fsdp_gpu.py --out DIR --summary-of DIR/train.jsonl [--modes ...]   # any machine

The contract on one GPU, every allocator setting side by side (no timing claim):

    python experiments/ddp_fsdp_gpu.py --out DIR --gpus 1 --repeats 1 --steps 8 --warmup 2 --parallel 5 \
        --modes default,expandable,paged,paged:aliases=true,slack_pages=64,vms

Each repeat runs every mode once, interleaved, each as its own ``torch.distributed.run`` of
``--gpus`` ranks (world size 1 on one GPU works: DDP and FSDP2 then run their collectives over one
rank); an allocator is installed before PyTorch's first CUDA allocation, on every rank.
``--parallel K`` runs up to K of a repeat's modes at once (on the same GPUs: a contract check,
whose step times are not for pooling). Inside one process: an 8-layer OPT (hidden 2048, random
weights from its config, no download) trained with bf16 autocast and AdamW, first under DDP, then
(memory given back, peaks reset) under FSDP2 (``fully_shard`` per layer and on the whole model).
Batch and sequence length change every step, from one seeded list, the same in every mode.

Then, per rank, the rest of the contract (:data:`CHECKS`; issue 34), each a verdict with ``ok``:

- ``history``: PyTorch's own ``_record_memory_history(stacks="python", max_entries=...)`` over one
  DDP step, ``_snapshot``, ``_dump_snapshot`` and ``memory_snapshot()``; the dump read back by
  vmstoolkit's loader and replayed, the snapshot by ``torch.cuda._memory_viz``; ``enabled=None`` stops;
- ``fraction``: ``set/get_per_process_memory_fraction``: a request past the cap is a catchable
  ``torch.OutOfMemoryError``, one under it is served, and lifting the cap serves the refused one;
- ``oom_text``: a request the device cannot hold raises ``torch.OutOfMemoryError`` whose message
  begins as PyTorch's (``CUDA out of memory. Tried to allocate``), and the rank goes on;
- ``graph_pool``: two CUDA graphs sharing one private pool (``torch.cuda.graph(pool=...)``) replay
  to eager's results; eager tensors made between replays stay intact and outside graph memory;
  ``reset()`` gives memory back;
- ``reduce_overhead``, ``reduce_overhead_training``: ``torch.compile(mode="reduce-overhead")``
  (CUDA graph trees) of a small MLP equal to eager, for inference (an eager tensor made between
  replays intact) and for SGD steps. On a plain module per rank, not on the DDP-wrapped model:
  graphs of a DDP module would capture its NCCL collectives, which is NCCL's and DDP's business,
  not the allocator's;
- ``mempool``: the MemPool route. Under PyTorch's modes, ``vt.use_pool("paged")`` serves a KV-cache
  tensor that an NCCL ``all_reduce`` then sums across ranks; under expandable segments PyTorch
  either turns them off in such a pool (recorded ``expandable_in_pool: off``) or refuses it with
  its own message (``refused by PyTorch``: releases before pytorch#169491), both recorded. Under
  a vmstoolkit allocator installed globally, ``use_pool`` is refused in one line, as documented.

The rank's exit status is non-zero when a check fails; ``torch.distributed.run``'s exit status
says the ranks ended cleanly. Rows go to ``DIR/train.jsonl``, one per (process, rank, strategy),
in the format ``experiments/pool_runs.py`` pools (``variant`` = ddp | fsdp2, ``mode``,
``step_times``), each with this call's ``call`` id; exit statuses to ``DIR/exits.jsonl``. At the
end the call's verdict (:func:`verdict`): every process exited 0, every rank reported both
strategies, every check passed, and each mode's losses are within ``--loss-tol`` of the first
mode's. It prints one line per (mode, strategy), then ``ddp_fsdp_gpu: PASSED ...`` (exit 0) or
``ddp_fsdp_gpu: FAILED: ...`` (exit 1) as the last line. Pool the step times of several calls:

    python experiments/pool_runs.py DIR/train.jsonl --variant fsdp2 --mode paged:aliases=true,slack_pages=64 --steps-per-round 4
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import allocator_mode, same_mode, split_modes
from vmstoolkit.errors import ConfigError

NATIVE_MODES = ("default", "expandable")  # the PyTorch modes this script runs; the others name vmstoolkit allocators
CHECKS = ("history", "fraction", "oom_text", "graph_pool", "reduce_overhead", "reduce_overhead_training", "mempool")
STRATEGIES = ("ddp", "fsdp2")
OOM_PREFIX = "CUDA out of memory. Tried to allocate"  # PyTorch's words, which accelerate, Lightning and the HF Trainer match
GiB = 1 << 30


def shapes(steps: int, seed: int = 0) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    return [(rng.choice([2, 4, 6, 8]), rng.choice([256, 384, 512, 768, 1024])) for _ in range(steps)]


def parse_checks(text: str) -> tuple[str, ...]:
    """``"all"``, ``"none"`` or names from :data:`CHECKS`, comma-separated; ConfigError naming an unknown one."""
    if text == "all":
        return CHECKS
    if text == "none":
        return ()
    names = tuple(t.strip() for t in text.split(",") if t.strip())
    for n in names:
        if n not in CHECKS:
            raise ConfigError(f"--checks: unknown check {n!r} (known: all, none, {', '.join(CHECKS)})")
    return names


# -- the checks, on one rank (torch imported by the worker) -------------------------------------------


def checks(torch, wrapped, ids, names, handle) -> dict:
    """The drop-in contract beyond DDP/FSDP2 on this rank: per check in ``names``, a dict with
    ``ok`` (and what it saw), or ``{"ok": False, "error": ...}`` when it raised."""
    import torch.distributed as dist

    out: dict = {}
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory

    def history():
        from torch.cuda import _memory_viz as viz

        from vmstoolkit.pools import make_allocator, make_driver
        from vmstoolkit.trace import load_trace
        from vmstoolkit.trace.replay import replay

        torch.cuda.memory._record_memory_history(max_entries=100_000, stacks="python")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            wrapped(input_ids=ids, labels=ids).loss.backward()
        keep = torch.empty(3 << 20, device="cuda")
        path = Path(tempfile.mkdtemp()) / "ddp-step.pickle"
        torch.cuda.memory._dump_snapshot(str(path))
        dev = torch.cuda.current_device()
        snap = torch.cuda.memory._snapshot()
        n_segments = len(torch.cuda.memory_snapshot())
        before = len(torch.cuda.memory._snapshot()["device_traces"][dev])
        torch.cuda.memory._record_memory_history(enabled=None)
        stopped = not torch._C._cuda_isHistoryEnabled()
        after = torch.empty(1 << 20, device="cuda")  # not recorded any more
        grew = len(torch.cuda.memory._snapshot()["device_traces"][dev]) > before
        del keep, after
        trace = snap["device_traces"][dev]
        loaded = load_trace(path, device=dev)
        r = replay(loaded, make_allocator("pytorch-caching", make_driver("sim")))
        viz_lines = len(viz.segsum(snap)) + len(viz.trace_plot(snap))
        res = {"events": len(trace), "with_frames": sum(1 for e in trace if e.get("frames")),
               "segments": len(snap["segments"]), "memory_snapshot": n_segments,
               "loaded_events": len(loaded.alloc_free_events()), "replay_oom": r.oom, "viz_chars": viz_lines,
               "stopped": stopped, "recorded_after_stop": grew}
        res["ok"] = (res["events"] > 10 and res["with_frames"] > 0 and res["memory_snapshot"] > 0
                     and res["loaded_events"] > 10 and not r.oom and viz_lines > 0 and stopped and not grew)
        return res

    def fraction():
        # the cap a little above what this rank holds now: PyTorch caps reserved bytes, vmstoolkit live ones
        base = max(torch.cuda.memory_reserved(), torch.cuda.memory_allocated())
        cap = base + 2 * GiB
        big = cap - torch.cuda.memory_allocated() + 2 * GiB  # past the cap under either rule
        frac = cap / total
        torch.cuda.set_per_process_memory_fraction(frac)
        res = {"fraction": round(frac, 4), "get": torch.cuda.get_per_process_memory_fraction()}
        try:
            try:
                torch.empty(big, dtype=torch.uint8, device="cuda").fill_(1)
                res["refused"] = False
            except torch.OutOfMemoryError as e:
                res["refused"], res["message"] = True, str(e)[:300]
            small = torch.ones(64 << 20, dtype=torch.uint8, device="cuda")  # 64 MiB: under the cap
            res["under_cap_served"] = bool((small == 1).all())
            del small
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0)
        lifted = torch.empty(big, dtype=torch.uint8, device="cuda")
        res["lifted_served"] = lifted.numel() == big
        del lifted
        res["ok"] = (res["refused"] and res["message"].startswith(OOM_PREFIX) and abs(res["get"] - frac) < 1e-6
                     and res["under_cap_served"] and res["lifted_served"])
        return res

    def oom_text():
        try:
            torch.empty(1 << 44, dtype=torch.uint8, device="cuda")  # 16 TiB
            return {"ok": False, "raised": "nothing"}
        except torch.OutOfMemoryError as e:
            msg = str(e)
        goes_on = torch.ones(1 << 20, device="cuda").sum().item() == float(1 << 20)
        return {"ok": msg.startswith(OOM_PREFIX) and goes_on, "message": msg[:200], "goes_on": goes_on}

    def graph_pool():
        lin = torch.nn.Linear(1024, 1024).cuda()
        x = torch.randn(128, 1024, device="cuda")
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):  # warm up on a side stream, as PyTorch's recipe does
            for _ in range(2):
                lin(x)
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        g1 = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g1):
            tmp = lin(x) * 3  # freed inside the capture: the pool's, not the program's
            y1 = (tmp + 1).relu()
            del tmp
        g2 = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g2, pool=g1.pool()):  # shares g1's pool
            y2 = lin(y1) - 1
        eager = [torch.full((128, 1024), 5.0, device="cuda") for _ in range(8)]  # between replays
        intact = True
        for _ in range(3):
            g1.replay()
            g2.replay()
            torch.cuda.synchronize()
            intact &= all(bool((e == 5).all()) for e in eager)
        ref1 = (lin(x) * 3 + 1).relu()
        equal = bool(torch.allclose(y1, ref1, atol=1e-3) and torch.allclose(y2, lin(ref1) - 1, atol=1e-3))
        overlap = bool({e.data_ptr() for e in eager} & {y1.data_ptr(), y2.data_ptr()})
        held = torch.cuda.memory_allocated()
        del y1, y2, eager, ref1
        g1.reset()
        g2.reset()
        torch.cuda.synchronize()
        given_back = held - torch.cuda.memory_allocated()
        return {"ok": equal and intact and not overlap and given_back > 0, "equal": equal, "eager_intact": intact,
                "eager_in_graph_memory": overlap, "given_back": given_back}

    def mlp(seed):
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256)).cuda()

    def reduce_overhead():
        m = mlp(0)
        fast = torch.compile(m, mode="reduce-overhead")
        equal, intact = [], True
        with torch.no_grad():
            for i in range(4):
                x = torch.randn(32, 256, device="cuda", generator=torch.Generator("cuda").manual_seed(i))
                y = fast(x).clone()
                keep = torch.full((1 << 18,), float(i), device="cuda")  # allocated between replays
                equal.append(bool(torch.allclose(y, m(x), atol=1e-3, rtol=1e-3)))
                equal.append(bool(torch.allclose(fast(x + 1).clone(), m(x + 1), atol=1e-3, rtol=1e-3)))
                intact &= bool((keep == i).all())
        return {"ok": all(equal) and intact, "equal": equal, "eager_intact": intact}

    def reduce_overhead_training():
        def run(compiled):
            m = mlp(1)
            opt = torch.optim.SGD(m.parameters(), lr=1e-2)
            f = torch.compile(m, mode="reduce-overhead") if compiled else m
            losses = []
            for i in range(4):
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
        return {"ok": diff < 1e-3 and all(abs(a - b) < 1e-3 for a, b in zip(el, cl)), "max_param_diff": diff}

    def mempool():
        import vmstoolkit.integrations.torch as vt
        from vmstoolkit.errors import IntegrationError

        if handle is not None:  # installed globally: the route is refused, in one line
            try:
                with vt.use_pool("paged"):
                    pass
                return {"ok": False, "refused": False}
            except IntegrationError as e:
                return {"ok": "\n" not in str(e) and handle.allocator_name in str(e), "refused": str(e)[:200]}
        res: dict = {"expandable_in_pool": None}
        world, rank = dist.get_world_size(), dist.get_rank()
        try:
            with vt.use_pool("paged") as pool:
                kv = torch.full((16, 1 << 20), float(rank + 1), device="cuda")  # a KV cache's 64 MiB
        except RuntimeError as e:
            if "MemPool doesn't currently support expandable_segments" in str(e):  # PyTorch's own refusal
                return {"ok": "expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
                        "expandable_in_pool": "refused by PyTorch", "message": str(e)[:200]}
            raise
        if "expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
            res["expandable_in_pool"] = "off"
        in_pool = any(seg.get("segment_pool_id") == pool.id and seg["address"] <= kv.data_ptr() < seg["address"] + seg["total_size"]
                      for seg in torch.cuda.memory_snapshot())
        dist.all_reduce(kv)  # NCCL over memory from the pool
        torch.cuda.synchronize()
        want = world * (world + 1) / 2
        h, dev = pool.vmstoolkit, torch.cuda.current_device()
        res.update(in_pool=in_pool, values=bool((kv == want).all()),
                   from_vmstoolkit=h.memory_stats(dev)["allocated_bytes.all.current"])
        del kv, pool
        torch.cuda.empty_cache()
        res["from_vmstoolkit_after_empty_cache"] = h.memory_stats(dev)["allocated_bytes.all.current"]  # the pool gone: 0
        res["ok"] = res["in_pool"] and res["values"] and res["from_vmstoolkit"] >= 64 << 20
        return res

    table = {"history": history, "fraction": fraction, "oom_text": oom_text, "graph_pool": graph_pool,
             "reduce_overhead": reduce_overhead, "reduce_overhead_training": reduce_overhead_training, "mempool": mempool}
    for name in names:
        try:
            out[name] = table[name]()
        except Exception as e:  # noqa: BLE001 - recorded as a failed check, the rank goes on
            out[name] = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:300]}"}
    return out


def worker(args) -> int:
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
    names = parse_checks(args.checks)
    rows = []
    for strategy in STRATEGIES:
        tracing = args.trace_fsdp2 and strategy == "fsdp2"
        if tracing:
            torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
        torch.manual_seed(0)
        with torch.device("cuda", local):  # weights made on the GPU: seconds, not a CPU init of 0.5 B parameters
            model = OPTForCausalLM(cfg)
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
        rows.append({"call": args.call, "repeat": args.repeat, "variant": strategy, "mode": mode, "rank": rank,
                     "world_size": dist.get_world_size(), "warmup": args.warmup, "step_times": times, "losses": losses,
                     "peak_reserved": torch.cuda.max_memory_reserved(), "peak_allocated": torch.cuda.max_memory_allocated(),
                     "shim": handle.raises if handle else None, "torch": torch.__version__})
        if tracing:
            traces = args.out / "traces"
            traces.mkdir(exist_ok=True)
            safe = "".join(c if c.isalnum() else "_" for c in mode)
            torch.cuda.memory._dump_snapshot(str(traces / f"fsdp2-{safe}-rank{rank}-repeat{args.repeat}.pickle"))
            torch.cuda.memory._record_memory_history(enabled=None)
        if strategy == "ddp" and names:
            rows[-1]["checks"] = checks(torch, wrapped, ids, names, handle)
        del wrapped, model, opt, loss
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    all_rows = [None] * dist.get_world_size()
    dist.all_gather_object(all_rows, rows)
    if rank == 0:  # one append of the whole text: processes run side by side (--parallel) do not interleave
        text = "".join(json.dumps(r) + "\n" for per_rank in all_rows for r in per_rank)
        with open(args.out / "train.jsonl", "ab", buffering=0) as f:
            f.write(text.encode())
    dist.destroy_process_group()
    failed = [n for r in rows for n, c in (r.get("checks") or {}).items() if not c.get("ok")]
    if failed:
        print(f"ddp_fsdp_gpu: rank {rank} mode {mode}: check(s) failed: {', '.join(failed)}", file=sys.stderr, flush=True)
        return 3
    return 0


# -- the verdict, on any machine --------------------------------------------------------------------------


def cause(log: str) -> str:
    """The first line of a failed process's log that says why: a rank's failed checks, or the
    first exception a rank raised (not the launcher's own ``ChildFailedError`` that follows)."""
    for line in log.splitlines():
        line = line.strip()
        if line.startswith("ddp_fsdp_gpu: rank "):
            return line
    for line in log.splitlines():
        head = line.strip().split(":", 1)[0]
        if (head.endswith(("Error", "Exception")) and " " not in head and "ChildFailedError" not in head
                and not line.startswith(" ")):
            return line.strip()[:300]
    return ""


def _median_steady(rows: list[dict]) -> float | None:
    steps = [t for r in rows for t in r["step_times"][r.get("warmup", 0):]]
    return statistics.median(steps) if steps else None


def verdict(rows: list[dict], exits: list[dict], modes: list[str], world_size: int, repeats: int,
            checks_asked: tuple[str, ...], loss_tol: float) -> tuple[list[str], list[str]]:
    """``(lines, failures)`` of one call: a line per (mode, strategy): peak reserved (the highest
    over ranks and repeats), median steady step and its ratio to ``default``'s, losses' largest
    distance from the first mode's, checks passed; and one entry per failure (a process that
    exited non-zero, a (repeat, rank, strategy) row missing, a failed check, losses past
    ``loss_tol``)."""
    failures: list[str] = []
    for e in exits:
        if e["returncode"]:
            why = f" ({e['cause']})" if e.get("cause") else ""
            failures.append(f"{e['mode']} repeat {e['repeat']}: exit status {e['returncode']}{why}")
    good = [r for r in rows if "error" not in r]
    lines = []
    first = modes[0] if modes else None
    for mode in modes:
        mine = [r for r in good if same_mode(r["mode"], mode, NATIVE_MODES)]
        for rep in range(repeats):
            for rank in range(world_size):
                for strategy in STRATEGIES:
                    if not any(r["repeat"] == rep and r["rank"] == rank and r["variant"] == strategy for r in mine):
                        failures.append(f"{mode} repeat {rep} rank {rank} {strategy}: no result")
        for r in mine:
            for name in checks_asked if r["variant"] == "ddp" else ():
                c = (r.get("checks") or {}).get(name)
                if c is None:
                    failures.append(f"{mode} repeat {r['repeat']} rank {r['rank']}: check {name} did not run")
                elif not c.get("ok"):
                    detail = c.get("error") or json.dumps({k: v for k, v in c.items() if k != "ok"})[:200]
                    failures.append(f"{mode} repeat {r['repeat']} rank {r['rank']}: check {name} failed: {detail}")
        for strategy in STRATEGIES:
            these = [r for r in mine if r["variant"] == strategy]
            if not these:
                continue
            med = _median_steady(these)
            base = _median_steady([r for r in good if r["mode"] == "default" and r["variant"] == strategy])
            ratio = f" ({med / base:.3f}x default)" if med and base and mode != "default" else ""
            ref = {(r["repeat"], r["rank"]): r["losses"] for r in good
                   if same_mode(r["mode"], first, NATIVE_MODES) and r["variant"] == strategy}
            dist_ = max((abs(a - b) for r in these for a, b in zip(r["losses"], ref.get((r["repeat"], r["rank"]), []))),
                        default=0.0)
            if dist_ > loss_tol:
                failures.append(f"{mode} {strategy}: losses {dist_:.3g} from {first}'s (tolerance {loss_tol})")
            extras = [e for r in these for e in [((r.get("checks") or {}).get("mempool") or {}).get("expandable_in_pool")] if e]
            n_ok = sum(1 for r in these for c in (r.get("checks") or {}).values() if c.get("ok"))
            n_all = sum(len(r.get("checks") or {}) for r in these)
            lines.append(f"{mode:36s} {strategy:5s} peak reserved {max(r['peak_reserved'] for r in these) / GiB:6.2f} GiB"
                         f"  median step {med:.4f} s{ratio}  losses within {dist_:.2g} of {first}"
                         + (f"  checks {n_ok}/{n_all} passed" if n_all else "")
                         + (f"  expandable in the MemPool: {extras[0]}" if extras else ""))
    return lines, failures


def report(lines: list[str], failures: list[str], what: str) -> int:
    """Print ``lines``, every failure, and the one-line result last; the exit status."""
    for line in lines:
        print(line)
    for f in failures:
        print(f"  failure: {f}")
    if failures:
        more = f" (and {len(failures) - 1} more above)" if len(failures) > 1 else ""
        print(f"ddp_fsdp_gpu: FAILED: {failures[0]}{more}", flush=True)
        return 1
    print(f"ddp_fsdp_gpu: PASSED: {what}", flush=True)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--modes", default="default,expandable,paged:aliases=true,slack_pages=64",
                    help="PyTorch's default and expandable modes, or vmstoolkit allocators as NAME:KEY=VALUE,...")
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--gpus", type=int, default=2, help="ranks per process (1: world size 1 on one GPU)")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--parallel", type=int, default=1, help="modes run at once within a repeat (timings then not for pooling)")
    ap.add_argument("--checks", default="all", help=f"all, none, or some of {','.join(CHECKS)}")
    ap.add_argument("--no-checks", dest="checks", action="store_const", const="none", help="the same as --checks none")
    ap.add_argument("--loss-tol", type=float, default=0.05, help="largest distance of a mode's losses from the first mode's")
    ap.add_argument("--summary-of", type=Path, default=None, metavar="TRAIN_JSONL",
                    help="no runs: the verdict of the rows already there (exits.jsonl beside it), for --modes, --gpus, --repeats")
    ap.add_argument("--trace-fsdp2", action="store_true", help="record PyTorch's memory history of each FSDP2 run "
                    "(model made, every step) and dump it to OUT/traces/fsdp2-MODE-rankR-repeatN.pickle, for a replay "
                    "through every allocator on the CPU (vmstoolkit compare): issue 34's FSDP2 peaks")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    ap.add_argument("--call", default="", help=argparse.SUPPRESS)
    ap.add_argument("--repeat", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    try:
        names = parse_checks(args.checks)
        modes = split_modes(args.modes)
        for mode in modes:
            allocator_mode(mode, NATIVE_MODES)
    except ConfigError as e:
        ap.error(str(e))
    for flag, value, least in (("--repeats", args.repeats, 1), ("--gpus", args.gpus, 1), ("--parallel", args.parallel, 1),
                               ("--steps", args.steps, 1), ("--warmup", args.warmup, 0)):
        if value < least:
            ap.error(f"{flag} must be at least {least}, got {value}")
    if not modes:
        ap.error("--modes names no mode")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.worker:
        return worker(args)
    if args.summary_of is not None:
        rows = [json.loads(x) for x in args.summary_of.read_text().splitlines() if x.strip()]
        ex = args.summary_of.with_name("exits.jsonl")
        exits = [json.loads(x) for x in ex.read_text().splitlines() if x.strip()] if ex.exists() else []
        call = next((r.get("call") for r in reversed(rows) if r.get("call")), None)  # the last call in the file
        rows = [r for r in rows if r.get("call") == call]
        exits = [e for e in exits if e.get("call") == call]
        lines, failures = verdict(rows, exits, modes, args.gpus, args.repeats, names, args.loss_tol)
        return report(lines, failures, f"call {call}: {len(modes)} modes x {args.repeats} repeats x {args.gpus} ranks")
    call = time.strftime("%Y%m%dT%H%M%S") + f"-{os.getpid()}"
    t_start = time.perf_counter()
    for rep in range(args.repeats):
        pending = list(modes)
        while pending:
            batch, pending = pending[:args.parallel], pending[args.parallel:]
            procs = []
            logs = args.out / "logs"
            logs.mkdir(exist_ok=True)
            for mode in batch:
                cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.gpus}",
                       __file__, "--worker", "--mode", mode, "--out", str(args.out), "--steps", str(args.steps),
                       "--warmup", str(args.warmup), "--checks", ",".join(names) or "none", "--call", call,
                       "--repeat", str(rep)] + (["--trace-fsdp2"] if args.trace_fsdp2 else [])
                log = logs / f"{call}-repeat{rep}-{len(procs)}.log"  # a file each: no pipe to fill while another runs
                with open(log, "w") as f:
                    procs.append((mode, log, time.perf_counter(), subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)))
            while procs:
                done = [x for x in procs if x[3].poll() is not None]
                if not done:
                    time.sleep(0.5)
                    continue
                mode, log, t0, p = done[0]
                procs.remove(done[0])
                err = log.read_text(errors="replace")
                print(f"repeat {rep} {mode}: exit status {p.returncode} in {time.perf_counter() - t0:.0f} s ({log})", flush=True)
                exit_row = {"call": call, "repeat": rep, "mode": mode, "returncode": p.returncode}
                if p.returncode:
                    exit_row["cause"] = cause(err)
                    print(err[-2500:], flush=True)
                with open(args.out / "exits.jsonl", "a") as f:  # status 0: every rank ended cleanly
                    f.write(json.dumps(exit_row) + "\n")
                if p.returncode:
                    with open(args.out / "train.jsonl", "a") as f:
                        f.write(json.dumps({"call": call, "repeat": rep, "mode": mode, "error": err[-800:]}) + "\n")
    rows = [json.loads(x) for x in (args.out / "train.jsonl").read_text().splitlines() if x.strip()] \
        if (args.out / "train.jsonl").exists() else []
    exits = [json.loads(x) for x in (args.out / "exits.jsonl").read_text().splitlines() if x.strip()]
    lines, failures = verdict([r for r in rows if r.get("call") == call], [e for e in exits if e.get("call") == call],
                              modes, args.gpus, args.repeats, names, args.loss_tol)
    return report(lines, failures, f"call {call}: {len(modes)} modes x {args.repeats} repeats x {args.gpus} ranks, "
                                   f"{len(names)} checks a rank, in {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    sys.exit(main())

"""A user's own checkpoint on the H200 (issue 32): ``vmstoolkit run generate|train`` beside the
baselines a user would pick instead, at the same budgets, on the same checkpoint, in one call.

    # 1. random-weight checkpoints saved by transformers (on the GPU machine; minutes, ~14 GB each)
    python experiments/run_model_gpu.py make-checkpoints --out /tmp/ckpt
    # 2. generation: ours, accelerate's device_map offload and its cpu_offload
    python experiments/run_model_gpu.py generate --model /tmp/ckpt/llama-7b-shape --out OUT
        [--baselines "accelerate device_map"] [--new-tokens 16] [--fractions 1 0.5]
    # 3. training: ours (full or LoRA), FSDP2 + CPUOffloadPolicy (world size 1), eager save_on_cpu
    python experiments/run_model_gpu.py train --model /tmp/ckpt/llama-13b-width --variant full --out OUT
    # CPU rehearsal of every path (tiny checkpoint, sim backend, baselines on the CPU where they can):
    python experiments/run_model_gpu.py all --dry-run --out /tmp/dry

Budgets: fractions (default 1, 1/2, 1/4, 1/8) of our plan's no-offload working set, resolved to
bytes once; every baseline gets the same bytes, enforced with
``torch.cuda.set_per_process_memory_fraction`` (and, for accelerate's ``device_map``, as
``max_memory[0]``). A baseline that cannot run at a budget gives a row with ``error``.

Each measurement is a JSON line in ``<out>/run_model.jsonl`` (``kind``: ``ours``, ``accelerate
device_map``, ``accelerate cpu_offload``, ``fsdp2 cpu offload``, ``eager save_on_cpu``; the
budget, step or prefill/decode seconds, tokens where generated, peak GPU bytes, host RSS at the
end ``rss_bytes`` beside our plan's ``host_plan_bytes``); ``<out>/summary.json`` puts them side
by side. Baselines run in their own processes (a fresh CUDA context and host RSS each).

The loss of the training baselines is ours: ``sum(blocks(embed(ids)) * dout)`` with the ids and
``dout`` that ``vmstoolkit.exec.model.train`` draws from the seed, the embedding, final norm and
head frozen; AdamW with our hyper-parameters. Our rows run that loss too (``run_train(loss="dot")``;
``vmstoolkit run train`` itself runs the causal-LM loss, whose head and cross-entropy add a
(seq, vocab) GEMM pair and logits the baselines do not have).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {  # LLaMA-2-7B widths (16 of its 32 blocks by default, as the project's other 7B runs), and the 13B width of issue 32
    "llama-7b-shape": dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=32, intermediate_size=11008,
                           num_hidden_layers=16, vocab_size=32000),
    "llama-13b-width": dict(hidden_size=5120, num_attention_heads=40, num_key_value_heads=8, intermediate_size=13824,
                            num_hidden_layers=12, vocab_size=32000),
}
TINY = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, num_hidden_layers=2,
            vocab_size=128)
FRACTIONS = (1.0, 0.5, 0.25, 0.125)
BASELINES = ("accelerate device_map", "accelerate cpu_offload", "fsdp2 cpu offload", "eager save_on_cpu")
DEVICE_MAP_SHARES = (0.9, 0.75, 0.6, 0.45, 0.3, 0.15)  # of the budget, for accelerate's max_memory[0]


def rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rss_split() -> dict[str, int]:
    """The process's resident memory now, anonymous apart from file-backed: a memory-mapped
    checkpoint's pages count in ``rss_bytes`` (the peak) but are the page cache's, reclaimable,
    and not part of the host plan (H200 call 1: peak RSS was the plan plus the checkpoint's size)."""
    out = {}
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            key, _, val = line.partition(":")
            if key in ("RssAnon", "RssFile", "RssShmem"):
                out[f"{key[3:].lower()}_rss_bytes"] = int(val.split()[0]) * 1024
    except OSError:
        pass
    return out


def emit(out: Path, row: dict) -> None:
    row = {"t": time.strftime("%H:%M:%S"), **row}
    with (out / "run_model.jsonl").open("a") as f:
        f.write(json.dumps(row, default=str) + "\n")
    print(json.dumps({k: (v if not isinstance(v, list) or len(v) < 12 else f"[{len(v)} items]")
                      for k, v in row.items() if k != "traceback"}, default=str), flush=True)


# ---- checkpoints -----------------------------------------------------------------------------


def make_checkpoints(a) -> list[Path]:
    import torch
    import transformers

    dev = "cuda" if torch.cuda.is_available() and not a.dry_run else "cpu"
    shapes = {"tiny-llama": TINY} if a.dry_run else {k: SHAPES[k] for k in a.shapes}
    made = []
    for name, shape in shapes.items():
        shape = dict(shape)
        if name == "llama-7b-shape" and a.blocks_7b:
            shape["num_hidden_layers"] = a.blocks_7b
        cfg = transformers.LlamaConfig(**shape, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
                                       max_position_embeddings=4096, bos_token_id=None, eos_token_id=None,
                                       pad_token_id=None)
        t0 = time.perf_counter()
        torch.manual_seed(a.seed)
        with torch.device(dev):
            model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        d = a.out / name
        model.save_pretrained(d, safe_serialization=True, max_shard_size="4GB")
        del model
        if dev == "cuda":
            torch.cuda.empty_cache()
        size = sum(p.stat().st_size for p in d.glob("*.safetensors"))
        print(json.dumps({"checkpoint": str(d), "bytes": size, "seconds": round(time.perf_counter() - t0, 1),
                          "device": dev, **shape}), flush=True)
        made.append(d)
    return made


# ---- ours ------------------------------------------------------------------------------------


def ours_generate(a, out) -> tuple[list[int], dict[str, int], list[int]]:
    from vmstoolkit.exec.model.generate import run_generate
    from vmstoolkit.exec.model.progress import Stages

    t0 = time.perf_counter()
    rows = run_generate(a.model, prompt_len=a.prompt_len, new_tokens=a.new_tokens, budgets=[str(f) for f in a.fractions],
                        backend="sim" if a.dry_run else "cuda", numerics=True, seed=a.seed, stages=Stages(True))
    budgets, ids, first = {}, None, None
    for r in rows:
        first = first or time.perf_counter() - t0
        r.pop("prefill_logits", None)
        emit(out, {"kind": "ours", "time_to_first_row_s": first, "rss_bytes": rss(), **rss_split(), **r})
        budgets[r["budget_spec"]] = r["budget"]
        ids = r["prompt_ids"]
    return ids, budgets, []


def ours_train(a, out) -> dict[str, int]:
    from vmstoolkit.exec.model.progress import Stages
    from vmstoolkit.exec.model.train import run_train

    t0 = time.perf_counter()
    budgets, first = {}, None
    for r in run_train(a.model, variant=a.variant, budgets=[str(f) for f in a.fractions], seq=a.seq, steps=a.steps,
                       rank=a.rank, backend="sim" if a.dry_run else "cuda", executors=("event-driven", "fixed-order"),
                       seed=a.seed, stages=Stages(True), loss="dot"):  # the baselines' loss (module docstring)
        first = first or time.perf_counter() - t0
        emit(out, {"kind": "ours", "time_to_first_row_s": first, "rss_bytes": rss(), **rss_split(), **r})
        budgets[r["budget_spec"]] = r["budget"]
    return budgets


# ---- baselines, each in a process of its own (--baseline NAME) ---------------------------------


def _limit(torch, budget: int) -> None:
    if torch.cuda.is_available():
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total))
        torch.cuda.reset_peak_memory_stats()


def accelerate_generate(a) -> dict:
    """Greedy generation with accelerate's offload: ``device_map`` (weights placed on the GPU up
    to the budget, the rest on the CPU, moved per module) or ``cpu_offload`` (every weight on the
    CPU, streamed to the GPU at each use)."""
    import torch
    import transformers

    torch.backends.cuda.matmul.allow_tf32 = False
    cuda = torch.cuda.is_available() and not a.dry_run
    _limit(torch, a.budget) if cuda else None
    ids = torch.tensor([json.loads(a.prompt_ids)])
    if a.baseline == "accelerate-device-map":
        # max_memory[0] is the weights' share of the GPU, not the process's: at max_memory[0] = budget the
        # weights fill the budget and the first activation is out of memory (H200 call 1). A user lowers it
        # until generation runs; so does this, in steps, under the same cap, and the row says where it ran.
        last = None
        for share in (DEVICE_MAP_SHARES if cuda else (1.0,)):
            mm = {0: int(a.budget * share), "cpu": 2**40} if cuda else {"cpu": 2**40}
            try:
                model = transformers.AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32,
                                                                          device_map="auto", max_memory=mm)
                return {**_generate_timed(a, torch, model, ids, cuda), "weights_share": share,
                        "max_memory_gpu": mm.get(0)}
            except torch.OutOfMemoryError as e:
                last = f"at weights_share {share}: {e}"  # the text only: the traceback would keep the model alive
            model = None
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        raise torch.OutOfMemoryError(last)
    else:
        from accelerate import cpu_offload

        model = transformers.AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
        if cuda:
            cpu_offload(model, execution_device=torch.device("cuda", 0))
    return _generate_timed(a, torch, model, ids, cuda)


def _generate_timed(a, torch, model, ids, cuda) -> dict:
    """One warm-up token, the best of two one-token runs as prefill, then ``a.new_tokens``."""
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    ids = ids.to(dev)
    kw = dict(do_sample=False, num_beams=1, pad_token_id=0, eos_token_id=None)

    def timed(n):
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.no_grad():
            seq = model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t, seq[0, ids.shape[1]:].tolist()

    timed(1)  # warm-up
    prefill = min(timed(1)[0] for _ in range(2))
    total, tokens = timed(a.new_tokens)
    decode = total - prefill
    return {"prefill_s": prefill, "decode_s": decode, "makespan_s": total, "tokens": tokens,
            "prefill_tokens_per_s": ids.shape[1] / prefill,
            "decode_tokens_per_s": (a.new_tokens - 1) / decode if decode > 0 else None,
            "peak_bytes": torch.cuda.max_memory_allocated() if cuda else None}


def _train_inputs(a):
    """The ids and dout of our training step (vmstoolkit.exec.model.train), and our AdamW."""
    from vmstoolkit.exec.model import load_model
    from vmstoolkit.exec.model.train import train_config, train_token_ids, train_values
    from vmstoolkit.exec.train_graph import build_train_step

    ckpt = load_model(a.model)
    tg = build_train_step(train_config(ckpt, a.seq), a.variant, rank=a.rank)
    ids = train_token_ids(ckpt, a.seq, a.seed)
    values = train_values(ckpt, tg, ids, seed=a.seed)
    return ids, values[tg.dout], tg.adamw


def fsdp2_train(a) -> dict:
    """Full fine-tuning of the blocks with FSDP2 (``fully_shard`` per decoder layer and the root)
    and ``CPUOffloadPolicy(pin_memory=True)`` at world size 1: parameters, gradients and AdamW
    state live on the CPU, the optimizer steps there, each layer's parameters are copied to the
    GPU for its forward and backward."""
    import torch
    import torch.distributed as dist
    import transformers
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    torch.backends.cuda.matmul.allow_tf32 = False
    cuda = torch.cuda.is_available() and not a.dry_run
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    if cuda:
        torch.cuda.set_device(0)
        _limit(torch, a.budget)
    ids, dout, opt_cfg = _train_inputs(a)
    model = transformers.AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    for p in model.parameters():
        p.requires_grad_(False)
    for p in model.model.layers.parameters():
        p.requires_grad_(True)
    policy = {"offload_policy": CPUOffloadPolicy(pin_memory=True)} if cuda else {}  # CPU rehearsal: no offload
    for layer in model.model.layers:
        fully_shard(layer, **policy)
    fully_shard(model.model, **policy)  # the root we call: the LM head takes no part in our loss
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    for mod in model.modules():  # buffers (the rotary table) are not FSDP's: they must sit where the compute is
        for bname, buf in list(mod._buffers.items()):
            if buf is not None:
                mod._buffers[bname] = buf.to(dev)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=opt_cfg.lr,
                            betas=(opt_cfg.beta1, opt_cfg.beta2), eps=opt_cfg.eps, weight_decay=opt_cfg.weight_decay)
    captured = {}
    model.model.layers[-1].register_forward_hook(
        lambda m, i, o: captured.__setitem__("h", o[0] if isinstance(o, tuple) else o))
    ids_t = torch.tensor([ids.tolist()], device=dev)
    dout_t = torch.from_numpy(dout).to(dev)
    times = []
    for _ in range(a.steps):
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        model.model(input_ids=ids_t)
        (captured["h"].reshape(dout_t.shape) * dout_t).sum().backward()
        opt.step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    dist.destroy_process_group()
    steady = times[1:] or times
    return {"step_s": sum(steady) / len(steady), "steps_s": times,
            "peak_bytes": torch.cuda.max_memory_allocated() if cuda else None}


def run_baseline(a, out, name: str, budget_spec: str, budget: int, extra: list[str]) -> None:
    row = {"kind": name, "budget_spec": budget_spec, "budget": budget, "model": str(a.model)}
    if name == "eager save_on_cpu":
        cmd = [sys.executable, str(ROOT / "experiments" / "train_offload_gpu.py"), "--torch-only", "--model",
               str(a.model), "--variant", a.variant, "--budget", str(budget), "--seq", str(a.seq), "--rank",
               str(a.rank), "--seed", str(a.seed), "--repeats", str(a.steps), "--out", str(out), "--npz",
               f"/tmp/eager_{a.variant}_{budget}_{os.getpid()}.npz"]  # its gradients: GBs, not results
    else:
        cmd = [sys.executable, __file__, "baseline", "--baseline", name.replace(" ", "-").replace("_", "-"),
               "--model", str(a.model), "--budget", str(budget), "--out", str(out), "--seed", str(a.seed),
               *(["--dry-run"] if a.dry_run else []), *extra]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        if proc.returncode != 0 or not lines:
            row["error"] = (proc.stderr or proc.stdout)[-1500:]
        else:
            row.update(json.loads(lines[-1]))
    except subprocess.TimeoutExpired:
        row["error"] = f"timed out after {a.timeout} s"
    row["wall_s"] = time.perf_counter() - t0
    if name == "eager save_on_cpu":
        Path(cmd[-1]).unlink(missing_ok=True)
    emit(out, row)


def summarize(out: Path) -> None:
    rows = [json.loads(ln) for ln in (out / "run_model.jsonl").read_text().splitlines()]
    side: dict = {}
    for r in rows:
        key = f"{r.get('budget_spec')} ({r.get('budget')} B)"
        what = r["kind"] + (f" {r['executor']}" if r.get("executor") and r["kind"] == "ours" and "step_s" in r else "")
        side.setdefault(key, {})[what] = r.get("error", "")[:120] or {
            k: r.get(k) for k in ("step_s", "prefill_s", "decode_s", "decode_tokens_per_s", "peak_bytes",
                                  "host_plan_bytes", "rss_bytes") if r.get(k) is not None}
    ours_tokens = {r["budget_spec"]: r.get("tokens") for r in rows if r["kind"] == "ours" and "tokens" in r}
    agree = {f"{r['kind']} {r['budget_spec']}": r["tokens"] == ours_tokens.get(r["budget_spec"])
             for r in rows if r["kind"].startswith("accelerate") and "tokens" in r}
    (out / "summary.json").write_text(json.dumps({"command": " ".join(sys.argv), "side_by_side": side,
                                                  "tokens_equal_ours": agree}, indent=1))
    print(json.dumps(agree))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["make-checkpoints", "generate", "train", "all", "baseline"])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", type=Path, help="checkpoint folder (default in 'all': made by make-checkpoints)")
    ap.add_argument("--dry-run", action="store_true", help="CPU: a tiny checkpoint, the sim backend, baselines on the CPU")
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--blocks-7b", type=int, default=None, help="blocks of the 7B-shaped checkpoint (default 16)")
    ap.add_argument("--fractions", type=float, nargs="+", default=list(FRACTIONS))
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--variant", default="full", choices=["lora", "full"])
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--baselines", nargs="+", default=list(BASELINES), choices=list(BASELINES),
                    help="the baselines to run beside ours (default: all that apply)")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per baseline process")
    ap.add_argument("--baseline", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--budget", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--prompt-ids", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    if a.dry_run:
        a.prompt_len, a.new_tokens, a.seq, a.steps, a.rank = min(a.prompt_len, 16), min(a.new_tokens, 4), min(a.seq, 16), min(a.steps, 2), min(a.rank, 4)
    if a.what == "baseline":
        res = accelerate_generate(a) if a.baseline.startswith("accelerate") else fsdp2_train(a)
        print(json.dumps({**res, "rss_bytes": rss(), **rss_split()}, default=str), flush=True)
        return 0
    if a.what in ("make-checkpoints", "all"):
        made = make_checkpoints(a)
        if a.what == "make-checkpoints":
            return 0
    models = [a.model] if a.model else made
    for model in models:
        a.model = model
        if a.what in ("generate", "all"):
            ids, budgets, _ = ours_generate(a, a.out)
            for spec, b in budgets.items():
                for name in [n for n in BASELINES[:2] if n in a.baselines]:
                    run_baseline(a, a.out, name, spec, b, ["--prompt-ids", json.dumps(ids), "--new-tokens",
                                                             str(a.new_tokens)])
        if a.what in ("train", "all"):
            budgets = ours_train(a, a.out)
            for spec, b in budgets.items():
                extra = ["--seq", str(a.seq), "--steps", str(a.steps), "--variant", a.variant, "--rank", str(a.rank)]
                if a.variant == "full" and "fsdp2 cpu offload" in a.baselines:
                    run_baseline(a, a.out, "fsdp2 cpu offload", spec, b, extra)
                if not a.dry_run and "eager save_on_cpu" in a.baselines:  # the eager baseline needs a GPU
                    run_baseline(a, a.out, "eager save_on_cpu", spec, b, extra)
    summarize(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``vmstoolkit experiment train-offload``: a training step (LoRA or full fine-tuning) of a LLaMA
stack under GPU memory budgets, for a fixed or a changing sequence length."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from vmstoolkit.cli.common import Backend, OutputFormat, emit_rows, fail, host_budget_option
from vmstoolkit.cli.flags import format_flag


class Variant(str, Enum):
    lora = "lora"
    full = "full"


def _seq_range(value: str | None) -> tuple[int, int] | None:
    if value is None:
        return None
    a, sep, b = value.partition(":")
    try:
        lo, hi = int(a), int(b)
    except ValueError:
        lo = hi = -1
    if not sep or not 0 < lo <= hi:
        fail(f"--seq-range takes A:B with 0 < A <= B, got {value!r}", code=2)
    return lo, hi


def train_offload_command(
    backend: Annotated[Backend, typer.Option("--backend", metavar="sim|cuda", help="Executor: 'sim' (discrete-event simulation on the CPU, default) or 'cuda' (the GPU).")] = Backend.sim,
    variant: Annotated[Variant, typer.Option(help="lora: frozen base weights, trained adapters; full: every weight trained.")] = Variant.lora,
    budget: Annotated[list[str] | None, typer.Option(metavar="SIZE|FRACTION", help="GPU budget: a size (24GiB) or a fraction of the no-offload working set (0.5); repeat for several.")] = None,
    seq: Annotated[int | None, typer.Option(min=1, help="Fixed sequence length (batch 1); default 2048.")] = None,
    seq_range: Annotated[str | None, typer.Option(help="A:B, a new length drawn uniformly in [A, B] every step.")] = None,
    steps: Annotated[int | None, typer.Option(min=1, help="Steps (default 3 with --seq, 100 with --seq-range).")] = None,
    format: Annotated[OutputFormat, format_flag()] = OutputFormat.table,
    blocks: Annotated[int, typer.Option(min=1, help="LLaMA decoder blocks.")] = 16,
    hidden: Annotated[int, typer.Option(min=8, help="Hidden size.")] = 4096,
    heads: Annotated[int, typer.Option(min=1, help="Attention heads.")] = 32,
    kv_heads: Annotated[int | None, typer.Option(min=1, help="Key/value heads (default: heads).")] = None,
    ffn: Annotated[int, typer.Option(min=1, help="FFN width.")] = 11008,
    rank: Annotated[int, typer.Option(min=1, help="LoRA rank.")] = 16,
    check_grads: Annotated[bool | None, typer.Option("--check-grads/--no-check-grads", help="Compare gradients with the reference (default: on cuda, and on sim for small models).")] = None,
    seed: Annotated[int, typer.Option(help="Seed of the values, the lengths and the simulated jitter.")] = 0,
    recompute: Annotated[bool, typer.Option("--recompute/--no-recompute", help="Drop RMSNorm and SwiGLU outputs under memory pressure and rerun them before their backward use, instead of offloading them.")] = False,
    host_budget: Annotated[str | None, typer.Option("--host-budget", metavar="SIZE", help="Host memory the run may use (default: available RAM less max(10%, 2 GiB)); 'none' turns the check off. A plan above it is refused before anything is allocated.", show_default=False)] = None,
    schedule: Annotated[Path | None, typer.Option(help="Folder for each budget's schedule of the last step, both executors one above the other (schedule_<bytes>B.png and .json); on cuda every vertex is timed with CUDA events.")] = None,
) -> None:
    """Run a training step at each budget with the event-driven and the fixed-order executors;
    report step time against its lower bound, bytes moved, planning time and gradient error.
    With --seq-range, plans are cached by length bucket (padding within a bucket)."""
    from vmstoolkit.exec.graph import LlamaConfig
    from vmstoolkit.exec.train_experiment import run_train_experiment

    rng = _seq_range(seq_range)
    if seq is not None and rng is not None:
        fail("give --seq or --seq-range, not both", code=2)
    cfg = LlamaConfig(n_blocks=blocks, hidden=hidden, heads=heads, kv_heads=kv_heads or heads, ffn=ffn)
    rows = run_train_experiment(backend.value, variant.value, tuple(budget or ("0.5", "0.25")), config=cfg,
                                seq=seq, seq_range=rng, steps=steps, rank=rank, seed=seed,
                                check_grads=check_grads, recompute=recompute, schedule_dir=schedule,
                                host_budget=host_budget_option(host_budget))
    emit_rows(rows, format, _table)


def _table(rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="train-offload: one training step under a GPU budget")
    for c in ("budget GiB", "variant", "executor", "step s", "lower bound s", "ratio", "offloaded GiB",
              "reloaded GiB", "plan s/step", "max |grad err|"):
        t.add_column(c, justify="right")
    for r in rows:
        err = "-" if r["max_abs_grad_err"] is None else f"{r['max_abs_grad_err']:.2e}"
        t.add_row(f"{r['budget'] / 2**30:.2f}", r["variant"], r["executor"], f"{r['step_s']:.4f}",
                  f"{r['lower_bound_s']:.4f}", f"{r['step_s'] / r['lower_bound_s']:.3f}",
                  f"{r['offloaded_bytes'] / 2**30:.2f}", f"{r['reloaded_bytes'] / 2**30:.2f}",
                  f"{r['plan_s']:.4f}", err)
    Console().print(t)

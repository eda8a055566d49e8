"""``vmstoolkit run generate|train``: a user's own Hugging Face model folder (LLaMA, Mistral,
Qwen2) on the memory-aware runtime under a GPU budget (``vmstoolkit.exec.model``). Progress goes
to stderr, rows to stdout."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from vmstoolkit.cli.common import Backend, OutputFormat, emit_rows, fail, fail_if_nothing_ran, host_budget_option
from vmstoolkit.cli.flags import format_flag


class Variant(str, Enum):
    lora = "lora"
    full = "full"


class Executor(str, Enum):
    event_driven = "event-driven"
    fixed_order = "fixed-order"


ModelOpt = Annotated[Path, typer.Option("--model", metavar="DIR", help="A local Hugging Face model folder: config.json and *.safetensors (nothing is downloaded).")]
BudgetOpt = Annotated[Optional[list[str]], typer.Option("--budget", metavar="SIZE|FRACTION", help="GPU budget per GPU, repeatable: a size (16GiB) or a fraction of the no-offload working set (0.5, 50%).", show_default=False)]
BackendOpt = Annotated[Backend, typer.Option("--backend", metavar="sim|cuda", help="sim: discrete-event simulation on the CPU (numpy numerics for small models); cuda: the GPU.")]
HostOpt = Annotated[Optional[str], typer.Option("--host-budget", metavar="SIZE", help="Host memory the plan may use (default: available RAM less max(10%, 2 GiB)); 'none' turns the check off.", show_default=False)]
FormatOpt = Annotated[OutputFormat, format_flag()]
GpusOpt = Annotated[int, typer.Option("--gpus", min=1, help="GPUs of one machine (generation splits the blocks into pipeline stages).")]
SeedOpt = Annotated[int, typer.Option(help="Seed of the drawn prompt or tokens, dout, LoRA adapters and the simulated jitter.")]


def _prompt_ids(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        ids = [int(x) for x in text.replace(" ", "").split(",") if x != ""]
    except ValueError:
        fail(f"--prompt-ids takes comma-separated token ids such as 1,5,9, got {text!r}", code=2)
    if not ids:
        fail(f"--prompt-ids {text!r} holds no token id", code=2)
    return ids


def _budgets(budget: list[str] | None, default: str) -> list:
    from vmstoolkit.errors import VmsError
    from vmstoolkit.exec.experiment import BudgetSpec

    try:
        return [BudgetSpec.parse(b) for b in (budget or [default])]
    except VmsError as e:
        fail(f"--budget: {e}", code=2)


def generate_command(
    model: ModelOpt,
    budget: BudgetOpt = None,
    prompt_len: Annotated[Optional[int], typer.Option(min=1, help="Prompt length (random token ids from --seed); default 2048.", show_default=False)] = None,
    prompt_ids: Annotated[Optional[str], typer.Option(metavar="IDS", help="The prompt as comma-separated token ids (1,5,9), instead of --prompt-len.")] = None,
    new_tokens: Annotated[int, typer.Option(min=1, help="Tokens to generate (greedy).")] = 128,
    backend: BackendOpt = Backend.sim,
    host_budget: HostOpt = None,
    format: FormatOpt = OutputFormat.table,
    gpus: GpusOpt = 1,
    executor: Annotated[Executor, typer.Option(help="event-driven or fixed-order.")] = Executor.event_driven,
    seed: SeedOpt = 0,
) -> None:
    """Greedy generation: the prompt's prefill, then one token at a time with a KV cache, all in
    one memory plan per budget (weights, activations and the cache offloaded as the plan says).
    Reports tokens/s of prefill and decode and the bytes moved; the JSON row carries prompt_ids
    and tokens. Budget default: the whole working set (1.0)."""
    from vmstoolkit.exec.model.generate import run_generate
    from vmstoolkit.exec.model.progress import Stages

    if prompt_len is not None and prompt_ids is not None:
        fail("give --prompt-len or --prompt-ids, not both", code=2)
    ids = _prompt_ids(prompt_ids)
    specs = _budgets(budget, "1.0")
    stages = Stages(enabled=True)
    rows = list(run_generate(model, prompt_ids=ids, prompt_len=prompt_len or 2048,
                             new_tokens=new_tokens, budgets=specs, backend=backend.value, n_gpus=gpus,
                             host_budget=host_budget_option(host_budget), executor=executor.value, seed=seed, stages=stages))
    stages.note(f"first row after {stages.elapsed():.1f} s")
    emit_rows(rows, format, _generate_table)
    fail_if_nothing_ran(rows)


def train_command(
    model: ModelOpt,
    budget: BudgetOpt = None,
    variant: Annotated[Variant, typer.Option(help="lora: frozen base weights, trained adapters; full: every block weight trained.")] = Variant.lora,
    seq: Annotated[int, typer.Option(min=1, help="Sequence length of a step (batch 1).")] = 2048,
    steps: Annotated[int, typer.Option(min=1, help="Steps per budget and executor (the first is left out of step_s).")] = 10,
    rank: Annotated[int, typer.Option(min=1, help="LoRA rank.")] = 16,
    backend: BackendOpt = Backend.sim,
    host_budget: HostOpt = None,
    format: FormatOpt = OutputFormat.table,
    gpus: GpusOpt = 1,
    executor: Annotated[Optional[list[Executor]], typer.Option(help="Repeatable; default both.", show_default=False)] = None,
    check_grads: Annotated[Optional[bool], typer.Option("--check-grads/--no-check-grads", help="Compare gradients with the reference (default: on cuda, and on sim for small models).", show_default=False)] = None,
    seed: SeedOpt = 0,
) -> None:
    """Training steps of the checkpoint's blocks (the causal-LM loss of transformers: final norm,
    LM head and cross-entropy against the next token, both frozen, over --seed's token ids), LoRA
    or full fine-tuning, at each budget with each executor. Budget default: half the working set (0.5)."""
    from vmstoolkit.exec.model.progress import Stages
    from vmstoolkit.exec.model.train import run_train

    specs = _budgets(budget, "0.5")
    exs = tuple(e.value for e in (executor or list(Executor)))
    stages = Stages(enabled=True)
    rows = list(run_train(model, variant=variant.value, budgets=[s.text for s in specs], seq=seq, steps=steps,
                          rank=rank, backend=backend.value, n_gpus=gpus, host_budget=host_budget_option(host_budget),
                          executors=exs, check_grads=check_grads, seed=seed, stages=stages))
    stages.note(f"first row after {stages.elapsed():.1f} s")
    emit_rows(rows, format, _train_table)
    fail_if_nothing_ran(rows)


def _gib(n) -> str:
    from vmstoolkit.units import format_size

    return "-" if n is None else format_size(n)


def _num(x, fmt=".4f") -> str:
    return "-" if x is None else format(x, fmt)


def _generate_table(rows):
    from rich.table import Table

    t = Table(title="run generate: greedy generation under a GPU budget")
    for c in ("budget", "fraction", "prefill s", "decode s", "prefill tok/s", "decode tok/s", "offloaded",
              "reloaded", "host plan", "tokens"):
        t.add_column(c, justify="right")
    for r in rows:
        if "error" in r:
            t.add_row(_gib(r["budget"]), _num(r.get("budget_fraction"), ".3f"), f"[red]{r['error']}[/]", *[""] * 7)
            continue
        toks = r["tokens"]
        shown = "(timing only)" if toks is None else ",".join(map(str, toks[:8])) + (" ..." if len(toks) > 8 else "")
        t.add_row(_gib(r["budget"]), _num(r.get("budget_fraction"), ".3f"), _num(r["prefill_s"]), _num(r["decode_s"]),
                  _num(r["prefill_tokens_per_s"], ".1f"), _num(r["decode_tokens_per_s"], ".1f"),
                  _gib(r["offloaded_bytes"]), _gib(r["reloaded_bytes"]), _gib(r["host_plan_bytes"]), shown)
    return t


def _train_table(rows):
    from rich.table import Table

    t = Table(title="run train: training steps of a checkpoint under a GPU budget")
    for c in ("budget", "variant", "executor", "step s", "lower bound s", "offloaded", "reloaded",
              "host plan", "max |grad err|"):
        t.add_column(c, justify="right")
    for r in rows:
        if "error" in r:
            t.add_row(_gib(r["budget"]), r["variant"], r["executor"], f"[red]{r['error']}[/]", *[""] * 5)
            continue
        t.add_row(_gib(r["budget"]), r["variant"], r["executor"], _num(r["step_s"]), _num(r["lower_bound_s"]),
                  _gib(r["offloaded_bytes"]), _gib(r["reloaded_bytes"]), _gib(r["host_plan_bytes"]),
                  _num(r["max_abs_grad_err"], ".2e"))
    return t

"""``vmstoolkit experiment offload``: makespan against GPU budget for the memory-aware runtime."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from vmstoolkit.cli.common import Backend, OutputFormat, check_output_file, emit_rows, fail, fail_if_nothing_ran
from vmstoolkit.cli.flags import format_flag
from vmstoolkit.cli.output import atomic_file
from vmstoolkit.errors import VmsError
from vmstoolkit.units import format_size


def offload_command(
    backend: Annotated[Backend, typer.Option("--backend", metavar="sim|cuda", help="Executor: 'sim' (discrete-event simulation on the CPU, default) or 'cuda' (the GPU).")] = Backend.sim,
    gpus: Annotated[int, typer.Option(min=1, help="GPUs of one machine (blocks are split into pipeline stages).")] = 1,
    format: Annotated[OutputFormat, format_flag()] = OutputFormat.table,
    blocks: Annotated[int, typer.Option(min=1, help="LLaMA decoder blocks.")] = 16,
    parts: Annotated[int, typer.Option(min=1, help="Split GEMMs by weight rows and attention by heads into this many vertices.")] = 1,
    seq: Annotated[int, typer.Option(min=1, help="Prompt length (batch 1).")] = 2048,
    hidden: Annotated[int, typer.Option(min=8, help="Hidden size.")] = 4096,
    heads: Annotated[int, typer.Option(min=1, help="Attention heads.")] = 32,
    ffn: Annotated[int, typer.Option(min=1, help="FFN width.")] = 11008,
    budget: Annotated[Optional[list[str]], typer.Option(
        "--budget", metavar="SIZE|FRACTION",
        help="GPU budget per GPU, repeatable: a size with its unit (12GiB, 512MiB) or a fraction of the "
             "no-offload working set (0.5, 50%). Default: 1, 0.75, 0.5, 0.375, 0.25, 0.125.",
        show_default=False)] = None,
    figure: Annotated[Path | None, typer.Option(metavar="FILE", help="Write a figure of makespan against budget here (.png, .pdf, .svg, ...; missing folders are made).")] = None,
    schedule: Annotated[Path | None, typer.Option(help="Folder for each budget's first run under both executors, one above the other (schedule_<bytes>B.png and .json); on cuda every vertex is timed with CUDA events.")] = None,
    seed: Annotated[int, typer.Option(help="Seed of the simulated jitter.")] = 0,
) -> None:
    """Run a LLaMA prefill at budgets from its whole working set down to an eighth of it (or those
    given with --budget), with the event-driven and the fixed-order executors; report makespan
    against the lower bound.

    Offloaded GiB are GPU -> host copies: activations evicted before their last use, once each.
    Weights and inputs are never copied out (a host copy exists from the start; evicting them
    drops them), so offloaded stays 0 while only weights are dropped. Reloaded GiB are
    host -> GPU copies: weights that did not fit at the start and everything dropped or
    offloaded, brought back before its next use."""
    from vmstoolkit.exec.experiment import BudgetSpec, plot_makespan, run_offload_experiment
    from vmstoolkit.exec.graph import LlamaConfig

    if figure is not None:
        check_figure_path(figure, "--figure")  # before the experiment, which can take minutes
    try:
        specs = [BudgetSpec.parse(b) for b in budget] if budget else None
    except VmsError as e:
        fail(f"--budget: {e}", code=2)
    cfg = LlamaConfig(n_blocks=blocks, seq=seq, hidden=hidden, heads=heads, kv_heads=heads, ffn=ffn)
    rows = run_offload_experiment(backend.value, gpus, config=cfg, parts=parts, seed=seed, budgets=specs,
                                  schedule_dir=schedule)
    emit_rows(rows, format, offload_table)
    fail_if_nothing_ran(rows)
    if figure is not None:
        with atomic_file(figure) as tmp:
            plot_makespan(rows, tmp)
        typer.echo(f"wrote {figure}", err=True)


def check_figure_path(path: Path, flag: str) -> None:
    """Fail (one line, exit 2) unless ``path`` names a file matplotlib can write: a known
    extension, in a folder that exists or can be made. Matplotlib would otherwise add ``.png`` to
    a folder's name or an extensionless name and write beside it, or fail with a traceback after
    the whole run."""
    from matplotlib.figure import Figure

    formats = sorted(Figure().canvas.get_supported_filetypes())
    if path.is_dir():
        fail(f"{flag} {path} is a folder: give a file name such as {path / 'offload.png'}", code=2)
    if not path.suffix:
        fail(f"{flag} {path} has no extension: end it with one of .{', .'.join(formats)}", code=2)
    if path.suffix[1:].lower() not in formats:
        fail(f"{flag} {path}: unknown figure format {path.suffix!r}; known: {', '.join(formats)}", code=2)
    check_output_file(path, flag)  # a missing folder is made, as for every output path (vmstoolkit.cli.output)


TABLE_NOTE = ("offloaded: GPU -> host copies of activations evicted before their last use (weights and inputs "
              "are dropped, never copied out: a host copy exists); reloaded: host -> GPU copies (weights that did "
              "not fit at the start, and whatever was dropped or offloaded)")


def offload_table(rows: list[dict]):
    from rich.table import Table

    reasons = list(dict.fromkeys(f"{r['budget_spec'] or r['budget_fraction']}: {r['error']}"
                                 for r in rows if "error" in r))
    caption = TABLE_NOTE + "".join(f"\nbudget {x}" for x in reasons)
    t = Table(title="offload: makespan against budget", caption=caption, caption_justify="left")
    for c in ("budget", "fraction", "executor", "makespan s", "lower bound s", "ratio",
              "offloaded", "reloaded", "fits w/o offload"):
        t.add_column(c, justify="right")
    for r in rows:
        if "error" in r:
            t.add_row(format_size(r["budget"]), f"{r['budget_fraction']:.3f}", r["executor"],
                      "no schedule (below)", "", "", "", "", str(r["fits_without_offload"]))
            continue
        t.add_row(format_size(r["budget"]), f"{r['budget_fraction']:.3f}", r["executor"],
                  f"{r['makespan_s']:.4f}", f"{r['lower_bound_s']:.4f}", f"{r['makespan_s'] / r['lower_bound_s']:.3f}",
                  format_size(r["offloaded_bytes"]), format_size(r["reloaded_bytes"]),
                  str(r["fits_without_offload"]))
    return t

"""``vmstoolkit view``: an offline HTML report of one snapshot under allocators."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from vmstoolkit.analysis.view import MAX_SEGMENT_ROWS
from vmstoolkit.cli.common import allocator_options, check_allocators, check_output_file, fail, size_option
from vmstoolkit.cli.allocators import warn_ineffective
from vmstoolkit.cli.flags import allocator_flag, capacity_flag, capacity_label, option_flag
from vmstoolkit.cli.output import atomic_file
from vmstoolkit.cli.progress import progress_bar


def view_command(
    trace: Annotated[Path, typer.Argument(metavar="TRACE", help="A PyTorch memory snapshot.", show_default=False)],
    allocator: Annotated[Optional[list[str]], allocator_flag("pytorch-caching, vms")] = None,
    out: Annotated[Path, typer.Option(metavar="FILE", help="The HTML page to write (missing folders are made).")] = Path("report.html"),
    capacity: Annotated[Optional[str], capacity_flag()] = None,
    option: Annotated[Optional[list[str]], option_flag()] = None,
    segments: Annotated[str, typer.Option(metavar="N|all", help="Segments drawn in each layout figure, the largest first "
                                          "(the figure says how many it leaves out).")] = str(MAX_SEGMENT_ROWS),
) -> None:
    """Write one self-contained HTML page (no network needed): memory over time per allocator, with
    zoom and hover (size, stream, Python frame), and each allocator's segment/stitch layout at its
    peak reserved."""
    from vmstoolkit.analysis.view import report_html, view_data
    from vmstoolkit.pools.drivers.sim import DEFAULT_CAPACITY

    names = list(allocator or ["pytorch-caching", "vms"])
    check_allocators(names)
    cap = size_option(capacity, "--capacity")
    options = allocator_options(option, names, cap)
    warn_ineffective(options)
    if segments == "all":
        max_segments = None
    elif segments.isdigit() and int(segments) > 0:
        max_segments = int(segments)
    else:
        fail(f"--segments must be a positive number or 'all', got {segments!r}", code=2)
    check_output_file(out)
    if not trace.exists():
        fail(f"no such trace file: {trace}")
    with progress_bar() as progress:
        task = progress.add_task(f"{trace.name}: loading", total=2 * len(names))
        done = iter(range(2 * len(names)))

        def step(what: str) -> None:  # called before each replay: count those before it
            progress.update(task, description=f"{trace.name} / {what}", completed=next(done))

        page = report_html(*view_data(trace, names, options, cap, max_segments, on_step=step))
    with atomic_file(out) as tmp:
        tmp.write_text(page, encoding="utf-8")
    typer.echo(f"wrote {out} ({len(page) / 2**20:.1f} MiB; {', '.join(names)} on "
               f"{capacity_label(cap or DEFAULT_CAPACITY)})", err=True)

"""``vmstoolkit view``: an offline HTML report of one snapshot under allocators."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from vmstoolkit.analysis.view import MAX_SEGMENT_ROWS
from vmstoolkit.cli.common import allocator_options, check_allocators, check_output_file, fail, size_option
from vmstoolkit.cli.replay import OPTION_HELP


def view_command(
    trace: Annotated[Path, typer.Argument(metavar="TRACE", help="A PyTorch memory snapshot.", show_default=False)],
    allocator: Annotated[Optional[list[str]], typer.Option(
        "--allocator", "-a", metavar="NAME", help="Allocator to draw; repeat for several. Default: pytorch-caching, vms.")] = None,
    out: Annotated[Path, typer.Option(metavar="FILE", help="The HTML page to write.")] = Path("report.html"),
    capacity: Annotated[Optional[str], typer.Option(metavar="SIZE", help="Simulated device memory (default 141GiB).")] = None,
    option: Annotated[Optional[list[str]], typer.Option("--option", "-o", metavar="[ALLOC:]KEY=VALUE", help=OPTION_HELP)] = None,
    segments: Annotated[str, typer.Option(metavar="N|all", help="Segments drawn in each layout figure, the largest first "
                                          "(the figure says how many it leaves out).")] = str(MAX_SEGMENT_ROWS),
) -> None:
    """Write one self-contained HTML page (no network needed): memory over time per allocator, with
    zoom and hover (size, stream, Python frame), and each allocator's segment/stitch layout at its
    peak reserved."""
    from vmstoolkit.analysis.view import report_html, view_data

    names = list(allocator or ["pytorch-caching", "vms"])
    check_allocators(names)
    cap = size_option(capacity, "--capacity")
    options = allocator_options(option, names, cap)
    if segments == "all":
        max_segments = None
    elif segments.isdigit() and int(segments) > 0:
        max_segments = int(segments)
    else:
        fail(f"--segments must be a positive number or 'all', got {segments!r}", code=2)
    check_output_file(out)
    if not trace.exists():
        fail(f"no such trace file: {trace}")
    page = report_html(*view_data(trace, names, options, cap, max_segments))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page, encoding="utf-8")
    typer.echo(f"wrote {out} ({len(page) / 2**20:.1f} MiB)", err=True)

"""The flags that several commands share, defined once, so that one name means one thing everywhere.

Each function returns the ``typer.Option`` of one shared flag; a command puts it in its
signature with ``Annotated[..., allocator_flag("pytorch-caching, vms")]``. Only the help's
default may differ from command to command. ``tests/cli/test_consistency.py`` runs every
command's ``--help`` and checks that a flag name, and a short letter, means the same everywhere.

- ``-a/--allocator NAME`` (repeatable, completes allocator names), ``-o/--option
  [ALLOC:]KEY=VALUE``, ``--capacity SIZE``: which allocators, their options, the simulated device;
- ``-f/--format [table|json|csv]``: a table, JSON Lines or CSV (:data:`FORMAT_RULE`);
- ``--backend sim|cuda``: the simulated driver or the GPU; ``--gpu N``: a device number;
- ``--lenient``, ``--max-bytes SIZE``, ``--max-objects N``: how snapshots are read;
- ``--oom-exit-code N``, ``--jobs N``, ``--cluster local:N|ADDRESS``, ``--out``.
"""

from __future__ import annotations

import typer

from vmstoolkit.cli.common import OOM_EXIT_CODE

FORMAT_RULE = ("table: for people; json: JSON Lines, one object per row (the CSV's columns); "
               "csv: the same rows as CSV.")
"""The one output rule: whatever a command prints with ``--format json`` is JSON Lines, one flat
object per row, the same rows and columns as ``--format csv``. A file named ``.json`` that an
experiment writes (``fragmentation.json``) is one document: its rows under ``rows``, with how
they were made."""

OPTION_HELP = ("Allocator option KEY=VALUE (every chosen allocator that takes KEY) or ALLOC:KEY=VALUE "
               "(that one), pairs joined by commas, repeatable: e.g. vms:stitched_prefix=false,reuse_max_ratio=2, "
               "stitch_min_bytes=64MiB (vms, gmlake), "
               "slack_pages=128 (paged), config=max_split_size_mb:128 (pytorch-*). "
               "See `vmstoolkit allocators NAME`.")
OOM_HELP = ("Exit status when a replay runs out of memory (the output is complete either way); 0: exit 0. "
            "Errors exit 1, bad arguments 2.")


def capacity_label(nbytes: int | None) -> str:
    """The capacity as understood, for a table's title: ``141.00 GiB``; in both units when the
    binary one is not exact (``--capacity 80GB``: ``74.51 GiB (80 GB)``); None: the device's."""
    from vmstoolkit.units import MiB, format_size

    if nbytes is None:
        return "the device's memory"
    if nbytes % MiB == 0:
        return format_size(nbytes)
    for unit, factor in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if nbytes >= factor:
            return f"{format_size(nbytes)} ({nbytes / factor:.6g} {unit})"
    return f"{nbytes} B"


def complete_allocator(incomplete: str) -> list[tuple[str, str]]:
    """Shell completion of ``-a``: the allocator names starting with what is typed, each with
    what it is."""
    from vmstoolkit.pools import describe_allocators

    return [(n, d) for n, d in describe_allocators().items() if n.startswith(incomplete)]


def allocator_flag(default: str):
    return typer.Option("--allocator", "-a", metavar="NAME", autocompletion=complete_allocator,
                        help=f"Allocator; repeat for several (default: {default}). See `vmstoolkit allocators`.")


def option_flag():
    return typer.Option("--option", "-o", metavar="[ALLOC:]KEY=VALUE", help=OPTION_HELP)


def capacity_flag():
    return typer.Option("--capacity", metavar="SIZE",
                        help="Device memory of the simulated driver, e.g. 80GiB (default 141GiB, an H200); "
                             "the tables say what was understood.")


def format_flag():
    return typer.Option("--format", "-f", help=f"Output format. {FORMAT_RULE}")


def backend_flag(what: str = "Driver", *aliases: str):
    return typer.Option("--backend", *aliases, metavar="sim|cuda",
                        help=f"{what}: 'sim' (simulated, default) or 'cuda' (the GPU).")


def gpu_flag(help: str):
    return typer.Option("--gpu", metavar="N", help=help)


def lenient_flag():
    return typer.Option("--lenient/--no-lenient", help="Skip and count corrupt events (double allocs, overlaps, "
                                                        "size-mismatched frees) instead of failing.")


def max_bytes_flag():
    return typer.Option("--max-bytes", metavar="SIZE", help="Most decompressed bytes read from a snapshot, e.g. "
                                                            "64GiB (default 32 GiB, and 100x the size of a gzip file).")


def max_objects_flag():
    return typer.Option("--max-objects", metavar="N", help="Most pickle values built while reading a snapshot "
                                                           "(default 1e9).")


def oom_exit_code_flag():
    return typer.Option("--oom-exit-code", metavar="N", min=0, max=255, help=OOM_HELP)


def jobs_flag():
    return typer.Option("--jobs", metavar="N", help="Local worker processes (default: the machine's cores).")


def cluster_flag():
    return typer.Option("--cluster", metavar="local:N|ADDRESS",
                        help="Run the replays on a Dask cluster instead of local processes: local:N starts N local "
                             "workers, tcp://HOST:PORT joins a running scheduler (workers need the traces at the "
                             "same path). Needs pip install 'vmstoolkit[cluster]'.")


__all__ = ["capacity_label", "FORMAT_RULE", "OOM_EXIT_CODE", "OOM_HELP", "OPTION_HELP", "allocator_flag", "backend_flag",
           "capacity_flag", "cluster_flag", "complete_allocator", "format_flag", "gpu_flag", "jobs_flag",
           "lenient_flag", "max_bytes_flag", "max_objects_flag", "oom_exit_code_flag", "option_flag"]

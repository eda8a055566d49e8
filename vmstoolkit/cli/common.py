"""Pieces shared by the CLI commands: option types, error reporting, output formats, checks of
output paths. Parsing of allocator options lives in :mod:`vmstoolkit.pools.options`; this module
only turns its errors into the CLI's one-line exits."""

from __future__ import annotations

import os
from enum import Enum
from pathlib import Path

import typer
from rich.console import Console

from vmstoolkit import _interrupt
from vmstoolkit.analysis.rows import json_lines, rows_to_csv
from vmstoolkit.errors import ConfigError, VmsError
from vmstoolkit.units import parse_size

OOM_EXIT_CODE = 3
"""Exit status when a replay ran out of memory (``--oom-exit-code`` changes it). The output is
complete either way; a distinct status lets a script ask "would it fit?" without parsing it, and
is told apart from a user error (2) and a failure (1). 0 turns it off."""

PIPED_WIDTH = 200  # a table written to a pipe or file, without COLUMNS: wide enough not to fold it


class OutputFormat(str, Enum):
    table = "table"
    json = "json"
    csv = "csv"


class Device(str, Enum):
    """Where the work runs, for every command that asks: ``sim`` (simulated, any machine) or
    ``cuda`` (the GPU). ``replay --device`` picks the driver with it
    (:func:`~vmstoolkit.pools.drivers.make_driver`), the experiments' ``--backend`` the runtime's
    backend (:func:`~vmstoolkit.exec.backends.make_backend`); the values are the kinds both take."""

    sim = "sim"
    cuda = "cuda"


Backend = Device
"""The experiments' ``--backend`` type: the same choices as ``--device``."""


def fail(message: str, code: int = 1) -> None:
    """Print one error line and exit: the CLI's only way out on a user error."""
    typer.secho(f"error: {message}", err=True, fg="red")
    raise typer.Exit(code=code)


def console(stderr: bool = False) -> Console:
    """A console whose tables fit the terminal (Rich folds cells to its width); piped without
    ``COLUMNS``, :data:`PIPED_WIDTH` columns so that files get whole lines."""
    c = Console(stderr=stderr)
    if not c.is_terminal and "COLUMNS" not in os.environ:
        c = Console(stderr=stderr, width=PIPED_WIDTH)
    return c


def size_option(value: str | None, what: str) -> int | None:
    if value is None:
        return None
    try:
        n = parse_size(value)
    except ValueError as e:
        fail(f"{what}: {e}", code=2)
    if n <= 0:
        fail(f"{what} must be positive, got {value!r}", code=2)
    return n


def host_budget_option(value: str | None) -> int | None:
    """``--host-budget``: bytes; ``None`` (not given) is -1, the runtime's default (available
    memory less a margin); ``none`` turns the check off (None)."""
    if value is None:
        return -1
    if value.strip().lower() == "none":
        return None
    return size_option(value, "--host-budget")


def allocator_options(items: list[str] | None, names: list[str], capacity: int | None,
                      device: Device | str = Device.sim) -> dict[str, dict]:
    """Per allocator, its checked ``-o`` options (``KEY=VALUE``: where taken; ``ALLOC:KEY=VALUE``:
    that one; :func:`vmstoolkit.pools.registry.resolve_option_items`); on the simulated driver
    checked against its capacity too (``capacity``, default the simulated H200's). On ``cuda`` the
    device's own capacity is checked when its driver is made, before any event. A bad option
    exits with one line (status 2)."""
    from vmstoolkit.pools.drivers.sim import DEFAULT_CAPACITY
    from vmstoolkit.pools.registry import resolve_option_items

    sim = Device(device) is Device.sim
    try:
        return resolve_option_items(items, names, capacity=(capacity or DEFAULT_CAPACITY) if sim else None)
    except ConfigError as e:
        fail(str(e), code=2)


def option_value(key: str, text: str, names: list[str]):
    """``text`` as the value of option ``key`` for the allocators ``names``, read as ``-o`` reads
    it (:func:`vmstoolkit.pools.registry.option_value`); a bad one exits with one line (status 2)."""
    from vmstoolkit.pools.registry import option_value as _value

    try:
        return _value(key, text, names)
    except ConfigError as e:
        fail(str(e), code=2)


def check_allocators(names: list[str]) -> None:
    from vmstoolkit.pools import allocator_names

    known = allocator_names()
    for n in names:
        if n not in known:
            fail(f"unknown allocator {n!r}; choose one of: {', '.join(known)}", code=2)
    if len(set(names)) != len(names):
        fail("an allocator is named twice", code=2)


def _blocking_file(path: Path) -> Path | None:
    """The existing non-directory at ``path`` or above it, if any."""
    for p in (path, *path.parents):
        if p.exists():
            return None if p.is_dir() else p
    return None


def _nearest_existing(path: Path) -> Path:
    for p in (path, *path.parents):
        if p.exists():
            return p
    return Path(".")


def check_output_dir(path: Path, what: str = "--out") -> None:
    """Exit with one line unless ``path`` is, or can be made, a writable directory. Run before
    any work: finding it after an hour of replays is too late."""
    path = path.expanduser()
    blocker = _blocking_file(path)
    if blocker == path:
        fail(f"{what} {path} is a file, not a directory", code=2)
    if blocker is not None:
        fail(f"{what} {path} is under {blocker}, which is a file", code=2)
    base = _nearest_existing(path)
    if not os.access(base, os.W_OK | os.X_OK):
        fail(f"{what} {path}: {base} is not writable", code=2)
    if not path.exists():
        # Access bits do not tell everything (/proc, a read-only mount, quotas): make the folders
        # to prove they can be made, then take back the ones made here.
        try:
            path.mkdir(parents=True)
        except OSError as e:
            fail(f"{what} {path}: cannot make the folder ({e.strerror or e})", code=2)
        p = path
        while p != base and p != p.parent:
            try:
                p.rmdir()
            except OSError:
                break
            p = p.parent


def check_output_file(path: Path, what: str = "--out") -> None:
    """Exit with one line unless a file can be written at ``path`` (its folder exists or can be
    made, and is writable; ``path`` is not a directory)."""
    path = path.expanduser()
    if path.is_dir():
        fail(f"{what} {path} is a directory, not a file", code=2)
    check_output_dir(path.parent, what=f"{what} {path}: the folder")
    if path.exists() and not os.access(path, os.W_OK):
        fail(f"{what} {path} is not writable", code=2)


def emit_rows(rows: list[dict], fmt: OutputFormat, table) -> None:
    """Print ``rows`` as JSON lines, CSV, or a table: ``table(rows)`` either returns a rich
    renderable (printed here; a table that is piped or captured gets 200 columns instead of being
    squeezed into 80: :func:`console`) or prints itself and returns None. Every command that prints
    rows prints them here. Nothing is printed after a Ctrl-C, even one that a library swallowed
    (:func:`vmstoolkit._interrupt.check`)."""
    _interrupt.check()
    if fmt is OutputFormat.json:
        typer.echo(json_lines(rows), nl=False)
    elif fmt is OutputFormat.csv:
        typer.echo(rows_to_csv(rows), nl=False)
    else:
        rendered = table(rows)
        if rendered is not None:
            console().print(rendered)


def fail_if_nothing_ran(rows: list[dict]) -> None:
    """After the rows are printed: when every row is an error (no budget fits, say), exit with
    status 1 and one line naming the first row's budget and reason, so that a script does not take
    a run where nothing ran for a success. A run where one row ran exits 0, as before."""
    if rows and all("error" in r for r in rows):
        r = rows[0]
        spec = r.get("budget_spec") or (f"{r['budget']}B" if isinstance(r.get("budget"), int) else r.get("budget"))
        more = f" (and {len(rows) - 1} more row{'s' if len(rows) > 2 else ''})" if len(rows) > 1 else ""
        fail(f"no budget fits: budget {spec}: {r['error']}{more}", code=1)


def load_options(gpu: int | None, lenient: bool, max_bytes: str | None, max_objects: int | None) -> dict:
    """Snapshot-loading keywords from the ``--gpu``, ``--lenient``, ``--max-bytes`` and
    ``--max-objects`` flags, checked."""
    if gpu is not None and gpu < 0:
        fail(f"--gpu must be a device number (0 or more), got {gpu}", code=2)
    if max_objects is not None and max_objects <= 0:
        fail(f"--max-objects must be positive, got {max_objects}", code=2)
    return {"gpu": gpu, "lenient": lenient, "max_bytes": size_option(max_bytes, "--max-bytes"),
            "max_objects": max_objects}


__all__ = ["OutputFormat", "Device", "Backend", "OOM_EXIT_CODE", "load_options", "fail", "console", "size_option", "host_budget_option", "allocator_options", "option_value",
           "check_allocators", "check_output_dir", "check_output_file", "rows_to_csv", "json_lines", "emit_rows",
           "fail_if_nothing_ran",
           "VmsError"]

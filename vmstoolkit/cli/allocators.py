"""``vmstoolkit allocators [NAME]``: the allocators, and each one's options with their defaults."""

from __future__ import annotations

from dataclasses import MISSING, fields
from typing import Annotated, Optional

import typer
from rich.table import Table

from vmstoolkit.cli.common import console, fail
from vmstoolkit.cli.flags import complete_allocator


def _typed(value, kind: str | None) -> str:
    """A value as one types it on the command line: ``64MiB``, ``true``, ``2``."""
    from vmstoolkit.units import KiB

    if isinstance(value, bool):
        return "true" if value else "false"
    if kind == "size" and value:
        for unit, factor in (("TiB", KiB**4), ("GiB", KiB**3), ("MiB", KiB**2), ("KiB", KiB)):
            if value % factor == 0:
                return f"{int(value) // factor}{unit}"
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() else f"{value:g}"
    return str(value)


def _default(f) -> str:
    value = f.default if f.default is not MISSING else None
    if value is None:
        return "(the allocator's own)" if f.metadata.get("optional") else "-"
    return _typed(value, f.metadata.get("kind"))


def _accepts(f) -> str:
    meta = f.metadata
    if meta.get("choices"):
        return " | ".join(meta["choices"])
    kind = meta.get("kind", "")
    lo, hi = meta.get("min"), meta.get("max")
    bounds = [f">= {_typed(lo, kind)}"] if lo is not None else []
    bounds += [f"<= {_typed(hi, kind)}"] if hi is not None else []
    return kind + (f" ({', '.join(bounds)})" if bounds else "") + (", power of two" if meta.get("power_of_two") else "")


def option_rows(name: str) -> list[dict]:
    """``[{"option", "accepts", "default", "meaning"}]`` of allocator ``name`` (none for one without options)."""
    from vmstoolkit.pools.registry import options_class

    return [{"option": f.name, "accepts": _accepts(f), "default": _default(f), "meaning": f.metadata.get("help", "")}
            for f in fields(options_class(name))]


def ineffective(name: str, options: dict) -> list[str]:
    """Why options given to allocator ``name`` do nothing, one line each: with stitched
    prefixes on (vms's default), a cached stitched range is always taken as a prefix before it
    could be reused whole, so ``reuse_max_ratio`` never acts (``StitchedPool.best_prefix`` scans
    every range ``best_fit`` would, from the same end)."""
    from vmstoolkit.pools.registry import options_class

    cls = options_class(name)
    if "reuse_max_ratio" not in options or "stitched_prefix" not in cls.keys():
        return []
    prefix = options.get("stitched_prefix", next(f.default for f in fields(cls) if f.name == "stitched_prefix"))
    if prefix is True or str(prefix).lower() in ("true", "yes", "on", "1"):
        return [f"{name}: reuse_max_ratio has no effect while stitched_prefix=true (a cached stitched range is "
                f"taken as a prefix first); add {name}:stitched_prefix=false for it to act"]
    return []


def warn_ineffective(options: dict[str, dict]) -> None:
    """Print a ``note:`` line on stderr for every option that will do nothing (:func:`ineffective`)."""
    for name, opts in options.items():
        for line in ineffective(name, opts):
            typer.secho(f"note: {line}", err=True, fg="yellow")


def allocators_command(
    name: Annotated[Optional[str], typer.Argument(
        metavar="NAME", autocompletion=complete_allocator, show_default=False,
        help="An allocator: list its options, what each accepts, its default and what it does.")] = None,
) -> None:
    """List the allocators, what each one is, and their options with defaults (-o KEY=VALUE);
    with NAME, that allocator's options in full."""
    from vmstoolkit.pools import describe_allocators

    described = describe_allocators()
    if name is None:
        t = Table(title="Allocators (vmstoolkit allocators NAME: one allocator's options in full)")
        t.add_column("name", no_wrap=True)
        t.add_column("what it is", overflow="fold")
        t.add_column("options (-o KEY=VALUE), default", overflow="fold")
        for n, desc in described.items():
            t.add_row(n, desc, ", ".join(f"{r['option']}={r['default']}" for r in option_rows(n)) or "(none)")
        console().print(t)
        return
    if name not in described:
        fail(f"unknown allocator {name!r}; choose one of: {', '.join(described)}", code=2)
    rows = option_rows(name)
    out = console()
    if not rows:
        out.print(f"{name}: {described[name]}\nIt takes no options.", markup=False, highlight=False)
        return
    t = Table(title=f"{name}: {described[name]}", caption=f"set with -o {name}:KEY=VALUE (or -o KEY=VALUE)",
              caption_justify="left")
    for c in ("option", "accepts", "default", "meaning"):
        t.add_column(c, overflow="fold", no_wrap=c == "option")
    for r in rows:
        t.add_row(r["option"], r["accepts"], r["default"], r["meaning"])
    out.print(t)

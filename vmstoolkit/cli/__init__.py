"""The ``vmstoolkit`` command: one Typer app per command group, joined here.

Every command module defines plain functions with ``Annotated`` options; this module registers
them. User errors (bad files, names, sizes) print one line and exit with code 1 or 2, never a
traceback: :func:`main` turns every :class:`~vmstoolkit.errors.VmsError` into that line.
"""

from __future__ import annotations

import sys

import typer

from vmstoolkit.errors import VmsError

app = typer.Typer(
    name="vmstoolkit",
    help="See, measure and beat GPU memory fragmentation: replay PyTorch memory snapshots through "
         "VMM-stitching and baseline allocators, and run the papers' experiments.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
experiment_app = typer.Typer(help="Reproduce the published experiments.", no_args_is_help=True)
app.add_typer(experiment_app, name="experiment")


def _register() -> None:
    from vmstoolkit.cli import replay as _replay

    app.command("replay")(_replay.replay_command)
    app.command("allocators")(_replay.allocators_command)
    for module, name, attr in (
        ("vmstoolkit.cli.info", "info", "info_command"),
        ("vmstoolkit.cli.sweep", "sweep", "sweep_command"),
    ):
        _maybe(app, module, name, attr)
    for module, name, attr in (
        ("vmstoolkit.cli.fragmentation", "fragmentation", "fragmentation_command"),
        ("vmstoolkit.cli.offload", "offload", "offload_command"),
        ("vmstoolkit.cli.train_offload", "train-offload", "train_offload_command"),
    ):
        _maybe(experiment_app, module, name, attr)


def _maybe(target: typer.Typer, module: str, name: str, attr: str) -> None:
    import importlib

    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module:
            raise
        return
    target.command(name)(getattr(mod, attr))


_register()


def main() -> None:
    try:
        app()
    except VmsError as e:
        typer.secho(f"error: {e}", err=True, fg="red")
        sys.exit(1)

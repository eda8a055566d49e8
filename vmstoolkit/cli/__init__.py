"""The ``vmstoolkit`` command: one Typer app per command group, joined here.

Every command module defines plain functions with ``Annotated`` options; this module registers
them. User errors (bad files, names, sizes) print one line and exit with code 1 or 2, never a
traceback: the one handler, :meth:`Group.invoke`, turns every :class:`~vmstoolkit.errors.VmsError`
(the runtime's :class:`~vmstoolkit.exec.errors.ExecError` included) that a command lets through
into that line (:func:`error_line`) and exit status 1, and Ctrl-C into ``error: interrupted`` and
exit status 130 (output files are written whole or not at all: :mod:`vmstoolkit.cli.output`).

Help texts are printed as written: Rich would read ``pip install 'vmstoolkit[cluster]'`` as
markup and print ``pip install 'vmstoolkit'`` (:func:`_as_written`). Flags that several commands
share are defined once, in :mod:`vmstoolkit.cli.flags`.
"""

from __future__ import annotations

from typing import Annotated

import typer
from typer.core import TyperArgument, TyperCommand, TyperGroup

from vmstoolkit import _interrupt
from vmstoolkit.errors import VmsError

INTERRUPTED = 130  # exit status on Ctrl-C: 128 + SIGINT, what a shell reports for a process it ended


_LABELS = {"int": "INTEGER", "str": "TEXT", "float": "FLOAT", "Path": "PATH", "bool": ""}


def _label(typed: str | None) -> str | None:
    """``<list[int]>`` -> ``INTEGER``, ``<table|json>`` -> ``[table|json]``, ``<bool>`` -> nothing."""
    if not typed:
        return None
    t = typed.strip("<>")
    if t.startswith("list[") and t.endswith("]"):
        t = t[5:-1]
    if "|" in t:
        return f"[{t}]"
    return _LABELS.get(t, t.upper()) or None


def _as_written(text: str | None, mode) -> str | None:
    """``text`` escaped for Rich markup when Typer renders help with it (the terminal's help and
    ``typer ... utils docs``), so that ``[cluster]`` and ``[ALLOC:]`` come out as written."""
    if not text or mode != "rich":
        return text
    from rich.markup import escape

    return escape(text)


class _PlainTypes:
    """Help that names values the way a user types them, never as Python types.

    Typer labels every parameter with its annotation (``<list[Path]>``, ``<int>``, ``<bool>``);
    here an argument is named by its metavar alone, an option by its metavar or a Click-style
    label (``INTEGER``, ``TEXT``, ``[table|json|csv]``), a flag by nothing.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        mode = getattr(self, "rich_markup_mode", None)
        self.help = _as_written(self.help, mode)
        self.short_help = _as_written(self.short_help, mode)
        self.epilog = _as_written(self.epilog, mode)

    def get_params(self, ctx):
        params = super().get_params(ctx)
        mode = getattr(self, "rich_markup_mode", None)
        for p in params:
            if getattr(p, "_plain_types", False):
                continue
            p._plain_types = True
            if getattr(p, "help", None):
                p.help = _as_written(p.help, mode)
            label = getattr(p, "display_type_rich", None)
            if label is None:  # a Typer without this hook (the H200 image's): its own labels stay
                continue
            if isinstance(p, TyperArgument) or getattr(p, "is_flag", False):
                p.display_type_rich = lambda ctx: None
            elif getattr(p, "metavar", None) is None:
                p.display_type_rich = lambda ctx, f=label: _label(f(ctx))
        return params


class Command(_PlainTypes, TyperCommand):
    """A command with :class:`_PlainTypes` help."""


class Group(_PlainTypes, TyperGroup):
    """A command group with :class:`_PlainTypes` help, and the CLI's one error handler."""

    def invoke(self, ctx):
        if ctx.parent is None:
            _interrupt.forget_line()
        try:
            return super().invoke(ctx)
        except VmsError as e:
            typer.secho(error_line(e), err=True, fg="red")
            raise typer.Exit(code=1) from None
        except KeyboardInterrupt:
            if _interrupt.new_line():
                typer.secho("error: interrupted", err=True, fg="red")
            raise typer.Exit(code=INTERRUPTED) from None


def error_line(e: BaseException) -> str:
    """``error: MESSAGE``, on one line whatever the message holds."""
    return "error: " + " ".join(str(e).split("\n"))


def _version(value: bool) -> None:
    if value:
        from vmstoolkit import __version__

        typer.echo(f"vmstoolkit {__version__}")
        raise typer.Exit()


app = typer.Typer(
    name="vmstoolkit",
    help="See, measure and beat GPU memory fragmentation: replay PyTorch memory snapshots through "
         "VMM-stitching and baseline allocators, and run the papers' experiments.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    cls=Group,
)
experiment_app = typer.Typer(help="Reproduce the published experiments.", no_args_is_help=True, cls=Group)
app.add_typer(experiment_app, name="experiment")
run_app = typer.Typer(help="Run your own model (a local Hugging Face folder: LLaMA, Mistral, Qwen2) under a GPU budget.",
                      no_args_is_help=True, cls=Group)
app.add_typer(run_app, name="run")


@app.callback()
def _main(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                          help="Print the version and exit.")] = False,
) -> None:
    """See, measure and beat GPU memory fragmentation: replay PyTorch memory snapshots through
    VMM-stitching and baseline allocators, and run the papers' experiments."""


def _register() -> None:
    from vmstoolkit.cli import allocators as _allocators, replay as _replay

    app.command("replay", cls=Command)(_replay.replay_command)
    app.command("allocators", cls=Command)(_allocators.allocators_command)
    for module, name, attr in (
        ("vmstoolkit.cli.compare", "compare", "compare_command"),
        ("vmstoolkit.cli.view", "view", "view_command"),
        ("vmstoolkit.cli.record", "record", "record_command"),
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
    for name in ("generate", "train"):
        _maybe(run_app, "vmstoolkit.cli.run", name, f"{name}_command")


def _maybe(target: typer.Typer, module: str, name: str, attr: str) -> None:
    import importlib

    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module:
            raise
        return
    target.command(name, cls=Command, **getattr(mod, "COMMAND_SETTINGS", {}))(getattr(mod, attr))


_register()


def main() -> None:
    """The old entry point (``vmstoolkit.cli:main``); :func:`vmstoolkit.__main__.main` is the
    command's, and covers Ctrl-C while this module imports as well. Errors: :meth:`Group.invoke`."""
    try:
        app()
    except KeyboardInterrupt:  # outside a command (Typer's own start-up and exit)
        if _interrupt.new_line():
            typer.secho("error: interrupted", err=True, fg="red")
        raise SystemExit(INTERRUPTED) from None

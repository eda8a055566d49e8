"""Issue 21 "CLI conventions": --version, shell completion, help without Python types."""

import pytest
from typer.main import get_command
from typer.testing import CliRunner

from vmstoolkit import __version__
from vmstoolkit.cli import app

runner = CliRunner(env={"COLUMNS": "120"})


def test_version():
    r = runner.invoke(app, ["--version"])
    assert r.exit_code == 0 and r.stdout.strip() == f"vmstoolkit {__version__}"


def test_shell_completion_is_offered():
    r = runner.invoke(app, ["--help"])
    assert "--install-completion" in r.stdout and "--show-completion" in r.stdout


def _paths():
    top = get_command(app)
    out = [[]]
    for name, cmd in top.commands.items():
        out.append([name])
        out += [[name, sub] for sub in getattr(cmd, "commands", {})]
    return out


@pytest.mark.parametrize("path", _paths(), ids=lambda p: " ".join(p) or "vmstoolkit")
def test_help_names_no_python_type(path):
    r = runner.invoke(app, [*path, "--help"])
    assert r.exit_code == 0, r.output
    for typed in ("<list[", "<int>", "<str>", "<bool>", "<Path>", "<float>", "[[", "list[Path]"):
        assert typed not in r.stdout, f"{typed} in `vmstoolkit {' '.join(path)} --help`"


@pytest.mark.parametrize("path", _paths(), ids=lambda p: " ".join(p) or "vmstoolkit")
def test_help_is_printed_as_written(path):
    """Rich turns ``:name:`` into an emoji: ``--seq-range``'s "A:B: a new length" printed "A🅱 a
    new length". Every help text must come out with the characters it was written with."""
    r = runner.invoke(app, [*path, "--help"])
    assert r.exit_code == 0, r.output
    odd = sorted({c for c in r.stdout if ord(c) > 0x2FFF})  # box drawing and arrows are below
    assert not odd, f"`vmstoolkit {' '.join(path)} --help` prints {odd}"


def test_commands_parse_under_a_typer_without_the_rich_type_hook(monkeypatch):
    """The H200 image's Typer has no ``display_type_rich`` on its parameters; every command
    crashed there with AttributeError before parsing its arguments."""
    from typer.core import TyperArgument, TyperOption

    for cls in (TyperOption, TyperArgument):
        for owner in cls.__mro__:
            if "display_type_rich" in vars(owner):
                monkeypatch.delattr(owner, "display_type_rich")
    assert not hasattr(TyperOption, "display_type_rich")
    r = runner.invoke(app, ["replay", "/no/such/run.pickle"])
    assert not isinstance(r.exception, AttributeError), r.exception
    assert r.exit_code != 0 and "/no/such/run.pickle" in r.output

"""The CLI's one error handler: any VmsError a command lets through is one line and exit 1."""

import sys

import pytest
import typer
from typer.testing import CliRunner

from vmstoolkit.cli import Group, error_line, main
from vmstoolkit.errors import TraceFormatError
from vmstoolkit.exec.errors import CycleError


def _app(error: Exception) -> typer.Typer:
    app = typer.Typer(cls=Group)

    @app.command()
    def fails() -> None:
        raise error

    @app.command()
    def other() -> None:  # two commands: the group dispatches, as vmstoolkit's does
        pass

    return app


@pytest.mark.parametrize("error", [
    CycleError([1, 2, 1], ["load", "store", "load"]),  # the runtime's family
    TraceFormatError("snapshot x.pickle is truncated\n(it ends at byte 7)"),  # the trace's, on two lines
], ids=["exec", "trace"])
def test_the_handler_prints_any_error_of_the_family_as_one_line(error):
    r = CliRunner().invoke(_app(error), ["fails"])
    assert r.exit_code == 1
    assert r.output.count("\n") == 1 and r.output.startswith("error: ") and "Traceback" not in r.output
    assert r.output.strip() == error_line(error)
    assert str(error).split("\n")[0] in r.output


def _main(monkeypatch, capsys, *argv) -> tuple[int, str]:
    monkeypatch.setattr(sys, "argv", ["vmstoolkit", *argv])
    with pytest.raises(SystemExit) as e:
        main()
    return e.value.code, capsys.readouterr().err


def test_a_corrupt_trace_is_one_line(monkeypatch, capsys, tmp_path):
    bad = tmp_path / "bad.pickle"
    bad.write_bytes(b"garbage")
    code, err = _main(monkeypatch, capsys, "replay", str(bad))
    assert code == 1 and err.count("\n") == 1 and err.startswith("error: snapshot") and str(bad) in err


def test_an_impossible_model_shape_is_one_line(monkeypatch, capsys):
    code, err = _main(monkeypatch, capsys, "experiment", "offload", "--hidden", "10", "--heads", "3", "--blocks", "1")
    assert code == 1 and err.count("\n") == 1 and err.startswith("error: hidden=10")

"""Running the CLI in the tests."""

from __future__ import annotations

import subprocess
import traceback

from typer.testing import CliRunner

from vmstoolkit.cli import app


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """``vmstoolkit ARGS`` in this process (Typer's ``CliRunner``), returned as the finished
    process would be: exit status, stdout, stderr. A new process costs a second of CPU or more
    (Python, numpy, Numba, Typer), which dozens of one-line-error checks paid for nothing; tests of
    the process itself (signals, the entry point) start a real one. An exception that the CLI let
    through, which a real process prints as a traceback with exit status 1, is put into stderr the
    way Python prints it, so that checks for ``Traceback`` and for a one-line stderr still see it."""
    r = CliRunner().invoke(app, list(args))
    stderr = r.stderr
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        stderr += "".join(traceback.format_exception(*r.exc_info))
    return subprocess.CompletedProcess(["vmstoolkit", *args], r.exit_code, r.stdout, stderr)


__all__ = ["run_cli"]

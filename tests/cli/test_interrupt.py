"""Issue 37: Ctrl-C ends a command with one line and exit status 130, whenever it comes. It
printed a traceback once in five tries: when it came while the CLI was still importing (the
first second). A real process and a real SIGINT, so these run ``python -m vmstoolkit``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")


# ``python -m vmstoolkit ARGS``, after saying "ready" once Python itself has started (a SIGINT
# before that is Python's own start-up, not ours): the signal then lands while the CLI imports.
START = ("import runpy, sys; print('ready', flush=True); sys.argv = ['vmstoolkit', *sys.argv[1:]]; "
         "runpy.run_module('vmstoolkit', run_name='__main__')")


def interrupt_after(seconds: float, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    p = subprocess.Popen([sys.executable, "-c", START, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=env, cwd=ROOT)
    assert p.stdout.readline() == "ready\n"
    time.sleep(seconds)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def test_ctrl_c_while_the_cli_imports():
    r = interrupt_after(0.3, "replay")  # importing the CLI (numpy, Rich, Typer) takes about a second
    assert r.returncode == 130 and r.stderr == "error: interrupted\n" and r.stdout == "", r.stderr


def test_ctrl_c_during_the_replays(tmp_path):
    """All four bundled traces take several seconds; interrupted in the middle, nothing is printed
    but the one line."""
    r = interrupt_after(3.0, "replay", "-a", "vms", "-a", "gmlake", "-f", "json")
    assert r.returncode == 130 and r.stderr == "error: interrupted\n" and r.stdout == "", r.stderr

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
# The same, saying "replaying" on stderr when the first replay starts (``replay`` imports
# ``replay_trace`` when it runs): a signal sent after that lands in the replays, however slowly the
# machine got there.
# Said once: ``replay`` binds the function once per command and calls it for every trace and
# allocator, and on a fast machine the first replay can end before the signal comes.
START_REPLAYS = ("import os, runpy, sys; import vmstoolkit.trace.run as run; replay_trace = run.replay_trace; said = []\n"
                 "def replay_trace_said(*a, **k):\n    said or os.write(2, b'replaying\\n'); said.append(1)\n"
                 "    return replay_trace(*a, **k)\n"
                 "run.replay_trace = replay_trace_said\n" + START)


def _terminal_sigint() -> None:
    """In the child: SIGINT as a terminal's foreground program gets it. A test run started in the
    background (``pytest &`` in a script, ``nohup``) hands its children SIGINT ignored, and the
    command rightly keeps ignoring it then (test_an_inherited_ignored_sigint_stays_ignored): these
    tests failed with exit status 0 that way, under load or not."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def interrupt_after(seconds: float, *args: str, start: str = START, marker: str | None = None
                    ) -> subprocess.CompletedProcess:
    """Run the command, send SIGINT ``seconds`` after "ready" on stdout (and after ``marker`` on
    stderr, if given; it is left out of the returned stderr)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    p = subprocess.Popen([sys.executable, "-c", start, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=env, cwd=ROOT, preexec_fn=_terminal_sigint)
    assert p.stdout.readline() == "ready\n"
    if marker is not None:
        assert p.stderr.readline() == marker + "\n"
    time.sleep(seconds)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def test_ctrl_c_while_the_cli_imports():
    r = interrupt_after(0.3, "replay")  # importing the CLI (numpy, Rich, Typer) takes about a second
    assert r.returncode == 130 and r.stderr == "error: interrupted\n" and r.stdout == "", r.stderr


def test_ctrl_c_during_the_replays(tmp_path):
    """All four bundled traces take several seconds; interrupted half a second after the first
    replay began (it may be the second by then), nothing is printed but the one line."""
    r = interrupt_after(0.5, "replay", "-a", "vms", "-a", "gmlake", "-f", "json", start=START_REPLAYS, marker="replaying")
    assert r.returncode == 130 and r.stderr == "error: interrupted\n" and r.stdout == "", r.stderr


# In-process: a Ctrl-C at the two places where the product lost it, made to happen there
# deterministically. ``main()`` is the command's entry point (``vmstoolkit = vmstoolkit.__main__:main``).

@pytest.fixture
def terminal_sigint(monkeypatch):
    """SIGINT as a terminal leaves it for a program (Python's KeyboardInterrupt), restored after;
    ``sys.argv`` is set by each test."""
    before = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


def run_main(monkeypatch, capfd, *args: str) -> tuple[int, str, str]:
    from vmstoolkit.__main__ import main

    monkeypatch.setattr(sys, "argv", ["vmstoolkit", *args])
    with pytest.raises(SystemExit) as e:
        main()
    out, err = capfd.readouterr()
    return e.value.code, out, err


def test_ctrl_c_while_typer_parses_the_flags(monkeypatch, capfd, terminal_sigint):
    """Typer turns a KeyboardInterrupt outside the command (while it parses and converts the flags:
    it imports pydantic lazily there, about a second) into a silent exit status 130."""
    import vmstoolkit.cli as cli

    def interrupted_parse(self, ctx, args):
        signal.raise_signal(signal.SIGINT)  # Python's handler raises KeyboardInterrupt here

    monkeypatch.setattr(cli.Group, "parse_args", interrupted_parse)
    code, out, err = run_main(monkeypatch, capfd, "replay")
    assert (code, out, err) == (130, "", "error: interrupted\n")


def test_a_ctrl_c_that_a_library_swallows_still_ends_the_command(monkeypatch, capfd, terminal_sigint, small_trace):
    """A library's ``except BaseException`` (or bare ``except:``) that catches the KeyboardInterrupt
    must not turn Ctrl-C into a finished command (exit status 0, the table printed)."""
    import vmstoolkit.cli.replay as replay_cli

    files = replay_cli.trace_files

    def swallowing(items):
        try:
            signal.raise_signal(signal.SIGINT)
        except BaseException:  # noqa: BLE001 - what the library does
            pass
        return files(items)

    monkeypatch.setattr(replay_cli, "trace_files", swallowing)
    code, out, err = run_main(monkeypatch, capfd, "replay", "-a", "native", str(small_trace))
    assert (code, out, err) == (130, "", "error: interrupted\n")


def test_an_inherited_ignored_sigint_stays_ignored(monkeypatch, capfd, small_trace):
    """A command started with SIGINT ignored (``nohup``, or ``cmd &`` in a script) keeps it ignored,
    as every POSIX program does: Ctrl-C at the terminal is not meant for it."""
    before = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        code, out, err = run_main(monkeypatch, capfd, "replay", "-a", "native", "-f", "json", str(small_trace))
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before)
    assert code in (0, None) and '"allocator": "native"' in out, err

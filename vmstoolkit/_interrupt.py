"""Ctrl-C, once pressed, ends the command: one line (``error: interrupted``), exit status 130.

Python's own SIGINT handler raises KeyboardInterrupt once, in whatever code runs at that moment,
and two places lost it (issue 37, seen when the signal came in the first seconds):

- Typer's ``_main`` catches a KeyboardInterrupt raised outside the command (while it parses and
  converts the flags, where it imports pydantic lazily) and exits 130 without a word;
- a library's ``except BaseException:`` (or bare ``except:``) can catch it and carry on, and the
  command then finished with exit status 0 and its table printed.

So :func:`install` (called by the entry point, :func:`vmstoolkit.__main__.main`) replaces that
handler with one that also remembers the signal: :func:`check` raises it again where results are
about to be printed or an output file is about to be put in place, and the entry point ends an
interrupted run with exit status 130 and the line whatever the code under it did with the
exception. The line is printed once a run (:func:`new_line`).

A process started with SIGINT ignored (``nohup``, ``cmd &`` in a script) keeps ignoring it, as
every POSIX program does: :func:`install` changes only Python's default handler.
"""

from __future__ import annotations

import signal
import sys

_pressed = False  # SIGINT came during this run
_said = False  # the line was printed


def _on_sigint(signum, frame) -> None:
    global _pressed
    _pressed = True
    raise KeyboardInterrupt


def install() -> None:
    """Start a run: forget an earlier one's Ctrl-C, and remember this one's (module docstring)."""
    global _pressed, _said
    _pressed = _said = False
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _on_sigint)


def pressed() -> bool:
    """Whether Ctrl-C came during this run (since :func:`install`)."""
    return _pressed


def check() -> None:
    """Raise KeyboardInterrupt again if Ctrl-C came and was swallowed on the way: called before
    results are printed and before an output file is put in place."""
    if _pressed:
        raise KeyboardInterrupt


def handled() -> None:
    """A command dealt with the Ctrl-C itself (``record``: the recorded program was interrupted,
    what it recorded is kept): the run does not end as interrupted because of it."""
    global _pressed
    _pressed = False


def new_line() -> bool:
    """True the first time a run asks: whether the caller is the one to print ``error: interrupted``
    (the command's handler, :meth:`vmstoolkit.cli.Group.invoke`, or else the entry point)."""
    global _said
    first, _said = not _said, True
    return first


def forget_line() -> None:
    """A new command starts (in-process callers, such as tests with Typer's ``CliRunner``, never
    pass through :func:`install`): its Ctrl-C gets its own line."""
    global _said
    _said = False


def ignore_more() -> None:
    """Ignore a second Ctrl-C: the process is on its way out."""
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread
        pass


__all__ = ["check", "forget_line", "handled", "ignore_more", "install", "new_line", "pressed"]

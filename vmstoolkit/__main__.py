"""``python -m vmstoolkit`` and the ``vmstoolkit`` command's entry point.

It imports the CLI inside :func:`main`, so that Ctrl-C while the CLI is still importing (numpy,
Rich, Typer: about a second) ends as an interruption during a command does: one line and exit
status 130, never a traceback. A Ctrl-C that Typer or a library swallowed on the way ends the run
the same way (:mod:`vmstoolkit._interrupt`).
"""

from __future__ import annotations

import sys

from vmstoolkit import _interrupt

INTERRUPTED = 130  # vmstoolkit.cli.INTERRUPTED, which may not be imported yet


def interrupted() -> None:
    """Say so in one line (unless the CLI did) and exit with status 130; a second Ctrl-C while
    exiting is ignored."""
    _interrupt.ignore_more()
    if _interrupt.new_line():
        sys.stderr.write("error: interrupted\n")
        sys.stderr.flush()
    raise SystemExit(INTERRUPTED)


def main() -> None:
    _interrupt.install()
    try:
        from vmstoolkit.cli import app

        app()
    except KeyboardInterrupt:
        interrupted()
    except SystemExit as e:
        if _interrupt.pressed():  # Typer's exit status 130 comes without the line; a swallowed Ctrl-C, with 0
            interrupted()
        raise
    if _interrupt.pressed():
        interrupted()


if __name__ == "__main__":
    main()

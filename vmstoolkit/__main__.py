"""``python -m vmstoolkit`` and the ``vmstoolkit`` command's entry point.

It imports the CLI inside :func:`main`, so that Ctrl-C while the CLI is still importing (numpy,
Rich, Typer: about a second) ends as an interruption during a command does: one line and exit
status 130, never a traceback.
"""

from __future__ import annotations

import signal
import sys

def interrupted() -> None:
    """Say so in one line and exit with status 130; a second Ctrl-C while exiting is ignored."""
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread
        pass
    sys.stderr.write("error: interrupted\n")
    sys.stderr.flush()
    raise SystemExit(130)  # vmstoolkit.cli.INTERRUPTED, which may not be imported yet


def main() -> None:
    try:
        from vmstoolkit.cli import app

        app()
    except KeyboardInterrupt:
        interrupted()
    except SystemExit as e:
        if e.code == 130:  # vmstoolkit.cli.INTERRUPTED: the CLI said so already (Group.invoke)
            try:
                signal.signal(signal.SIGINT, signal.SIG_IGN)
            except ValueError:
                pass
        raise


if __name__ == "__main__":
    main()

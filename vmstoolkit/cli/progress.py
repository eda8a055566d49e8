"""Progress on stderr for long work, the same bar in every command (``replay``, ``sweep``,
``compare``, ``view``, ``experiment fragmentation``): shown on a terminal only, and gone when the
work is done, so that piped or captured output holds the results alone."""

from __future__ import annotations

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from vmstoolkit.cli.common import console


def progress_bar() -> Progress:
    """A transient bar on stderr, disabled unless stderr is a terminal. Use as a context."""
    err = console(stderr=True)
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=err, transient=True, disable=not err.is_terminal)


def event_callback(progress: Progress, task):
    """``progress(done, total)`` for one replay (:func:`vmstoolkit.trace.run.replay_trace`)."""
    return lambda done, total: progress.update(task, completed=done, total=total)


__all__ = ["event_callback", "progress_bar"]

"""Progress of a model run on stderr: a spinner per stage (loading, JIT, planning, each budget's
run or steps) and, when it ends, one line with its wall time, so a user sees what a long start
spends its time on (``rich``; nothing is printed when ``enabled`` is false, the default of the
Python API). ``Stages.times`` keeps each stage's seconds for the rows."""

from __future__ import annotations

import time
from contextlib import contextmanager


class Stages:
    def __init__(self, enabled: bool = False):
        self.enabled = enabled
        self.times: dict[str, float] = {}
        self.t0 = time.perf_counter()
        self._console = None
        if enabled:
            from rich.console import Console

            self._console = Console(stderr=True)

    @contextmanager
    def stage(self, name: str):
        t = time.perf_counter()
        if self._console is None:
            try:
                yield
            finally:
                self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - t
            return
        ok = False
        try:
            with self._console.status(f"{name} ...", spinner="dots"):
                yield
            ok = True
        finally:
            dt = time.perf_counter() - t
            self.times[name] = self.times.get(name, 0.0) + dt
            mark = "[green]done[/]" if ok else "[red]failed[/]"
            self._console.print(f"[dim]{name}[/] {mark} in {dt:.2f} s (at {time.perf_counter() - self.t0:.1f} s)",
                                highlight=False)

    def note(self, text: str) -> None:
        if self._console is not None:
            self._console.print(f"[dim]{text}[/]", highlight=False)

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

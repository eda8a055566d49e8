"""One replay job from names and paths: load, build driver and allocator, replay, clean up.

Kept free of printing so worker processes and the CLI share it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from vmstoolkit.pools import make_allocator, make_driver
from vmstoolkit.trace.loader import load_trace
from vmstoolkit.trace.replay import ReplayResult, replay


def replay_one(
    path: str | Path,
    allocator: str,
    *,
    capacity: int | None = None,
    device: str = "sim",
    touch: bool = False,
    timeline: bool = False,
    options: dict | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> ReplayResult:
    """Replay the snapshot at ``path`` through a fresh ``allocator`` on a fresh driver.

    Everything the allocator held is given back before returning; on the real driver the
    physical memory in use at the peak (``cuMemGetInfo``) is reported in ``result.extra``.
    """
    trace = load_trace(path)
    driver = make_driver(device, capacity=capacity)
    alloc = make_allocator(allocator, driver, **(options or {}))
    total = len(trace.alloc_free_events())
    try:
        result = replay(trace, alloc, touch=touch, timeline=timeline,
                        progress=(lambda done: progress(done, total)) if progress else None)
    finally:
        alloc.close()
        driver.close()
    extra = getattr(driver, "replay_extra", None)
    if callable(extra):
        result.extra.update(extra())
    paths = getattr(alloc, "counts", None)  # how the VMM allocators served each request
    if isinstance(paths, dict):
        result.extra["paths"] = dict(paths)
    return result

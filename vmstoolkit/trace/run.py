"""One replay job from names and paths: load, build driver and allocator, replay, clean up.

Kept free of printing so worker processes and the CLI share it.
"""

from __future__ import annotations

from contextlib import suppress
from pathlib import Path
from typing import Callable

from vmstoolkit.pools import make_allocator, make_driver
from vmstoolkit.trace.events import Trace
from vmstoolkit.trace.loader import load_trace, load_traces
from vmstoolkit.trace.replay import ReplayResult, replay
from vmstoolkit.trace.settings import options_with_settings


def replay_trace(
    trace: Trace,
    allocator: str,
    *,
    capacity: int | None = None,
    device: str = "sim",
    touch: bool = False,
    timeline: bool = False,
    options: dict | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> ReplayResult:
    """Replay ``trace`` through a fresh ``allocator`` on a fresh driver.

    The PyTorch simulations are configured with the snapshot's recorded allocator settings
    unless ``options`` names a ``config`` (``result.settings_applied`` says which). Everything
    the allocator held is given back before returning; on the real driver the physical memory
    in use at the peak (``cuMemGetInfo``) is reported in ``result.extra``.
    """
    opts, applied = options_with_settings(allocator, options, trace.allocator_settings)
    driver = make_driver(device, capacity=capacity)
    alloc = make_allocator(allocator, driver, **opts)
    total = len(trace.alloc_free_events())
    interrupted = False
    try:
        result = replay(trace, alloc, touch=touch, timeline=timeline,
                        progress=(lambda done: progress(done, total)) if progress else None)
    except KeyboardInterrupt:
        # Ctrl-C can land between two updates of the allocator's bookkeeping: a close of that
        # half-made state may fail, and its error must not replace the interrupt
        interrupted = True
        with suppress(Exception):
            alloc.close()
        with suppress(Exception):
            driver.close()
        raise
    finally:
        if not interrupted:
            try:
                alloc.close()
            finally:
                driver.close()
    result.settings_applied = applied
    result.extra.update(driver.replay_extra())
    if alloc.counts:  # how the allocator's paths served the requests (allocators with several)
        result.extra["paths"] = dict(alloc.counts)
    return result


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
    gpu: int | None = None,
    lenient: bool = False,
    max_bytes: int | None = None,
    max_objects: int | None = None,
) -> ReplayResult:
    """Replay device ``gpu`` of the snapshot at ``path`` (``None``: its busiest device); see
    :func:`replay_trace`. ``lenient``, ``max_bytes``, ``max_objects``: as for ``load_trace``."""
    trace = load_trace(path, device=gpu, lenient=lenient, max_bytes=max_bytes, max_objects=max_objects)
    return replay_trace(trace, allocator, capacity=capacity, device=device, touch=touch, timeline=timeline,
                        options=options, progress=progress)


def replay_devices(
    path: str | Path,
    allocators: list[str],
    *,
    gpu: int | None = None,
    lenient: bool = False,
    max_bytes: int | None = None,
    max_objects: int | None = None,
    **kwargs,
) -> list[ReplayResult]:
    """Every device of the snapshot at ``path`` with events (or only ``gpu``) through each of
    ``allocators``: the snapshot is read once. Results device by device, allocators in order."""
    traces = load_traces(path, device=gpu, lenient=lenient, max_bytes=max_bytes, max_objects=max_objects)
    return [replay_trace(t, a, **kwargs) for t in traces for a in allocators]

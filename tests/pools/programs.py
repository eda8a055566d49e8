"""Request programs the pool tests share: random sequences checked after every operation, and
recorded traces replayed at the addresses the real allocator gave."""

from vmstoolkit.errors import OutOfMemoryError


def run_random_program(a, ops, after_empty_cache=None) -> None:
    """``ops``: (kind, size, stream, pick) with kind ``"a"`` (allocate; out of memory is allowed),
    ``"f"`` (free live block ``pick``, or allocate when none is live) or ``"e"`` (empty_cache,
    then ``after_empty_cache(a)`` if given); ``a._check()`` after each, then ``close()`` must give
    the driver everything back."""
    live = []
    for kind, size, stream, pick in ops:
        if kind == "e":
            a.empty_cache()
            if after_empty_cache is not None:
                after_empty_cache(a)
        elif kind == "a" or not live:
            try:
                live.append(a.allocate(size, stream))
            except OutOfMemoryError:
                pass
        else:
            a.free(live.pop(pick % len(live)))
        a._check()
    a.close()
    assert a.driver.is_empty(), a.driver.leak_report()


def replay_at_recorded_addresses(a, trace) -> None:
    """Every request of ``trace`` through ``a`` must land at the address the recording gave it."""
    for e in trace.alloc_free_events():
        if e.action.value == "alloc":
            assert a.allocate(e.size, e.stream) == e.addr, f"request of {e.size} at t={e.time_us}"
        else:
            a.free(e.addr)

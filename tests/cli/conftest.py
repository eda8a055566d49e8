"""Fixtures the CLI tests share."""

import pickle

import pytest


@pytest.fixture(scope="session")
def small_trace(tmp_path_factory):
    """A tiny snapshot: 8 allocations of 60 MiB, freed in pairs (fits 1 GiB, not 256 MiB)."""
    events, addr = [], 1 << 32
    for i in range(8):
        events.append({"action": "alloc", "addr": addr + i * (64 << 20), "size": 60 << 20, "stream": 0, "time_us": i})
        if i % 2:
            for j in (i - 1, i):
                events.append({"action": "free_completed", "addr": addr + j * (64 << 20), "size": 60 << 20,
                               "stream": 0, "time_us": i})
    p = tmp_path_factory.mktemp("t") / "tiny.pickle"
    p.write_bytes(pickle.dumps({"device_traces": [events], "segments": []}))
    return p

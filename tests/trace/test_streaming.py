"""A loaded trace keeps its events as columns: nothing downstream holds every event at once.

The bound is checked with a counting hook on the one place events are made
(``EventColumns._make``), not with a 2M-entry file: the replay of a loaded trace makes events
``EVENT_BATCH`` at a time (the protocol path) or none at all (``paged``'s compiled path)."""

import pickle

import numpy as np
import pytest

from vmstoolkit.pools import make_allocator
from vmstoolkit.trace import events as E
from vmstoolkit.trace import load_trace, replay
from vmstoolkit.trace.events import EventColumns
from vmstoolkit.trace.replay import event_arrays


def _snapshot(n: int) -> dict:
    rng = np.random.default_rng(1)
    entries, live, addr = [], [], 1 << 30
    for i in range(n):
        if live and rng.random() < 0.5:
            a, s = live.pop(int(rng.integers(len(live))))
            entries.append({"action": "free_completed", "addr": a, "size": s, "stream": 0, "time_us": i})
        else:
            s = int(rng.choice([512, 4096, 1 << 20, 3 << 20]))
            entries.append({"action": "alloc", "addr": addr, "size": s, "stream": 0, "time_us": i,
                            "frames": [{"filename": "f.py", "line": i, "name": "g"}]})
            live.append((addr, s))
            addr += s
        if i % 97 == 0:
            entries.append({"action": "segment_alloc", "addr": 0, "size": 2 << 20, "stream": 0, "time_us": i})
    return {"device_traces": [entries], "segments": []}


@pytest.fixture
def snap_file(tmp_path):
    p = tmp_path / "s.pickle"
    p.write_bytes(pickle.dumps(_snapshot(3000), protocol=4))
    return p


@pytest.fixture
def made(monkeypatch):
    """Sizes of the batches of events made, with a batch of 100."""
    sizes = []
    orig = EventColumns._make

    def counting(self, lo, hi):
        out = orig(self, lo, hi)
        sizes.append(len(out))
        return out

    monkeypatch.setattr(E, "EVENT_BATCH", 100)
    monkeypatch.setattr(EventColumns, "_make", counting)
    return sizes


def test_loaded_events_are_columns_equal_to_the_dict_path(snap_file):
    t = load_trace(snap_file)
    assert isinstance(t.events, EventColumns)
    ref = load_trace(pickle.loads(snap_file.read_bytes()))
    assert t.events == ref.events and tuple(ref.events) == t.events  # both ways
    assert t.events[5] == ref.events[5] and t.events[-1] == ref.events[-1] and t.events[3:9] == ref.events[3:9]
    afe, ref_afe = t.alloc_free_events(), ref.alloc_free_events()
    assert isinstance(afe, EventColumns) and list(afe) == ref_afe
    a, b = event_arrays(afe), event_arrays(ref_afe)
    for col in ("is_alloc", "addr", "size", "stream"):
        assert np.array_equal(getattr(a, col), getattr(b, col)), col
    with pytest.raises(IndexError):
        t.events[len(t.events)]


def test_protocol_replay_makes_events_a_batch_at_a_time(snap_file, made):
    t = load_trace(snap_file)
    made.clear()
    r = replay(t, make_allocator("pytorch-caching"), timeline=True)
    assert r.events == len(t.alloc_free_events()) > 1000
    assert made and max(made) <= 100 and sum(made) == r.events
    ref = replay(load_trace(pickle.loads(snap_file.read_bytes())), make_allocator("pytorch-caching"), timeline=True)
    assert (r.peak_reserved, r.peak_allocated, r.unmatched_frees) == (ref.peak_reserved, ref.peak_allocated,
                                                                      ref.unmatched_frees)
    assert np.array_equal(r.timeline["time_us"], ref.timeline["time_us"])


def test_compiled_replay_makes_no_event(snap_file, made):
    t = load_trace(snap_file)
    made.clear()
    r = replay(t, make_allocator("paged"))
    assert made == [] and r.events == len(t.alloc_free_events())
    ref = replay(load_trace(pickle.loads(snap_file.read_bytes())), make_allocator("paged"))
    assert (r.peak_reserved, r.peak_allocated, r.driver_calls) == (ref.peak_reserved, ref.peak_allocated,
                                                                   ref.driver_calls)


def test_load_checks_make_no_event(snap_file, made):
    t = load_trace(snap_file)
    assert sum(made) <= 1 and len(t.events) > 1000  # the checks read plain rows; the first event's time
    assert list(t.events.rows()) == [tuple(e) for e in t.events]

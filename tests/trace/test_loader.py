"""Loading snapshots: real files, dicts, and every kind of bad input."""

import gzip
import pickle

import pytest

from vmstoolkit.errors import TraceFormatError
from vmstoolkit.trace import Action, bundled_trace_paths, load_trace, recorded_stats


def _snapshot(entries):
    return {"segments": [], "device_traces": [entries], "allocator_settings": {"expandable_segments": False}}


def test_bundled_traces_load_typed(traces_dir):
    paths = bundled_trace_paths()
    assert [p.name.split(".")[0] for p in paths] == ["llama-ckpt", "llama-full", "llama-lora", "llama-offload"]
    t = load_trace(traces_dir / "llama-full.caching.pickle.gz")
    assert t.name == "llama-full.caching" and len(t) == 34466
    assert all(isinstance(e.action, Action) for e in t.events)
    assert t.recorded_peak_reserved() == recorded_stats(paths[1])["peak_reserved"]


def test_plain_pickle_and_dict(tmp_path):
    snap = _snapshot([{"action": "alloc", "addr": 4096, "size": 100, "stream": 0, "time_us": 1},
                      {"action": "free_completed", "addr": 4096, "size": 100, "stream": 0, "time_us": 2},
                      {"action": "some_new_action", "addr": 0, "size": 0}])
    p = tmp_path / "x.pickle"
    p.write_bytes(pickle.dumps(snap))
    t = load_trace(p)
    assert t.name == "x" and t.events[2].action is Action.OTHER
    assert len(t.alloc_free_events()) == 2
    assert load_trace(snap).events == t.events


def test_old_snapshots_without_free_completed_use_free_requested():
    t = load_trace(_snapshot([{"action": "alloc", "addr": 1, "size": 5}, {"action": "free_requested", "addr": 1, "size": 5}]))
    assert [e.action for e in t.alloc_free_events()] == [Action.ALLOC, Action.FREE_REQUESTED]


def test_truncated_gzip(tmp_path, traces_dir):
    raw = (traces_dir / "llama-full.caching.pickle.gz").read_bytes()
    p = tmp_path / "cut.pickle.gz"
    p.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(TraceFormatError, match="cut.pickle.gz is a truncated or corrupt gzip"):
        load_trace(p)


def test_truncated_pickle(tmp_path):
    raw = pickle.dumps(_snapshot([{"action": "alloc", "addr": 1, "size": 5}]))
    p = tmp_path / "cut.pickle"
    p.write_bytes(raw[:-10])
    with pytest.raises(TraceFormatError, match="truncated or not a pickle"):
        load_trace(p)


@pytest.mark.parametrize("obj, match", [
    ([1, 2, 3], "not a PyTorch memory snapshot.*got a list"),
    ({"segments": []}, "not a PyTorch memory snapshot.*keys segments"),
    ({"device_traces": []}, "no device traces"),
    ({"device_traces": [[{"action": "free_completed", "addr": 1}]]}, "no 'alloc' events"),
    ({"device_traces": [[{"no_action": 1}]]}, "trace entry 0 is malformed"),
])
def test_not_a_snapshot(tmp_path, obj, match):
    p = tmp_path / "bad.pickle.gz"
    p.write_bytes(gzip.compress(pickle.dumps(obj)))
    with pytest.raises(TraceFormatError, match=match):
        load_trace(p)


def test_code_in_a_pickle_is_refused(tmp_path):
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    p = tmp_path / "evil.pickle"
    p.write_bytes(pickle.dumps({"device_traces": [[Evil()]]}))
    with pytest.raises(TraceFormatError, match="builtins.print, which is not plain data"):
        load_trace(p)


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(TraceFormatError, match="cannot read snapshot"):
        load_trace(tmp_path / "nope.pickle")
    (tmp_path / "empty.pickle").write_bytes(b"")
    with pytest.raises(TraceFormatError, match="is empty"):
        load_trace(tmp_path / "empty.pickle")

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


# --------------------------------------------------------------------------- hardening (issue 15 items 9, 13)
import math  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

from vmstoolkit.trace import load_snapshot, load_snapshot_dict, load_traces  # noqa: E402
from vmstoolkit.trace.snapshot import from_dict  # noqa: E402

E = {"action": "alloc", "addr": 4096, "size": 512, "stream": 0, "time_us": 1}


def _write(tmp_path, obj, name="s.pickle", protocol=None, gz=False):
    raw = obj if isinstance(obj, bytes) else pickle.dumps(obj, protocol=protocol)
    p = tmp_path / name
    p.write_bytes(gzip.compress(raw) if gz else raw)
    return p


def _random_snapshot(rng, n_dev=2, frames=True):
    files = [f"/src/mod{i}.py" for i in range(5)]
    traces = []
    for d in range(n_dev):
        entries, live, addr = [], [], (d + 1) << 40
        for i in range(rng.randrange(1, 60)):
            if live and rng.random() < 0.4:
                a, s = live.pop(rng.randrange(len(live)))
                e = {"action": "free_completed", "addr": a, "size": s, "stream": rng.choice([0, 7]), "time_us": i}
            else:
                s = rng.choice([512, 1 << 20, 3 << 20, rng.randrange(1, 1 << 30)])
                e = {"action": rng.choice(["alloc", "alloc", "segment_alloc", "oom", "something_new"]), "addr": addr,
                     "size": s, "stream": rng.choice([0, 7, 2**40]), "time_us": 10**15 + i}
                if e["action"] == "alloc":
                    live.append((addr, s))
                addr += s + 512
            if frames:
                e["frames"] = [{"filename": rng.choice(files), "line": rng.randrange(1, 900), "name": "f"}
                               for _ in range(rng.randrange(0, 3))]
            e["compile_context"] = "N/A"
            entries.append(e)
        traces.append(entries)
    segs = [{"device": 0, "address": 1 << 30, "total_size": 4 << 20, "stream": 0, "segment_pool_id": (0, 0),
             "frames": [], "blocks": [{"address": 1 << 30, "size": 2 << 20, "requested_size": 2 << 20,
                                       "state": "active_allocated", "frames": []},
                                      {"size": 2 << 20, "requested_size": 0, "state": "inactive"}]}]
    settings = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128", "max_split_size": 128 << 20,
                "garbage_collection_threshold": 0.5, "expandable_segments": False,
                "roundup_power2_divisions": {str(1 << i): (4 if i == 3 else 0) for i in range(16)},
                "tags": {1, 2}, "blob": b"\x00\xff", "c": 1 + 2j}
    return {"segments": segs, "device_traces": traces, "allocator_settings": settings, "external_annotations": []}


def _same(a, b):
    assert len(a.devices) == len(b.devices)
    for x, y in zip(a.devices, b.devices):
        for k in ("action", "addr", "size", "stream", "time_us"):
            assert np.array_equal(getattr(x, k), getattr(y, k)), k
    for k in a.blocks:
        assert np.array_equal(a.blocks[k], b.blocks[k]), k
    assert a.settings == b.settings


@pytest.mark.parametrize("protocol", range(6))
def test_every_protocol_loads_the_same_as_the_dict(tmp_path, protocol):
    """Protocols 0-2 pickle sets and bytes through globals (set, _codecs.encode): admitted."""
    rng = random.Random(protocol)
    for k in range(4):
        snap = _random_snapshot(rng, n_dev=1 + k % 3, frames=k % 2 == 0)
        p = _write(tmp_path, snap, f"p{protocol}-{k}.pickle", protocol=protocol, gz=k == 1)
        fast = load_snapshot(p)
        _same(fast, from_dict(snap, "x"))
        assert load_snapshot_dict(p) == snap


def test_the_scanner_answers_alone_on_real_snapshots(traces_dir):
    from vmstoolkit.trace.reader import scan_file
    from vmstoolkit.trace.source import Limits

    for p in sorted(traces_dir.glob("*.pickle.gz")):
        t = scan_file(p, Limits())
        floor = 15000 if ".frames." in p.name else 30000  # the frames trace: four short steps of a small model
        assert t.fallback == 0 and len(t.ents) > floor, p.name
        _same(load_snapshot(p), from_dict(load_snapshot_dict(p), str(p)))


def test_frames_are_kept_only_when_asked(tmp_path):
    snap = _random_snapshot(random.Random(5), n_dev=1, frames=True)
    p = _write(tmp_path, snap)
    assert load_trace(p).frames is None
    t = load_trace(p, frames=True)
    want = [tuple((f["filename"], f["line"], f["name"]) for f in e["frames"]) for e in snap["device_traces"][0]]
    assert list(t.frames) == want


def test_bytearray_of_two_gib_from_34_bytes_is_refused_fast(tmp_path):
    raw = b"\x80\x02cbuiltins\nbytearray\n\x8a\x05\x00\x00\x00\x80\x00\x85R."  # bytearray(2**31)
    p = _write(tmp_path, raw)
    assert len(raw) <= 34
    t0 = time.perf_counter()
    with pytest.raises(TraceFormatError, match=r"asks for bytearray\(2147483648\), which would allocate"):
        load_trace(p)
    with pytest.raises(TraceFormatError, match="would allocate"):
        load_snapshot_dict(p)
    assert time.perf_counter() - t0 < 5


def test_gzip_bomb_stops_at_the_limit(tmp_path):
    payload = b"N0" * (150 << 20)  # 300 MiB of NONE, POP: a valid pickle stream that never ends
    p = _write(tmp_path, gzip.compress(b"\x80\x02" + payload, 9), "bomb.pickle.gz")
    assert p.stat().st_size < 2 << 20
    with pytest.raises(TraceFormatError, match="decompresses to more than .*gzip bomb"):
        load_trace(p)
    with pytest.raises(TraceFormatError, match=r"decompresses to more than 1.00 MiB \(max_bytes=1048576\)"):
        load_trace(p, max_bytes=1 << 20)


def test_one_entry_referenced_many_times_is_refused(tmp_path):
    e = dict(E)
    p = _write(tmp_path, {"device_traces": [[e] * 1_000_000]}, "refs.pickle.gz", gz=True)
    with pytest.raises(TraceFormatError, match="refers to trace entry 0 again .*never share entries"):
        load_trace(p)
    with pytest.raises(TraceFormatError, match="same object as an earlier entry"):
        load_trace({"device_traces": [[e, e]]})


def test_object_limit_and_raising_it(tmp_path):
    p = _write(tmp_path, {"device_traces": [[dict(E, addr=4096 * (i + 1)) for i in range(100)]]})
    with pytest.raises(TraceFormatError, match=r"builds more than 50 objects \(max_objects\).*--max-objects"):
        load_trace(p, max_objects=50)
    assert len(load_trace(p, max_objects=10_000)) == 100
    with pytest.raises(TraceFormatError, match="max_objects must be a positive integer"):
        load_trace(p, max_objects=0)


@pytest.mark.parametrize("path, what", [("/dev/zero", "a character device"), ("/dev/null", "a character device")])
def test_special_files_are_refused(path, what):
    if not os.path.exists(path):
        pytest.skip(f"{path} does not exist here")
    with pytest.raises(TraceFormatError, match=f"is {what}, not a regular file"):
        load_trace(path)


def test_a_fifo_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "fifo.pickle"
    os.mkfifo(fifo)
    with pytest.raises(TraceFormatError, match="is a FIFO, not a regular file"):
        load_trace(fifo)


@pytest.mark.parametrize("key, value, match", [
    ("size", "4096", "size '4096', not an integer"),
    ("size", 1.9, "size 1.9, not an integer"),
    ("size", True, "size True, not an integer"),
    ("size", math.inf, "size inf, not a finite integer"),
    ("addr", math.nan, "addr nan, not a finite integer"),
    ("stream", 2**200, r"stream 1606938044.*, which does not fit in 64 bits"),
    ("time_us", -math.inf, "time_us -inf, not a finite integer"),
    ("size", [[[[[[[[[[1]]]]]]]]]], r"size \[\[\[...\]\]\], not an integer"),
])
def test_bad_values_name_the_value(tmp_path, key, value, match):
    p = _write(tmp_path, {"device_traces": [[dict(E), {**E, "addr": 8192, key: value}]]})
    with pytest.raises(TraceFormatError, match=f"device 0 trace entry 1 has {match}"):
        load_trace(p)


def test_deeply_nested_entry_is_one_line(tmp_path):
    # by hand, as pickle.dumps itself would recurse: entry 0 is 100k nested lists around a 1
    depth = 100_000
    raw = b"\x80\x04}\x8c\x0ddevice_traces]]" + b"]" * depth + b"K\x01" + b"a" * depth + b"aas."
    p = _write(tmp_path, raw)
    with pytest.raises(TraceFormatError) as exc:
        load_trace(p)
    msg = str(exc.value)
    assert "\n" not in msg and "trace entry 0 is a list, expected a dict: [[[...]]]" in msg and len(msg) < 400


def test_unknown_encoding_is_named(tmp_path):
    raw = b"\x80\x02}X\r\x00\x00\x00device_traces]]}X\x06\x00\x00\x00actionc_codecs\nencode\nX\x01\x00\x00\x00aX\x05\x00\x00\x00rot13\x86Rsaas."
    p = _write(tmp_path, raw)
    with pytest.raises(TraceFormatError, match="unknown encoding 'rot13'"):
        load_trace(p)


def test_refused_opcodes_and_globals(tmp_path):
    p = _write(tmp_path, b"\x80\x02cos\nsystem\nX\x02\x00\x00\x00ls\x85R.")
    with pytest.raises(TraceFormatError, match="os.system, which is not plain data"):
        load_trace(p)
    p = _write(tmp_path, b"\x80\x02}b.", "build.pickle")
    with pytest.raises(TraceFormatError, match="opcode BUILD at byte 3, which builds objects that are not plain data"):
        load_trace(p)


def test_every_device_and_a_missing_one(tmp_path):
    snap = {"device_traces": [[dict(E)], [], [dict(E, addr=1 << 40), dict(E, addr=1 << 41)]]}
    p = _write(tmp_path, snap)
    traces = load_traces(p)
    assert [t.device for t in traces] == [0, 2] and [len(t) for t in traces] == [1, 2]
    assert load_trace(p).device == 2  # the busiest, as before
    assert load_traces(p, device=0)[0].device == 0
    with pytest.raises(TraceFormatError, match=r"has no device 5: it holds traces of devices 0..2 \(with events: 0, 2\)"):
        load_traces(p, device=5)


def test_streams_are_kept(tmp_path):
    p = _write(tmp_path, {"device_traces": [[dict(E, stream=94_000_000_000_000)]]})
    assert load_trace(p).events[0].stream == 94_000_000_000_000


# --------------------------------------------------------------------------- issue 37 attack items 8, 9
def test_a_root_that_is_not_a_dict_is_refused_without_unpickling_it(tmp_path, monkeypatch):
    # 2M small ints in one list: the scanner knows the root is a list, so pickle never builds it
    n = 2_000_000
    raw = b"\x80\x04](" + b"K\x01" * n + b"e."
    p = _write(tmp_path, raw)
    from vmstoolkit.trace import loader

    def unpickle(*a, **k):
        raise AssertionError("the restricted unpickler ran on a file the scanner had already refused")

    monkeypatch.setattr(loader, "_unpickle", unpickle)
    with pytest.raises(TraceFormatError, match="not a PyTorch memory snapshot.*got a list"):
        load_trace(p)


@pytest.mark.parametrize("entry, match", [
    ({"addr": -4096}, r"event 1 has a negative address -4096"),
    ({"size": -1}, r"event 1 has a negative size -1"),
    ({"action": "free_completed", "addr": -4096}, r"event 1 has a negative address -4096"),
])
def test_negative_addresses_and_sizes_are_refused(tmp_path, entry, match):
    p = _write(tmp_path, {"device_traces": [[dict(E), {**E, "addr": 1 << 20, **entry}]]})
    with pytest.raises(TraceFormatError, match=match):
        load_trace(p)
    t = load_trace(p, lenient=True)
    assert t.skipped == {"negative": 1} and len(t.events) == 1 and t.preexisting == ()


def test_negative_block_address_is_refused(tmp_path):
    seg = {"device": 0, "address": -8192, "total_size": 4096, "stream": 0,
           "blocks": [{"size": 4096, "requested_size": 4096, "state": "active_allocated"}]}
    p = _write(tmp_path, {"segments": [seg], "device_traces": [[dict(E)]]})
    with pytest.raises(TraceFormatError, match="block at negative address -8192"):
        load_trace(p)

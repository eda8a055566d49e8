"""Replay jobs: the snapshot's recorded settings, every device, one result each."""

import pickle

import pytest

from vmstoolkit.errors import TraceFormatError
from vmstoolkit.trace.run import replay_devices, replay_one
from vmstoolkit.trace.settings import recorded_alloc_conf
from vmstoolkit.units import MiB

SETTINGS = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128,max_non_split_rounding_mb:64",
            "max_split_size": 128 * MiB, "garbage_collection_threshold": 0.0, "expandable_segments": False,
            "roundup_power2_divisions": {str(1 << i): 0 for i in range(16)}}


def _events(base):
    out, t = [], 0
    for i in range(60):  # sizes that max_split_size changes: 300 MiB blocks, freed, then smaller requests
        out.append({"action": "alloc", "addr": base + i * 1024 * MiB, "size": (300 - 4 * (i % 20)) * MiB, "time_us": t})
        t += 1
        if i % 2:
            out.append({"action": "free_completed", "addr": base + (i - 1) * 1024 * MiB,
                        "size": (300 - 4 * ((i - 1) % 20)) * MiB, "time_us": t})
    return out


@pytest.fixture
def snap_path(tmp_path):
    p = tmp_path / "set.pickle"
    p.write_bytes(pickle.dumps({"device_traces": [_events(1 << 40), [], _events(1 << 44)],
                                "allocator_settings": SETTINGS, "segments": []}))
    return p


def test_recorded_settings_as_a_config_string():
    assert recorded_alloc_conf(SETTINGS) == "max_split_size_mb:128,max_non_split_rounding_mb:64"
    assert recorded_alloc_conf({"max_split_size": -1, "garbage_collection_threshold": 0.8,
                                "roundup_power2_divisions": {"1": 0, "2": 4}}) == \
        "garbage_collection_threshold:0.8,roundup_power2_divisions:[1:0,2:4,4:0,8:0,16:0,32:0,64:0,128:0,256:0," \
        "512:0,1024:0,2048:0,4096:0,8192:0,16384:0,32768:0]"
    assert recorded_alloc_conf({"max_split_size": -1, "expandable_segments": True}) == ""


def test_recorded_settings_are_applied_unless_overridden(snap_path):
    applied = replay_one(snap_path, "pytorch-caching")
    assert applied.settings_applied == "max_split_size_mb:128,max_non_split_rounding_mb:64"
    default = replay_one(snap_path, "pytorch-caching", options={"config": ""})
    assert default.settings_applied == ""
    assert applied.peak_reserved != default.peak_reserved
    same = replay_one(snap_path, "pytorch-caching", options={"config": "max_split_size_mb:128,max_non_split_rounding_mb:64"})
    assert same.peak_reserved == applied.peak_reserved
    exp = replay_one(snap_path, "pytorch-expandable")  # the name decides expandable, settings still apply
    assert exp.settings_applied.startswith("max_split_size_mb:128")
    assert replay_one(snap_path, "vms").settings_applied == ""


def test_every_device_is_replayed_or_the_one_chosen(snap_path):
    rows = replay_devices(snap_path, ["vms", "pytorch-caching"])
    assert [(r.device, r.allocator) for r in rows] == [(0, "vms"), (0, "pytorch-caching"), (2, "vms"),
                                                       (2, "pytorch-caching")]
    assert [r.device for r in replay_devices(snap_path, ["vms"], gpu=2)] == [2]
    with pytest.raises(TraceFormatError, match=r"no device 3: it holds traces of devices 0..2 \(with events: 0, 2\)"):
        replay_devices(snap_path, ["vms"], gpu=3)


def test_ctrl_c_inside_a_replay_is_not_replaced_by_a_cleanup_error(monkeypatch):
    """Ctrl-C can land inside an allocator's bookkeeping, between two of its updates: the close
    that follows may then fail on the half-made state (tests/cli/test_interrupt.py saw
    ``ValueError: ... not in list`` from vms's small pool instead of the interrupt, exit 1 and a
    traceback). The interrupt must come out, whatever the cleanup raised."""
    import vmstoolkit.trace.run as run
    from vmstoolkit.trace.synthetic import synthetic_trace

    closed = []

    def interrupted(trace, alloc, **kw):
        alloc.allocate(3 * MiB)
        alloc.close = lambda: (closed.append("alloc"), (_ for _ in ()).throw(ValueError("half-made state")))
        raise KeyboardInterrupt

    monkeypatch.setattr(run, "replay", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run.replay_trace(synthetic_trace("full", steps=1), "vms")
    assert closed == ["alloc"]  # the cleanup was tried

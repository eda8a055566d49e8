"""The compiled scanner against the reference path (the restricted ``pickle`` unpickler and
:func:`~vmstoolkit.trace.snapshot.from_dict`), on mutated bytes of valid snapshots.

The fast path may refuse more than the reference (a memo index far beyond anything stored),
but it must never accept a file the reference rejects, and when both accept they agree.
"""

import pickle
import pickletools

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from vmstoolkit.errors import TraceFormatError
from vmstoolkit.trace import loader
from vmstoolkit.trace.source import Limits


def _snapshot():
    frames = [{"filename": "train.py", "line": 12, "name": "step"}, {"filename": "m\u00e9.py", "line": 3, "name": "f"}]
    entries = []
    for i in range(6):
        a = 0x7F0000000000 + 4096 * i
        entries.append({"action": "alloc", "addr": a, "size": 512 * (i + 1), "stream": 0, "time_us": 10 * i,
                        "frames": frames})
        if i % 2:
            entries.append({"action": "free_completed", "addr": a, "size": 512 * (i + 1), "stream": 0,
                            "time_us": 10 * i + 5, "frames": []})
    seg = {"device": 0, "address": 0x7F0000000000, "total_size": 2 << 20, "stream": 0,
           "blocks": [{"address": 0x7F0000000000, "size": 512, "requested_size": 512, "state": "active_allocated"},
                      {"size": 1024, "requested_size": 1000, "state": "inactive"}]}
    return {"segments": [seg], "device_traces": [entries, []],
            "allocator_settings": {"expandable_segments": False, "max_split_size": -1, "roundup": [1.5, "x"]}}


SEEDS = {p: pickle.dumps(_snapshot(), protocol=p) for p in (0, 2, 3, 4, 5)}


def _equal(a, b) -> bool:
    if len(a.devices) != len(b.devices) or a.settings != b.settings:
        return False
    for x, y in zip(a.devices, b.devices):
        for col in ("action", "addr", "size", "stream", "time_us"):
            if not np.array_equal(getattr(x, col), getattr(y, col)):
                return False
    return all(np.array_equal(a.blocks[k], b.blocks[k]) for k in a.blocks) and a.blocks.keys() == b.blocks.keys()


def _reference(path):
    """The exact path's answer: SnapshotData, or the TraceFormatError it raises."""
    try:
        return loader.from_dict(loader._unpickle(path, Limits()), str(path))
    except TraceFormatError as e:
        return e


def _check(tmp_path, data: bytes):
    path = tmp_path / "m.pickle"
    path.write_bytes(data)
    try:
        fast = loader.load_snapshot(path)
    except TraceFormatError:
        return  # refusing is always allowed; the reference names its own reason
    ref = _reference(path)
    assert not isinstance(ref, TraceFormatError), f"the loader accepted what pickle rejects: {ref}"
    assert _equal(fast, ref)


def _mutate(seed: bytes, edits) -> bytes:
    b = bytearray(seed)
    for kind, pos, val in edits:
        if not b:
            break
        i = pos % len(b)
        if kind == 0:
            b[i] = val
        elif kind == 1:
            b.insert(i, val)
        elif kind == 2:
            del b[i]
        else:
            del b[i:]
    return bytes(b)


edits = st.lists(st.tuples(st.integers(0, 3), st.integers(0, 1 << 20), st.integers(0, 255)), min_size=1, max_size=3)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(protocol=st.sampled_from(sorted(SEEDS)), edits=edits)
@example(protocol=2, edits=[(0, 1, 90)])  # PROTO 90
@example(protocol=4, edits=[(0, 1, 6)])  # PROTO 6
def test_mutants_are_never_accepted_when_pickle_rejects_them(tmp_path, protocol, edits):
    _check(tmp_path, _mutate(SEEDS[protocol], edits))


def _opcodes(data: bytes):
    return [(op.name, pos, arg) for op, arg, pos in pickletools.genops(data)]


def test_protocol_above_five_is_refused(tmp_path):
    data = bytearray(SEEDS[4])
    data[1] = 90
    p = tmp_path / "p90.pickle"
    p.write_bytes(bytes(data))
    with pytest.raises(TraceFormatError, match="protocol 90"):
        loader.load_snapshot(p)


def test_frame_longer_than_the_file_is_refused(tmp_path):
    data = bytearray(SEEDS[4])
    pos = next(pos for name, pos, _ in _opcodes(bytes(data)) if name == "FRAME")
    data[pos + 1:pos + 9] = (len(data) * 2).to_bytes(8, "little")
    p = tmp_path / "frame.pickle"
    p.write_bytes(bytes(data))
    with pytest.raises(TraceFormatError, match="truncated"):
        loader.load_snapshot(p)


def _with_string(old: str, new: bytes, protocol: int = 4) -> bytes:
    data = SEEDS[protocol]
    enc = old.encode()
    i = data.index(bytes([len(enc)]) + enc)  # SHORT_BINUNICODE's length byte and text
    assert len(new) == len(enc)
    return data[:i + 1] + new + data[i + 1 + len(enc):]


@pytest.mark.parametrize("text", [b"tr\xffin.py", b"tr\xc3in.py", b"\x80rain.py"])
def test_invalid_utf8_is_refused(tmp_path, text):
    p = tmp_path / "u.pickle"
    p.write_bytes(_with_string("train.py", text))
    with pytest.raises(TraceFormatError, match="UTF-8|utf-8"):
        loader.load_snapshot(p)


def test_surrogates_are_accepted_as_pickle_accepts_them(tmp_path):
    # pickle decodes with 'surrogatepass': an encoded lone surrogate is valid
    p = tmp_path / "s.pickle"
    p.write_bytes(_with_string("train.py", b"tr\xed\xa0\x80.py"))
    assert len(loader.load_snapshot(p).devices[0]) == 9


def test_non_ascii_binstring_is_refused(tmp_path):
    data = pickle.dumps(_snapshot(), protocol=2)
    # protocol 2 writes str as BINUNICODE; make one SHORT_BINSTRING with a byte pickle's ASCII refuses
    i = data.index(b"X\x08\x00\x00\x00train.py")
    bad = data[:i] + b"U\x08tr\xe9in.py" + data[i + 13:]
    ref = tmp_path / "ref.pickle"
    ref.write_bytes(bad)
    assert isinstance(_reference(ref), TraceFormatError)
    with pytest.raises(TraceFormatError):
        loader.load_snapshot(ref)

"""What a snapshot holds for replay, as columns: per device its events, the blocks its segments
held when the snapshot was taken, and the recorded allocator settings.

Built either from the scanner's tables (:func:`from_scan`, the fast path) or from the snapshot
dict (:func:`from_dict`, the exact path, which names every bad value); both give the same
:class:`SnapshotData` for the same file, which the tests check on every pickle protocol.
"""

from __future__ import annotations

import math
import reprlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from vmstoolkit.errors import TraceFormatError
from vmstoolkit.trace import scan as S
from vmstoolkit.trace.events import Action

ACTIONS = [Action(a) for a in S.ACTION_NAMES] + [Action.OTHER]
"""Action codes of the columns: index into this list (the scanner's order, OTHER last)."""
OTHER_CODE = len(ACTIONS) - 1
_ACTION_CODE = {a.value: i for i, a in enumerate(ACTIONS[:-1])}
STATES = list(S.STATE_NAMES) + ["other"]
_STATE_CODE = {s: i for i, s in enumerate(S.STATE_NAMES)}
INT64_MAX = (1 << 63) - 1

_repr = reprlib.Repr()
_repr.maxlevel, _repr.maxstring, _repr.maxother, _repr.maxlist, _repr.maxdict = 2, 40, 40, 4, 4


def short_repr(value: Any) -> str:
    """A bounded repr for messages: never recursion, never megabytes."""
    try:
        return _repr.repr(value)
    except Exception:  # noqa: BLE001 - a message must never fail
        return f"<{type(value).__name__}>"


@dataclass
class DeviceEvents:
    """One device's trace entries as columns (``action`` codes index :data:`ACTIONS`)."""

    action: np.ndarray
    addr: np.ndarray
    size: np.ndarray
    stream: np.ndarray
    time_us: np.ndarray
    frames: list | None = None

    def __len__(self) -> int:
        return len(self.action)


@dataclass
class SnapshotData:
    devices: list[DeviceEvents]
    """Index = device number (position in ``device_traces``)."""
    blocks: dict[str, np.ndarray]
    """Columns ``device, address, size, requested_size, state, stream`` of every segment block."""
    settings: dict = field(default_factory=dict)


def _empty_device() -> DeviceEvents:
    z = np.zeros(0, np.int64)
    return DeviceEvents(np.zeros(0, np.int8), z, z, z, z)


# --------------------------------------------------------------------------- fast path
class Fallback(Exception):
    """The scanner's tables cannot answer; read the file exactly."""


def from_scan(t) -> SnapshotData:
    """A :class:`SnapshotData` from the scanner's tables (raises :class:`Fallback` if any
    check fails). Cost: vectorized, O(entries)."""
    if t.fallback or t.regs[S.R_DTROW] == 0:
        raise Fallback
    lists = t.lists
    dt_row = int(t.regs[S.R_DTROW]) - 1
    n_dev = int(lists[dt_row, S.L_COUNT])
    ents = t.ents
    if len(ents) and ((ents[:, S.E_OWNER] < 0).any() or (ents[:, S.E_FLAGS] & S.FL_ACTION == 0).any()):
        raise Fallback  # an entry never attached, or without an action: let the exact path say what
    dev_of_list = lists[:, S.L_ORDER]
    roles = lists[:, S.L_ROLE]
    devices = [_empty_device() for _ in range(n_dev)]
    if len(ents):
        owners = ents[:, S.E_OWNER]
        if (roles[owners] != S.R_DEV).any() or (dev_of_list[owners] < 0).any():
            raise Fallback
        dev = dev_of_list[owners]
        action = ents[:, S.E_ACTION]
        action = np.where(action == 99, OTHER_CODE, action).astype(np.int8)
        order = np.argsort(dev, kind="stable")
        bounds = np.searchsorted(dev[order], np.arange(n_dev + 1))
        for d in range(n_dev):
            idx = order[bounds[d]:bounds[d + 1]]
            devices[d] = DeviceEvents(action[idx], ents[idx, S.E_ADDR], ents[idx, S.E_SIZE],
                                      ents[idx, S.E_STREAM], ents[idx, S.E_TIME])
    blocks = _blocks_from_scan(t)
    settings = _settings_from_scan(t)
    return SnapshotData(devices=devices, blocks=blocks, settings=settings)


def _blocks_from_scan(t) -> dict[str, np.ndarray]:
    segs, blks, lists = t.segs, t.blks, t.lists
    if t.regs[S.R_SEGL] == 0 or len(blks) == 0:
        return _blocks_columns([])
    if (blks[:, S.B_OWNER] < 0).any():
        raise Fallback
    seg_of = lists[blks[:, S.B_OWNER], S.L_ORDER]  # the segment row owning each block list
    if (seg_of < 0).any() or (segs[seg_of, S.S_ORDER] < 0).any():
        raise Fallback
    rows = []
    next_addr: dict[int, int] = {}
    for i in range(len(blks)):  # blocks without an address follow the one before in their segment
        s = int(seg_of[i])
        size = int(blks[i, S.B_SIZE])
        if blks[i, S.B_FLAGS] & S.FL_BLOCK_ADDRESS:
            addr = int(blks[i, S.B_ADDRESS])
        else:
            addr = next_addr.get(s, int(segs[s, S.S_ADDRESS]))
        next_addr[s] = addr + size
        state = int(blks[i, S.B_STATE])
        rows.append((int(segs[s, S.S_DEVICE]), addr, size, int(blks[i, S.B_REQ]),
                     state if 0 <= state < len(S.STATE_NAMES) else len(S.STATE_NAMES), int(segs[s, S.S_STREAM])))
    return _blocks_columns(rows)


def _blocks_columns(rows: list[tuple]) -> dict[str, np.ndarray]:
    a = np.array(rows, dtype=np.int64).reshape(-1, 6)
    return {k: a[:, i] for i, k in enumerate(("device", "address", "size", "requested_size", "state", "stream"))}


def _text(t, kind: int, val: int, aux: int) -> str:
    if kind != S.K_STR:
        raise Fallback
    if aux >= 0:
        off, ln, fmt = (int(x) for x in t.strs[aux])
        raw = bytes(t.arena[off:off + ln])
        try:
            if fmt == S.FMT_UTF8:
                return raw.decode("utf-8", "surrogatepass")
            if fmt == S.FMT_ASCII:
                return raw.decode("ascii")
        except UnicodeDecodeError:
            raise Fallback from None
        raise Fallback  # protocol 0 text with escapes: the exact path decodes it
    if val >= 0:
        return S.KNOWN[val]
    raise Fallback


def _settings_from_scan(t) -> dict:
    if t.regs[S.R_SETC] == 0:
        return {}
    root = int(t.regs[S.R_SETC]) - 1
    conts: dict[int, Any] = {}
    kinds: dict[int, bool] = {}  # container -> is a dict
    recs = t.srec
    for r in recs:  # containers first, so values can point to any of them
        if r[S.SR_KKIND] >= 0:
            kinds.setdefault(int(r[S.SR_CONT]), True)
        else:
            kinds.setdefault(int(r[S.SR_CONT]), False)
    for c, is_dict in kinds.items():
        conts[c] = {} if is_dict else []
    conts.setdefault(root, {})

    def value(kind: int, val: int, aux: int) -> Any:
        if kind == S.K_NONE:
            return None
        if kind == S.K_BOOL:
            return bool(val)
        if kind == S.K_INT:
            return int(val)
        if kind == S.K_FLOAT:
            if aux >= 0:
                raise Fallback  # protocol 0 text float
            return float(np.int64(val).view(np.float64))  # BINFLOAT's bits
        if kind == S.K_STR:
            return _text(t, kind, val, aux)
        if kind == S.K_CONT and (aux & 15) == S.R_SET:
            c = int(val)
            if c not in conts:
                conts[c] = {} if (aux >> 4) == S.T_DICT else []
            return conts[c]
        raise Fallback

    for r in recs:
        c = conts[int(r[S.SR_CONT])]
        v = value(int(r[S.SR_VKIND]), int(r[S.SR_VVAL]), int(r[S.SR_VAUX]))
        if isinstance(c, dict):
            k = value(int(r[S.SR_KKIND]), int(r[S.SR_KVAL]), int(r[S.SR_KAUX]))
            try:
                c[k] = v
            except TypeError:
                raise Fallback from None
        else:
            c.append(v)
    return conts[root]


# --------------------------------------------------------------------------- exact path
def _int_field(entry: dict, key: str, where: str) -> int:
    v = entry.get(key, 0)
    if v is None:
        return 0
    if type(v) is not int:  # bool, float, str, ...: never guessed at
        what = "not an integer"
        if isinstance(v, float) and not math.isfinite(v):
            what = "not a finite integer"
        raise TraceFormatError(f"{where} has {key} {short_repr(v)}, {what}")
    if not -INT64_MAX - 1 <= v <= INT64_MAX:
        raise TraceFormatError(f"{where} has {key} {short_repr(v)}, which does not fit in 64 bits")
    return v


def _device_traces(snapshot: Any, where: str) -> list:
    if not isinstance(snapshot, dict) or "device_traces" not in snapshot:
        kind = type(snapshot).__name__
        keys = ", ".join(short_repr(k) if not isinstance(k, str) else k for k in list(snapshot)[:5]) \
            if isinstance(snapshot, dict) else ""
        raise TraceFormatError(
            f"{where} is not a PyTorch memory snapshot: expected a dict with 'device_traces' "
            f"(from torch.cuda.memory._snapshot()), got a {kind}" + (f" with keys {keys}" if keys else ""))
    traces = snapshot["device_traces"]
    if not isinstance(traces, list):
        raise TraceFormatError(f"{where}: 'device_traces' is a {type(traces).__name__}, expected a list")
    return traces


def from_dict(snapshot: Any, where: str, *, frames: bool = False) -> SnapshotData:
    """A :class:`SnapshotData` from a snapshot dict, checking every value it keeps."""
    traces = _device_traces(snapshot, where)
    devices = []
    for d, entries in enumerate(traces):
        if not isinstance(entries, list):
            raise TraceFormatError(f"{where}: the trace of device {d} is a {type(entries).__name__}, expected a list")
        n = len(entries)
        cols = np.zeros((5, n), dtype=np.int64)
        fr = [] if frames else None
        seen: set[int] = set()
        for i, e in enumerate(entries):
            loc = f"{where}: device {d} trace entry {i}"
            if not isinstance(e, dict):
                raise TraceFormatError(f"{loc} is a {type(e).__name__}, expected a dict: {short_repr(e)}")
            if id(e) in seen:
                raise TraceFormatError(f"{loc} is the same object as an earlier entry: snapshots never share entries")
            seen.add(id(e))
            if "action" not in e:
                raise TraceFormatError(f"{loc} is malformed (no 'action'): {short_repr(e)}")
            a = e["action"]
            if not isinstance(a, str):
                raise TraceFormatError(f"{loc} has action {short_repr(a)}, expected a string")
            cols[0, i] = _ACTION_CODE.get(a, OTHER_CODE)
            cols[1, i] = _int_field(e, "addr", loc)
            cols[2, i] = _int_field(e, "size", loc)
            cols[3, i] = _int_field(e, "stream", loc)
            cols[4, i] = _int_field(e, "time_us", loc)
            if frames:
                fr.append(_frames(e.get("frames")))
        devices.append(DeviceEvents(cols[0].astype(np.int8), cols[1], cols[2], cols[3], cols[4], fr))
    rows = []
    segments = snapshot.get("segments") or []
    if isinstance(segments, list):
        for si, seg in enumerate(segments):
            if not isinstance(seg, dict):
                continue
            loc = f"{where}: segment {si}"
            dev, base = _int_field(seg, "device", loc), _int_field(seg, "address", loc)
            stream = _int_field(seg, "stream", loc)
            addr = base
            blocks = seg.get("blocks") or []
            for bi, b in enumerate(blocks if isinstance(blocks, list) else []):
                if not isinstance(b, dict):
                    continue
                bl = f"{loc} block {bi}"
                size = _int_field(b, "size", bl)
                if "address" in b or "addr" in b:
                    addr = _int_field(b, "address" if "address" in b else "addr", bl)
                state = b.get("state")
                rows.append((dev, addr, size, _int_field(b, "requested_size", bl),
                             _STATE_CODE.get(state, len(S.STATE_NAMES)) if isinstance(state, str) else len(S.STATE_NAMES),
                             stream))
                addr += size
    settings = snapshot.get("allocator_settings") or {}
    return SnapshotData(devices=devices, blocks=_blocks_columns(rows),
                        settings=settings if isinstance(settings, dict) else {})


def _frames(value: Any) -> tuple:
    """``(filename, line, name)`` of each recorded frame, innermost first."""
    if not isinstance(value, list):
        return ()
    out = []
    for f in value:
        if isinstance(f, dict):
            out.append((str(f.get("filename", "")), f.get("line", 0) if type(f.get("line")) is int else 0,
                        str(f.get("name", ""))))
    return tuple(out)

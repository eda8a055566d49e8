"""Load PyTorch memory snapshots without torch.

Accepts what ``torch.cuda.memory._dump_snapshot`` writes (a pickle, optionally gzipped: the
gzip magic decides, not the name) and the dict ``torch.cuda.memory._snapshot()`` returns.
Unpickling is restricted to builtin types, so a snapshot cannot run code and torch is never
needed. Every failure is a :class:`~vmstoolkit.errors.TraceFormatError` naming the file.
"""

from __future__ import annotations

import gzip
import io
import pickle
import zlib
from pathlib import Path
from typing import Any

from vmstoolkit.errors import TraceFormatError
from vmstoolkit.trace.events import Action, Trace, TraceEvent

_SAFE_BUILTINS = {"dict", "list", "tuple", "set", "frozenset", "int", "float", "str", "bytes", "bool", "complex", "bytearray"}
_ACTIONS = {a.value: a for a in Action}


class _SnapshotUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == "builtins" and name in _SAFE_BUILTINS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"snapshot refers to {module}.{name}, which is not plain data")


def _read_bytes(path: Path) -> bytes:
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise TraceFormatError(f"cannot read snapshot {path}: {e.strerror or e}") from None
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as e:
            raise TraceFormatError(f"snapshot {path} is a truncated or corrupt gzip file ({e})") from None
    return raw


def load_snapshot_dict(path: str | Path) -> dict:
    """The raw snapshot dict stored in ``path``."""
    path = Path(path)
    raw = _read_bytes(path)
    if not raw:
        raise TraceFormatError(f"snapshot {path} is empty")
    try:
        obj = _SnapshotUnpickler(io.BytesIO(raw)).load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError, KeyError, AttributeError,
            MemoryError, OverflowError, UnicodeDecodeError) as e:
        raise TraceFormatError(f"snapshot {path} is truncated or not a pickle ({type(e).__name__}: {e})") from None
    return obj


def _device_traces(snapshot: Any, where: str) -> list:
    if not isinstance(snapshot, dict) or "device_traces" not in snapshot:
        kind = type(snapshot).__name__
        keys = ", ".join(map(str, list(snapshot)[:5])) if isinstance(snapshot, dict) else ""
        raise TraceFormatError(
            f"{where} is not a PyTorch memory snapshot: expected a dict with 'device_traces' "
            f"(from torch.cuda.memory._snapshot()), got a {kind}" + (f" with keys {keys}" if keys else ""))
    traces = snapshot["device_traces"]
    if not isinstance(traces, list):
        raise TraceFormatError(f"{where}: 'device_traces' is a {type(traces).__name__}, expected a list")
    return traces


def _event(entry: Any, where: str, i: int) -> TraceEvent:
    try:
        action = _ACTIONS.get(entry["action"], Action.OTHER)
        return TraceEvent(action, int(entry.get("addr", 0) or 0), int(entry.get("size", 0) or 0),
                          int(entry.get("stream", 0) or 0), int(entry.get("time_us", 0) or 0))
    except (TypeError, KeyError, ValueError, AttributeError) as e:
        raise TraceFormatError(f"{where}: trace entry {i} is malformed ({type(e).__name__}: {e}): {entry!r:.200}") from None


def trace_from_snapshot(snapshot: dict, *, name: str = "snapshot", device: int | None = None, source: str = "") -> Trace:
    """Typed :class:`Trace` of one device of a snapshot dict.

    ``device=None`` picks the device with the most trace entries.
    """
    where = source or name
    traces = _device_traces(snapshot, where)
    if not traces:
        raise TraceFormatError(f"{where} holds no device traces (was memory history recorded?)")
    if device is None:
        device = max(range(len(traces)), key=lambda d: len(traces[d]) if isinstance(traces[d], list) else -1)
    if not 0 <= device < len(traces):
        raise TraceFormatError(f"{where} has traces for devices 0..{len(traces) - 1}, not device {device}")
    entries = traces[device]
    if not isinstance(entries, list):
        raise TraceFormatError(f"{where}: the trace of device {device} is a {type(entries).__name__}, expected a list")
    events = tuple(_event(e, where, i) for i, e in enumerate(entries))
    if not any(e.action is Action.ALLOC for e in events):
        raise TraceFormatError(f"{where}: device {device} has no 'alloc' events to replay ({len(events)} entries)")
    settings = snapshot.get("allocator_settings") or {}
    return Trace(name=name, events=events, device=device, source=source,
                 allocator_settings=settings if isinstance(settings, dict) else {})


def trace_name(path: str | Path) -> str:
    """``llama-full.caching`` for ``.../llama-full.caching.pickle.gz``."""
    name = Path(path).name
    for suffix in (".gz", ".pickle", ".pkl"):
        if name.endswith(suffix):
            name = name[: -len(suffix)]
    return name


def load_trace(source: str | Path | dict, *, device: int | None = None, name: str | None = None) -> Trace:
    """Load a :class:`Trace` from a snapshot file (``.pickle``/``.pickle.gz``) or dict."""
    if isinstance(source, dict):
        return trace_from_snapshot(source, name=name or "snapshot", device=device)
    path = Path(source)
    snap = load_snapshot_dict(path)
    return trace_from_snapshot(snap, name=name or trace_name(path), device=device, source=str(path))

"""Load PyTorch memory snapshots without torch, streaming, bounded and safe.

Accepts what ``torch.cuda.memory._dump_snapshot`` writes (a pickle, optionally gzipped: the
gzip magic decides, not the name) and the dict ``torch.cuda.memory._snapshot()`` returns.

- No code from the file ever runs: only plain data is unpickled (``set``, ``frozenset``,
  ``bytes``, ``bytearray``, ``complex`` and ``_codecs.encode`` with arguments that cannot
  allocate more than the file holds), and torch is never needed.
- Bounded: only regular files are read; at most ``max_bytes`` decompressed bytes (by default
  32 GiB, and for gzip at most 100 times the file's size) and ``max_objects`` pickle values.
- Fast: :mod:`.scan` reads the pickle in compiled code and keeps five integers per entry;
  frames are dropped unless ``frames=True``. Anything it does not expect sends the file through
  the restricted ``pickle`` unpickler, after the scan has checked every limit.

Every failure is a :class:`~vmstoolkit.errors.TraceFormatError` naming the file and the value.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

from vmstoolkit.errors import TraceFormatError
from vmstoolkit.trace.events import Action, EventColumns, Trace
from vmstoolkit.trace.snapshot import ACTIONS, Fallback, SnapshotData, from_dict, from_scan, short_repr
from vmstoolkit.trace.source import CHUNK, BoundedReader, Limits, check_limits
from vmstoolkit.trace.validate import check_events

_ENCODINGS = {"latin1", "latin-1", "utf-8", "utf8", "ascii"}


def _safe_set(*args):
    _iterable_arg("set", args)
    return set(*args)


def _safe_frozenset(*args):
    _iterable_arg("frozenset", args)
    return frozenset(*args)


def _iterable_arg(name: str, args: tuple) -> None:
    if len(args) > 1 or (args and not isinstance(args[0], (list, tuple, set, frozenset))):
        raise pickle.UnpicklingError(f"{name}{short_repr(args)} is not how plain data is pickled")


def _safe_bytes(*args):
    if len(args) > 1 or (args and not isinstance(args[0], (bytes, bytearray, list, tuple))):
        raise pickle.UnpicklingError(f"bytes{short_repr(args)} would allocate memory the file does not hold")
    return bytes(*args)


def _safe_bytearray(*args):
    if len(args) == 2 and isinstance(args[0], str) and args[1] in _ENCODINGS:
        return bytearray(*args)
    if len(args) > 1 or (args and not isinstance(args[0], (bytes, bytearray, list, tuple))):
        raise pickle.UnpicklingError(f"bytearray{short_repr(args)} would allocate memory the file does not hold")
    return bytearray(*args)


def _safe_encode(obj, encoding="utf-8", *rest):
    if rest or not isinstance(obj, str) or not isinstance(encoding, str):
        raise pickle.UnpicklingError(f"_codecs.encode{short_repr((obj, encoding, *rest))} is not how bytes are pickled")
    if encoding not in _ENCODINGS:
        raise pickle.UnpicklingError(f"unknown encoding {short_repr(encoding)} for bytes")
    return obj.encode(encoding)


def _safe_complex(*args):
    if len(args) > 2 or not all(type(a) in (int, float) for a in args):
        raise pickle.UnpicklingError(f"complex{short_repr(args)} is not how plain data is pickled")
    return complex(*args)


_SAFE = {("builtins", "set"): _safe_set, ("builtins", "frozenset"): _safe_frozenset,
         ("builtins", "bytes"): _safe_bytes, ("builtins", "bytearray"): _safe_bytearray,
         ("builtins", "complex"): _safe_complex, ("_codecs", "encode"): _safe_encode}


class _SnapshotUnpickler(pickle.Unpickler):
    """Plain data only: every global it may load is a checked wrapper from ``_SAFE``."""

    def find_class(self, module: str, name: str) -> Any:
        mod = "builtins" if module == "__builtin__" else module
        f = _SAFE.get((mod, name))
        if f is None:
            raise pickle.UnpicklingError(f"snapshot refers to {module}.{name}, which is not plain data")
        return f

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("snapshot refers to a persistent id, which is not plain data")


def _limits(max_bytes: int | None, max_objects: int | None) -> Limits:
    lim = Limits(max_bytes=max_bytes, max_objects=max_objects)
    check_limits(lim)
    return lim


def _unpickle(path: Path, limits: Limits) -> Any:
    """The restricted unpickler over the bounded stream. Call only on a file the scanner accepted."""
    with BoundedReader(path, limits) as raw:
        f = io.BufferedReader(raw, CHUNK)
        try:
            return _SnapshotUnpickler(f).load()
        except TraceFormatError:
            raise
        except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError, KeyError, AttributeError,
                MemoryError, OverflowError, UnicodeDecodeError, RecursionError, LookupError) as e:
            raise TraceFormatError(f"snapshot {path} is truncated or not a pickle ({type(e).__name__}: {e})") from None


def load_snapshot_dict(path: str | Path, *, max_bytes: int | None = None, max_objects: int | None = None) -> dict:
    """The raw snapshot dict stored in ``path`` (frames and all), after the scanner has checked
    the file against the limits. Memory: that of ``pickle.load``."""
    from vmstoolkit.trace.reader import scan_file

    path = Path(path)
    limits = _limits(max_bytes, max_objects)
    scan_file(path, limits)
    return _unpickle(path, limits)


def load_snapshot(path: str | Path, *, frames: bool = False, max_bytes: int | None = None,
                  max_objects: int | None = None) -> SnapshotData:
    """Columns of every device's events, the segments' blocks and the allocator settings.

    Without ``frames`` the compiled scanner answers alone (about 1 s and 100 MB per 500k
    entries, see ``benchmarks/loader_bench.py``); with ``frames``, or when the scanner meets
    something it does not expect, the restricted unpickler reads the file once more.
    """
    from vmstoolkit.trace.reader import scan_file

    path = Path(path)
    limits = _limits(max_bytes, max_objects)
    tables = scan_file(path, limits)
    if not frames:
        try:
            return from_scan(tables)
        except Fallback:
            pass
    del tables
    return from_dict(_unpickle(path, limits), str(path), frames=frames)


def _events(dev) -> EventColumns:
    """The device's events as columns: no ``TraceEvent`` is kept (33 bytes per event, not 180)."""
    return EventColumns(dev.action, dev.addr, dev.size, dev.stream, dev.time_us, ACTIONS)


def _trace(data: SnapshotData, d: int, *, name: str, source: str, where: str, lenient: bool) -> Trace:
    dev = data.devices[d]
    events = _events(dev)
    if not events.codes(Action.ALLOC).any():
        raise TraceFormatError(f"{where}: device {d} has no 'alloc' events to replay ({len(events)} entries)")
    b = data.blocks
    live = (b["device"] == d) & (b["state"] == 0)  # active_allocated
    blocks = list(zip(b["address"][live].tolist(), b["requested_size"][live].tolist(), b["stream"][live].tolist()))
    checked = check_events(events, blocks, where=f"{where} (device {d})", lenient=lenient)
    frames = None
    if dev.frames is not None:
        frames = tuple(dev.frames) if checked.kept is None else tuple(dev.frames[j] for j in checked.kept)
    return Trace(name=name, events=checked.events, device=d, source=source, allocator_settings=data.settings,
                 preexisting=checked.preexisting, skipped=checked.skipped, frames=frames)


def devices_with_events(data: SnapshotData) -> list[int]:
    """Devices whose trace has at least one entry, in device order."""
    return [d for d, dev in enumerate(data.devices) if len(dev)]


def traces_from_data(data: SnapshotData, *, name: str, source: str = "", device: int | None = None,
                     all_devices: bool = False, lenient: bool = False) -> list[Trace]:
    """The :class:`Trace` of ``device``; or, with ``device=None``, of every device with events
    (``all_devices``) or of the busiest one."""
    where = source or name
    n = len(data.devices)
    if n == 0:
        raise TraceFormatError(f"{where} holds no device traces (was memory history recorded?)")
    if device is not None:
        if isinstance(device, bool) or not isinstance(device, int) or not 0 <= device < n:
            present = ", ".join(str(d) for d in devices_with_events(data)) or "none with events"
            raise TraceFormatError(f"{where} has no device {device!r}: it holds traces of devices 0..{n - 1} "
                                   f"(with events: {present})")
        return [_trace(data, device, name=name, source=source, where=where, lenient=lenient)]
    if all_devices:
        chosen = [d for d in devices_with_events(data)
                  if bool((data.devices[d].action == 0).any())]  # 0: alloc
        if not chosen:
            busiest = max(range(n), key=lambda d: len(data.devices[d]))
            chosen = [busiest]  # raises "no 'alloc' events" naming it
        return [_trace(data, d, name=name, source=source, where=where, lenient=lenient) for d in chosen]
    busiest = max(range(n), key=lambda d: len(data.devices[d]))
    return [_trace(data, busiest, name=name, source=source, where=where, lenient=lenient)]


def trace_from_snapshot(snapshot: dict, *, name: str = "snapshot", device: int | None = None, source: str = "",
                        lenient: bool = False, frames: bool = False) -> Trace:
    """Typed :class:`Trace` of one device of a snapshot dict (``device=None``: the device with
    the most trace entries)."""
    data = from_dict(snapshot, source or name, frames=frames)
    return traces_from_data(data, name=name, source=source, device=device, lenient=lenient)[0]


def trace_name(path: str | Path) -> str:
    """``llama-full.caching`` for ``.../llama-full.caching.pickle.gz``. A character that does not
    print (a newline, a tab, an escape) shows escaped, as ``repr`` writes it: names go into
    table rows and captions, which one such character would split or recolour."""
    name = Path(path).name
    for suffix in (".gz", ".pickle", ".pkl"):
        if name.endswith(suffix):
            name = name[: -len(suffix)]
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in name)


def load_traces(source: str | Path | dict, *, device: int | None = None, name: str | None = None,
                lenient: bool = False, frames: bool = False, max_bytes: int | None = None,
                max_objects: int | None = None) -> list[Trace]:
    """One :class:`Trace` per device with events (or only ``device``), from a file or dict."""
    if isinstance(source, dict):
        data = from_dict(source, name or "snapshot", frames=frames)
        return traces_from_data(data, name=name or "snapshot", device=device, all_devices=True, lenient=lenient)
    path = Path(source)
    data = load_snapshot(path, frames=frames, max_bytes=max_bytes, max_objects=max_objects)
    return traces_from_data(data, name=name or trace_name(path), source=str(path), device=device,
                            all_devices=True, lenient=lenient)


def load_trace(source: str | Path | dict, *, device: int | None = None, name: str | None = None,
               lenient: bool = False, frames: bool = False, max_bytes: int | None = None,
               max_objects: int | None = None) -> Trace:
    """Load a :class:`Trace` from a snapshot file (``.pickle``/``.pickle.gz``) or dict:
    ``device``, or the device with the most entries. See the module docstring for the limits;
    ``lenient`` skips corrupt events (:mod:`.validate`) instead of raising."""
    if isinstance(source, dict):
        return trace_from_snapshot(source, name=name or "snapshot", device=device, lenient=lenient, frames=frames)
    path = Path(source)
    data = load_snapshot(path, frames=frames, max_bytes=max_bytes, max_objects=max_objects)
    return traces_from_data(data, name=name or trace_name(path), source=str(path), device=device,
                            lenient=lenient)[0]

"""PyTorch memory snapshots: loading, typed events, replay."""

from vmstoolkit.trace.bundled import bundled_trace_paths, recorded_stats
from vmstoolkit.trace.events import Action, Trace, TraceEvent
from vmstoolkit.trace.loader import (
    load_snapshot, load_snapshot_dict, load_trace, load_traces, trace_from_snapshot, trace_name,
)
from vmstoolkit.trace.replay import ReplayResult, replay

__all__ = [
    "Action", "Trace", "TraceEvent", "ReplayResult", "replay", "load_trace", "load_traces", "load_snapshot",
    "load_snapshot_dict",
    "trace_from_snapshot", "trace_name", "bundled_trace_paths", "recorded_stats",
]

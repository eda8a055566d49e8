"""Replay results stay byte-identical across refactors.

``replay_golden.json`` holds, for every bundled trace through every allocator (and a few option
settings), the result's figures and a SHA-256 of its per-event allocated/reserved bytes. It was
written by the code before the ``pools/`` tree was reorganized (issue 19, commit 7430705) and must
only be rewritten on purpose, when a change is meant to alter replay results:

    python tests/trace/test_replay_golden.py --write
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from vmstoolkit.trace.bundled import bundled_trace_paths
from vmstoolkit.trace.loader import load_trace
from vmstoolkit.trace.run import replay_trace

GOLDEN = Path(__file__).with_name("replay_golden.json")
ALLOCATORS = ["native", "gmlake", "vms", "pytorch-caching", "pytorch-expandable", "paged"]
VARIANTS = [(a, {}) for a in ALLOCATORS] + [
    ("paged", {"aliases": True, "slack_pages": 64}),
    ("vms", {"reuse_max_ratio": 2}),
    ("pytorch-caching", {"config": "max_split_size_mb:128"}),
]
TRACES = [p for mode in ("caching", "expandable") for p in bundled_trace_paths(mode)]


def _key(path: Path, allocator: str, options: dict) -> str:
    opts = ",".join(f"{k}={v}" for k, v in sorted(options.items()))
    return f"{path.name}:{allocator}" + (f":{opts}" if opts else "")


def figures(trace, allocator: str, options: dict) -> dict:
    """What must not change: every figure but the wall time, and a digest of the timeline."""
    r = replay_trace(trace, allocator, options=options or None, timeline=True)
    d = r.as_dict()
    d.pop("seconds")
    d.pop("events_per_second", None)
    h = hashlib.sha256()
    for name in ("allocated", "reserved"):
        h.update(np.ascontiguousarray(r.timeline[name], dtype=np.int64).tobytes())
    d["timeline_sha256"] = h.hexdigest()
    return json.loads(json.dumps(d, sort_keys=True, default=str))


@pytest.fixture(scope="module")
def golden() -> dict:
    return json.loads(GOLDEN.read_text())


@pytest.mark.parametrize("path", TRACES, ids=lambda p: p.name.split(".pickle")[0])
def test_replay_results_match_the_recorded_ones(path, golden, bundled_trace):
    trace = bundled_trace(path)
    for allocator, options in VARIANTS:
        key = _key(path, allocator, options)
        assert figures(trace, allocator, options) == golden[key], key


def test_the_golden_file_covers_every_bundled_trace(golden):
    assert len(TRACES) == 8
    assert set(golden) == {_key(p, a, o) for p in TRACES for a, o in VARIANTS}


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python tests/trace/test_replay_golden.py --write")
    out = {}
    for p in TRACES:
        t = load_trace(p)
        for a, o in VARIANTS:
            out[_key(p, a, o)] = figures(t, a, o)
    GOLDEN.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    print(f"wrote {len(out)} results to {GOLDEN}")

"""The ``paged`` allocator on the bundled traces: its memory and driver work beside ``vms`` and
PyTorch's modes, and what its two knobs (reclaim order, slack) trade.

    python experiments/paged_policy.py [--out experiments/results/paged] [--passes 5]

Each trace is replayed ``--passes`` times in a row on the simulated driver; steady state is
passes 3 and later. Per row: peak reserved, utilization, the modelled driver time per replay in
steady state (the H200 per-call costs of ``experiments/vms_policy.py``), and the device
synchronizations per replay (``paged`` waits for queued work before it unmaps a page; ``vms``
before it destroys a range).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fast_path_study import replay_passes  # noqa: E402

from vmstoolkit.pools import make_allocator  # noqa: E402
from vmstoolkit.trace import bundled_trace_paths, load_trace  # noqa: E402

ROWS = {
    "paged": ("paged", {}),
    "paged, clock reclaim": ("paged", {"reclaim": "clock"}),
    "paged, slack 64 pages": ("paged", {"slack_pages": 64}),
    "paged, slack 128 pages": ("paged", {"slack_pages": 128}),
    "paged, slack 256 pages": ("paged", {"slack_pages": 256}),
    "vms": ("vms", {}),
    "pytorch-expandable": ("pytorch-expandable", {}),
    "pytorch-caching": ("pytorch-caching", {}),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--passes", type=int, default=5)
    args = ap.parse_args()
    rows = []
    for path in bundled_trace_paths():
        trace = load_trace(path)
        for label, (name, options) in ROWS.items():
            r = replay_passes(trace, lambda d, n=name, o=options: make_allocator(n, d, **o), args.passes)
            r.pop("python_per_request")
            rows.append({"trace": trace.name.split(".")[0], "row": label, **r})
            print(f"{rows[-1]['trace']:14s} {label:24s} peak {r['peak_reserved'] / 2**30:6.2f} GiB  util {r['utilization']:.3f}  "
                  f"driver {r['steady_driver_ms']:6.1f} ms  syncs {r['steady_syncs']:5.0f} per replay", flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "paged_policy.json").write_text(json.dumps({"command": " ".join(sys.argv), "rows": rows}, indent=1))
        (args.out / "paged_policy.md").write_text(markdown_table(rows) + "\n")
    return 0


def markdown_table(rows: list[dict]) -> str:
    """Rows by trace: ``peak reserved GiB / driver ms per replay / syncs per replay``."""
    traces = list(dict.fromkeys(r["trace"] for r in rows))
    labels = list(dict.fromkeys(r["row"] for r in rows))
    by = {(r["trace"], r["row"]): r for r in rows}
    lines = ["| allocator | " + " | ".join(traces) + " |", "|---|" + "---|" * len(traces)]
    for lab in labels:
        cells = [f"{by[(t, lab)]['peak_reserved'] / 2**30:.2f} GiB / {by[(t, lab)]['steady_driver_ms']:.0f} ms / "
                 f"{by[(t, lab)]['steady_syncs']:.0f}" for t in traces]
        lines.append(f"| {lab} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())

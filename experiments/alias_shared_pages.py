"""How often a new block meets a page held by a live neighbour whose chunk it also maps elsewhere.

    python experiments/alias_shared_pages.py [SNAPSHOT ...]     (default: run 13's four histories)

With ``aliases=True`` a chunk can be mapped at two pages. When a new block's window holds a page
a live neighbour already uses (units finer than a page: the small heap, or ``large_unit`` below
2 MiB) and another page of the window maps the same chunk, the new block's page must be remapped,
never the neighbour's (``heap.conflicts``; until 34ed6a0 it took the neighbour's, whose data
would then be lost on a GPU). This replays training histories step by step
(``train_steps_replay.replay_steps``) with and without slack and prints how many times the case
arises: where it is 0, the old code behaved as the fixed one on that sequence.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_steps_replay import replay_steps  # noqa: E402

from vmstoolkit.pools.paged import heap as H  # noqa: E402
from vmstoolkit.trace import load_trace  # noqa: E402

RUN13 = Path(__file__).resolve().parent / "results" / "train-h200" / "run13-snapshots"


def counting_conflicts(shared: list):
    """A stand-in for ``heap.conflicts`` that first appends to ``shared`` every page of the window
    held by a neighbour (more live units than the new block's) whose chunk is live twice."""
    conflicts = H.conflicts

    def counting(meta, page_chunk, page_used, chunk_live, nmaps, chunk_stack, g, start, n, out_pages, out_chunks):
        q = int(meta[H.M_Q])
        for p in range(start // q, (start + n + q - 1) // q):
            mine = min(start + n, (p + 1) * q) - max(start, p * q)
            c = page_chunk[p]
            if c != H.NONE and page_used[p] > mine and chunk_live[c] > 1:
                shared.append(p)
        return conflicts(meta, page_chunk, page_used, chunk_live, nmaps, chunk_stack, g, start, n, out_pages, out_chunks)

    return counting


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("snapshots", type=Path, nargs="*",
                    default=[RUN13 / f"train-{v}.pickle.gz" for v in ("full", "ckpt", "lora", "offload")])
    args = ap.parse_args()
    original = H.conflicts
    try:
        for path in args.snapshots:
            trace = load_trace(path)
            for options in ({"aliases": True}, {"aliases": True, "slack_pages": 64}):
                shared: list = []
                H.conflicts = counting_conflicts(shared)
                replay_steps(trace, options)
                print(f"{path.name}  {options}: {len(shared)}")
    finally:
        H.conflicts = original
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""How often a new block meets a page held by a live neighbour whose chunk it also maps elsewhere.

    python experiments/alias_shared_pages.py [SNAPSHOT ...]     (default: run 13's four histories,
                                                                 experiments/data/train-h200-run13/)

With ``aliases=True`` a chunk can be mapped at two pages. When a new block's window holds a page
a live neighbour already uses (units finer than a page: the small heap, or ``large_unit`` below
2 MiB) and another page of the window maps the same chunk, the new block's page must be remapped,
never the neighbour's (``heap.conflicts``; until 34ed6a0 it took the neighbour's, whose data
would then be lost on a GPU). This replays training histories step by step
(``common.replay_steps``, as ``train_steps_replay.py`` does) with and without slack and prints
how many times the case arises (``heap.shared_with_live_neighbours``): where it is 0, the old
code behaved as the fixed one on that sequence.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from common import replay_steps, train_shapes
from vmstoolkit.pools.paged import heap as H
from vmstoolkit.trace import load_trace

RUN13 = Path(__file__).resolve().parent / "data" / "train-h200-run13"


def counting_conflicts(shared: list):
    """``heap.conflicts``, after appending to ``shared`` the pages of the window that a live
    neighbour holds and whose chunk is live twice."""
    conflicts = H.conflicts

    def counting(meta, page_chunk, page_used, chunk_live, nmaps, chunk_stack, g, start, n, *out):
        shared.extend(H.shared_with_live_neighbours(meta, page_chunk, page_used, chunk_live, start, n))
        return conflicts(meta, page_chunk, page_used, chunk_live, nmaps, chunk_stack, g, start, n, *out)

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
                replay_steps(trace, options, train_shapes(6))
                print(f"{path.name}  {options}: {len(shared)}")
    finally:
        H.conflicts = original
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

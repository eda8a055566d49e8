"""The fragmentation experiment on the bundled H200 traces, written to experiments/results/.

    python experiments/fragmentation.py [--synthetic] [--jobs N] [-a ALLOCATOR ...]

Runs ``vmstoolkit experiment fragmentation`` (same options) with ``--out`` set to
``experiments/results/fragmentation/`` (``fragmentation-synthetic/`` with ``--synthetic``,
whose extra rows are SYNTHETIC workloads, marked as such). The table, CSV, JSON (with the
command and the machine) and PNG figures land there; ``README.md`` there says how they were made.
"""

from __future__ import annotations

import sys
from pathlib import Path

from vmstoolkit.cli import app

RESULTS = Path(__file__).resolve().parent / "results"


def main(argv: list[str]) -> None:
    out = RESULTS / ("fragmentation-synthetic" if "--synthetic" in argv else "fragmentation")
    app(["experiment", "fragmentation", "--out", str(out), *argv], prog_name="vmstoolkit")


if __name__ == "__main__":
    main(sys.argv[1:])

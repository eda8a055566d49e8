"""Execute the teaching notebooks top to bottom and save them with their outputs.

    python scripts/execute_notebooks.py                 # every notebook in notebooks/
    python scripts/execute_notebooks.py notebooks/02_stitching.ipynb

Run it after editing a notebook so readers see current outputs on GitHub. The kernel is
``python3`` resolved against this interpreter (run it with the project's venv). Each notebook
runs with the notebooks/ folder as working directory. Execution counts are renumbered from 1
and the volatile execution metadata (timestamps) is dropped so that rerunning unchanged
notebooks gives small diffs.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"


def execute(path: Path, timeout: int = 120, kernel_name: str = "python3") -> float:
    """Execute ``path`` in place; returns the seconds it took."""
    nb = nbformat.read(path, as_version=4)
    os.environ.pop("MPLBACKEND", None)  # e.g. Agg from CI: ipykernel then picks inline, which saves the figures
    t0 = time.perf_counter()
    NotebookClient(nb, timeout=timeout, kernel_name=kernel_name,
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    seconds = time.perf_counter() - t0
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
    nb.metadata.kernelspec = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}
    nbformat.validate(nb)
    nbformat.write(nb, path)
    return seconds


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("notebooks", nargs="*", type=Path, help="notebooks to run (default: every one in notebooks/)")
    p.add_argument("--timeout", type=int, default=120, help="seconds allowed per cell")
    args = p.parse_args(argv)
    paths = args.notebooks or sorted(NOTEBOOKS.glob("*.ipynb"))
    for path in paths:
        print(f"{path.name}: {execute(path, args.timeout):.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

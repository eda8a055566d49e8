"""Record a PyTorch run's CUDA memory history as a snapshot that ``vmstoolkit replay`` reads.

Two ways, the same defaults (``stacks="python"``: Python frames only, fast to dump, where
``"all"`` adds C++ frames and takes minutes on real runs; :data:`DEFAULT_MAX_ENTRIES` events;
gzip when the file name ends in ``.gz``):

- around code: ``with vmstoolkit.record("run.pickle.gz"): train()``;
- around a command: ``vmstoolkit record --out run.pickle.gz -- python train.py ARGS`` (the first
  Python process of the command records, from its start to its exit).

Both print the replay command to run next. torch is imported only when recording starts;
without it, or without a CUDA device, :class:`RecordError` says so. A run that allocates nothing
writes a valid snapshot with no events, and says so (replay then reports there is nothing to
replay).
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from vmstoolkit.errors import VmsError

DEFAULT_MAX_ENTRIES = 1_000_000
"""Events kept (PyTorch keeps the last ones). A training step of a 7B model makes about 10-30k
allocation events, so a million covers dozens of steps; each event with Python frames takes a
few hundred bytes of host memory while recording."""
DEFAULT_OUT = "run.pickle.gz"
STACKS = ("python", "all")


class RecordError(VmsError, RuntimeError):
    """Recording is impossible here: no PyTorch, no CUDA device, or the command never started Python."""


def _torch():
    try:
        import torch
    except ImportError as e:
        raise RecordError(f"recording needs PyTorch, which is not installed ({e}); "
                          "pip install 'vmstoolkit[torch]'") from None
    if not torch.cuda.is_available():
        raise RecordError("recording needs a CUDA device: torch.cuda.is_available() is False")
    return torch


def count_allocs(snapshot: dict) -> int:
    """Allocation events in a snapshot dict."""
    return sum(1 for dev in snapshot.get("device_traces", []) or [] for e in dev
               if isinstance(e, dict) and e.get("action") == "alloc")


def write_snapshot(snapshot: dict, path: str | Path) -> Path:
    """Write ``snapshot`` as a pickle (gzipped for ``.gz``), atomically: a reader never sees half."""
    import gzip  # here, not at the top: ``import vmstoolkit`` stays quick (the CLI's start-up)
    import pickle

    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(tmp, "wb") as f:
        pickle.dump(snapshot, f, protocol=4)
    os.replace(tmp, path)
    return path


def next_step(path: str | Path, allocs: int) -> str:
    """What to tell the user once ``path`` is written."""
    if not allocs:
        return (f"wrote {path}: the run made no CUDA allocation while recording, so the snapshot is empty "
                "(replay will say there is nothing to replay)")
    return f"wrote {path} ({allocs} allocations); next: vmstoolkit replay {path} -a pytorch-caching -a vms"


@contextmanager
def record(path: str | Path = DEFAULT_OUT, *, stacks: str = "python", max_entries: int = DEFAULT_MAX_ENTRIES,
           quiet: bool = False) -> Iterator[Path]:
    """Record the CUDA memory history of the code inside the ``with`` block to ``path``.

    >>> with vmstoolkit.record("run.pickle.gz"):   # doctest: +SKIP
    ...     train(steps=3)

    The snapshot is written when the block ends, also when it raises. Costs: PyTorch keeps up to
    ``max_entries`` events with their Python frames; dumping takes about a second per 100k events.
    """
    if stacks not in STACKS:
        raise RecordError(f"stacks must be one of {', '.join(STACKS)}, got {stacks!r}")
    if max_entries < 1:
        raise RecordError(f"max_entries must be at least 1, got {max_entries}")
    path = Path(path)
    if not path.parent.is_dir():
        raise RecordError(f"cannot write {path}: {path.parent} is not a directory")
    torch = _torch()
    torch.cuda.memory._record_memory_history(enabled="all", stacks=stacks, max_entries=max_entries)
    try:
        yield path
    finally:
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        write_snapshot(snap, path)
        if not quiet:
            print(next_step(path, count_allocs(snap)), file=sys.stderr)


def boot_dir() -> Path:
    """The directory whose ``sitecustomize`` starts recording in a command's Python."""
    return Path(__file__).resolve().parent / "_record_boot"

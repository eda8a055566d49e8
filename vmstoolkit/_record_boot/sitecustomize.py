"""Started by ``vmstoolkit record``: record the CUDA memory history of the first Python process of
the recorded command, and write it at exit. Standard library and torch only (the recorded
program's Python may not have vmstoolkit). See :mod:`vmstoolkit.recording`.

Put on ``PYTHONPATH`` by the recorder, it runs at interpreter start-up (``site`` imports
``sitecustomize``), then hands over to any other ``sitecustomize`` further along the path.
"""

import os
import sys


def _status(where, **fields):
    import json

    tmp = f"{where}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(fields, f)
    os.replace(tmp, where)


def _start():
    env = os.environ
    status = env.get("VMSTOOLKIT_RECORD_STATUS")
    if not status:
        return
    try:  # only the first Python process of the command records (workers and launchers' children do not)
        os.close(os.open(status + ".claim", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except OSError:
        return
    try:
        import torch
    except ImportError as e:
        _status(status, ok=False, message=f"PyTorch is not installed for {sys.executable} ({e}); install it "
                                          f"there with: {sys.executable} -m pip install torch "
                                          "(a CUDA build: https://pytorch.org/get-started/locally/)")
        os._exit(86)  # the recorder prints why; running the program unrecorded would waste its time
    if not torch.cuda.is_available():
        _status(status, ok=False, message=f"no CUDA device is available to {sys.executable} "
                                          "(torch.cuda.is_available() is False)")
        os._exit(86)  # the recorder prints why; running the program unrecorded would waste its time
    out = env["VMSTOOLKIT_RECORD_OUT"]
    stacks, max_entries = env.get("VMSTOOLKIT_RECORD_STACKS", "python"), int(env.get("VMSTOOLKIT_RECORD_MAX_ENTRIES", "1000000"))
    # Asked for when CUDA starts, not now: a program that installs a vmstoolkit allocator first
    # (which must precede CUDA's start) then records through it; asking now would start PyTorch's
    # own allocator and the install would be refused. CUDA starts before its first allocation.
    def start():
        torch.cuda.memory._record_memory_history(enabled="all", stacks=stacks, max_entries=max_entries)

    lazy = getattr(torch.cuda, "_lazy_call", None)  # PyTorch's hook for "when CUDA starts"
    lazy(start) if lazy is not None else start()

    def dump():
        import gzip
        import pickle

        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        tmp = f"{out}.{os.getpid()}.tmp"
        opener = gzip.open if out.endswith(".gz") else open
        with opener(tmp, "wb") as f:
            pickle.dump(snap, f, protocol=4)
        os.replace(tmp, out)
        allocs = sum(1 for dev in snap.get("device_traces", []) for e in dev if e.get("action") == "alloc")
        _status(status, ok=True, allocs=allocs, path=out)

    import atexit

    atexit.register(dump)


def _chain():
    """Import the next ``sitecustomize`` on the path, if the environment has one of its own."""
    here = os.path.dirname(os.path.abspath(__file__))
    saved = sys.path[:]
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    mine = sys.modules.pop("sitecustomize", None)
    try:
        import sitecustomize  # noqa: F401
    except ImportError:
        pass
    finally:
        sys.path[:] = saved
        if mine is not None:
            sys.modules["sitecustomize"] = mine


_start()
_chain()

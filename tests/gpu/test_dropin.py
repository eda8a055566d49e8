"""PyTorch's allocator contract under every vmstoolkit allocator, on a real GPU (skipped elsewhere):
stream-ordered reuse, record_stream, a catchable torch.OutOfMemoryError (also in backward), the
torch.cuda statistics, CUDA graphs and snapshots. Each allocator runs ``dropin_program.py`` in a
fresh process, as a user's program would.

    VMSTOOLKIT_REAL_GPU=1 python -m pytest tests/gpu/test_dropin.py -q
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(os.environ.get("VMSTOOLKIT_REAL_GPU") != "1",
                                reason="needs a CUDA GPU and VMSTOOLKIT_REAL_GPU=1")

PROGRAM = Path(__file__).with_name("dropin_program.py")
CASES = [("default", ()), ("paged", ()), ("paged", ("aliases=True", "slack_pages=64")), ("vms", ()), ("gmlake", ()),
         ("native", ())]
_results: dict = {}


def run(name: str, opts: tuple) -> dict:
    key = (name, opts)
    if key not in _results:
        env = dict(os.environ)
        env.pop("NUMBA_ENABLE_CUDASIM", None)
        p = subprocess.run([sys.executable, str(PROGRAM), name, *opts], capture_output=True, text=True, env=env,
                           timeout=400)
        assert p.returncode == 0, p.stderr[-3000:]
        _results[key] = json.loads(p.stdout.strip().splitlines()[-1])
        out = os.environ.get("VMSTOOLKIT_DROPIN_OUT")  # keep the findings for the results folder
        if out:
            with open(out, "a") as f:
                f.write(json.dumps(_results[key]) + "\n")
    return _results[key]


@pytest.mark.parametrize("name,opts", CASES)
def test_streams_and_record_stream_give_exact_results(name, opts):
    r = run(name, opts)
    assert r["side_stream_wrong"] == 0, r
    assert r["record_stream_wrong"] == 0, r


@pytest.mark.parametrize("name,opts", CASES)
def test_out_of_memory_is_catchable_and_work_goes_on(name, opts):
    r = run(name, opts)
    assert r["oom"]["raised"] == "OutOfMemoryError", r["oom"]
    assert r["oom"]["after"], r["oom"]
    assert r["oom_in_backward"] == "OutOfMemoryError", r


@pytest.mark.parametrize("name,opts", CASES)
def test_an_exception_unwinding_past_cuda_temporaries_stays_itself(name, opts):
    """Found on the H200: under the Python allocators, a tensor freed while an exception unwound
    a frame ran Python, which cleared the exception: ``SystemError`` instead of the user's error."""
    assert run(name, opts)["exception_through_temporaries"] == "KeyError"


@pytest.mark.parametrize("name,opts", CASES)
def test_torch_cuda_statistics_are_the_allocators(name, opts):
    r = run(name, opts)
    s = r["stats"]
    assert isinstance(s, dict), s
    assert s["summary_lines"] > 10
    if name == "default":
        return
    assert r["shim"], r["shim_reason"]
    assert s["memory_allocated"] == s["handle_allocated"]
    assert s["memory_reserved"] == s["handle_reserved"]
    assert s["max_memory_allocated"] == s["handle_max_allocated"] >= 100 + (3 << 20) + (40 << 20)
    assert s["after_free_allocated"] < s["memory_allocated"]
    assert s["empty_cache_gave_back"] >= 0


@pytest.mark.parametrize("name,opts", CASES)
def test_cuda_graphs_and_snapshots(name, opts):
    r = run(name, opts)
    assert r["cuda_graph"] is True, r
    if name != "default":
        assert r["snapshot"]["events"] >= 4, r

"""``vmstoolkit record`` and ``vmstoolkit.record`` (issue 21 "Record"), with a fake ``torch`` module
on PYTHONPATH: the process handling, the defaults, the messages; a real run is in tests/gpu/."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import vmstoolkit
from vmstoolkit.errors import VmsError
from vmstoolkit.recording import DEFAULT_MAX_ENTRIES, RecordError
from vmstoolkit.trace import load_trace
from tests.cli.helpers import run_cli

ROOT = Path(__file__).resolve().parents[2]

FAKE_MEMORY = '''
import json, os
_events, _calls = [], []
def _record_memory_history(enabled="all", context="all", stacks="all", max_entries=0, device=None):
    _calls.append({"enabled": enabled, "stacks": stacks, "max_entries": max_entries})
    if os.environ.get("FAKE_CALLS"):
        with open(os.environ["FAKE_CALLS"], "a") as f:
            f.write(json.dumps(_calls[-1]) + "\\n")
def alloc(addr, size):
    if _calls and _calls[-1]["enabled"] is not None:
        _events.append({"action": "alloc", "addr": addr, "size": size, "stream": 0, "time_us": len(_events),
                        "frames": [{"filename": "train.py", "line": 3, "name": "step"}]})
def _snapshot():
    return {"device_traces": [list(_events)], "segments": []}
'''


@pytest.fixture
def fake_torch(tmp_path):
    root = tmp_path / "fake"
    (root / "torch" / "cuda").mkdir(parents=True)
    (root / "torch" / "__init__.py").write_text("from torch import cuda\n")
    (root / "torch" / "cuda" / "__init__.py").write_text(
        "import os\nfrom torch.cuda import memory\n"
        "def is_available():\n    return os.environ.get('FAKE_CUDA', '1') == '1'\n")
    (root / "torch" / "cuda" / "memory.py").write_text(FAKE_MEMORY)
    (tmp_path / "train.py").write_text(textwrap.dedent("""
        import sys, torch
        for i in range(int(sys.argv[1])):
            torch.cuda.memory.alloc((4 << 20) * (i + 1), 3 << 20)  # live blocks that do not overlap
        sys.exit(int(sys.argv[2]))
    """))
    return root


def record(tmp_path, fake, *command, env=None):
    paths = [str(p) for p in (fake, ROOT) if p]
    e = {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "FAKE_CALLS": str(tmp_path / "calls.jsonl"), **(env or {})}
    return subprocess.run([sys.executable, "-m", "vmstoolkit", "record", "--out", str(tmp_path / "run.pickle.gz"),
                           "--", *command], capture_output=True, text=True, env=e, timeout=120, cwd=tmp_path)


def test_records_a_python_command_with_the_defaults(tmp_path, fake_torch):
    r = record(tmp_path, fake_torch, sys.executable, "train.py", "3", "0")
    assert r.returncode == 0, r.stderr
    out = tmp_path / "run.pickle.gz"
    assert out.read_bytes()[:2] == b"\x1f\x8b"  # gzip
    t = load_trace(out)
    assert [e.size for e in t.alloc_free_events()] == [3 << 20] * 3
    assert f"vmstoolkit replay {out} -a pytorch-caching -a vms" in r.stderr
    calls = (tmp_path / "calls.jsonl").read_text()
    assert '"stacks": "python"' in calls and f'"max_entries": {DEFAULT_MAX_ENTRIES}' in calls


def test_the_command_exit_status_is_kept_and_the_snapshot_written(tmp_path, fake_torch):
    r = record(tmp_path, fake_torch, sys.executable, "train.py", "2", "5")
    assert r.returncode == 5 and "2 allocations" in r.stderr


def test_a_run_that_allocates_nothing_writes_a_valid_empty_snapshot(tmp_path, fake_torch):
    r = record(tmp_path, fake_torch, sys.executable, "train.py", "0", "0")
    assert r.returncode == 0 and "snapshot is empty" in r.stderr
    import gzip
    import pickle

    assert pickle.loads(gzip.decompress((tmp_path / "run.pickle.gz").read_bytes())) == {
        "device_traces": [[]], "segments": []}


@pytest.mark.parametrize("fake, env, command, message", [
    (False, {}, ["{py}", "train.py", "1", "0"], "PyTorch is not installed for {py} (No module named 'torch'); "
                                                "install it there with: {py} -m pip install torch"),
    (True, {"FAKE_CUDA": "0"}, ["{py}", "train.py", "1", "0"], "no CUDA device"),
    (True, {}, ["true"], "did not start Python"),
    (True, {}, ["/no/such/program"], "cannot run '/no/such/program'"),
])
def test_clear_one_line_errors(tmp_path, fake_torch, fake, env, command, message):
    command = [c.replace("{py}", sys.executable) for c in command]
    if not fake:  # torch missing, also where it is installed: a torch that fails to import comes first
        no_torch = tmp_path / "no_torch" / "torch"
        no_torch.mkdir(parents=True)
        (no_torch / "__init__.py").write_text("raise ImportError(\"No module named 'torch'\")\n")
    r = record(tmp_path, fake_torch if fake else tmp_path / "no_torch", *command, env=env)
    message = message.replace("{py}", sys.executable)
    assert r.returncode == 1 and message in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_bad_arguments(tmp_path, fake_torch):
    r = run_cli("record")  # refused before any process starts: run in this process
    assert r.returncode == 2 and "after --" in r.stderr
    (tmp_path / "f").write_text("x")
    r = run_cli("record", "--out", str(tmp_path / "f" / "x.gz"), "--", "true")
    assert r.returncode == 2 and "is a file, not a directory" in r.stderr


@pytest.fixture
def torch_modules_restored():
    """The fake torch imported in-process must not outlive the test (other tests import torch)."""
    def torch_mods():
        return {m: mod for m, mod in sys.modules.items() if m == "torch" or m.startswith("torch.")}

    saved = torch_mods()
    for m in saved:
        del sys.modules[m]
    yield
    for m in torch_mods():
        del sys.modules[m]
    sys.modules.update(saved)


def test_context_manager(tmp_path, fake_torch, monkeypatch, capsys, torch_modules_restored):
    monkeypatch.syspath_prepend(str(fake_torch))
    import torch

    out = tmp_path / "cm.pickle"
    with vmstoolkit.record(out) as p:
        torch.cuda.memory.alloc(4096, 1 << 20)
    assert p == out and len(load_trace(out).alloc_free_events()) == 1
    assert "vmstoolkit replay" in capsys.readouterr().err
    assert torch.cuda.memory._calls[0]["stacks"] == "python" and torch.cuda.memory._calls[-1]["enabled"] is None
    monkeypatch.setenv("FAKE_CUDA", "0")
    with pytest.raises(RecordError, match="CUDA device"):
        with vmstoolkit.record(out):
            pass


def test_context_manager_without_torch(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch -> ImportError
    with pytest.raises(VmsError, match=r"PyTorch.*vmstoolkit\[torch\]"):
        with vmstoolkit.record(tmp_path / "x.pickle.gz"):
            pass

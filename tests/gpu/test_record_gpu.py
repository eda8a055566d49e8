"""On a real GPU with PyTorch only (skipped elsewhere): ``vmstoolkit record`` records a real tiny
training run, and the snapshot replays. ``VMSTOOLKIT_REAL_GPU=1 python -m pytest tests/gpu -q``."""

import os
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed")
pytestmark = pytest.mark.skipif(os.environ.get("VMSTOOLKIT_REAL_GPU") != "1" or not torch.cuda.is_available(),
                                reason="needs VMSTOOLKIT_REAL_GPU=1 and a CUDA device")


def test_record_a_tiny_training_run_and_replay_it(tmp_path):
    (tmp_path / "train.py").write_text(textwrap.dedent("""
        import torch
        model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256)).cuda()
        opt = torch.optim.AdamW(model.parameters())
        for _ in range(3):
            x = torch.randn(64, 256, device="cuda")
            model(x).square().mean().backward()
            opt.step(); opt.zero_grad()
        torch.cuda.synchronize()
    """))
    out = tmp_path / "run.pickle.gz"
    r = subprocess.run([sys.executable, "-m", "vmstoolkit", "record", "--out", str(out), "--", sys.executable, "train.py"],
                       capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "next: vmstoolkit replay" in r.stderr
    rep = subprocess.run([sys.executable, "-m", "vmstoolkit", "replay", str(out), "-a", "pytorch-caching", "-a", "vms",
                          "-f", "json"], capture_output=True, text=True, timeout=300)
    assert rep.returncode == 0, rep.stderr
    assert '"oom": false' in rep.stdout and '"peak_allocated": 0' not in rep.stdout

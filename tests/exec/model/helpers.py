"""The tiny checkpoints of ``tests/data/checkpoints`` (made by ``scripts/make_tiny_checkpoints.py``
with transformers on the CPU) and their fixtures."""

from pathlib import Path

import numpy as np

CHECKPOINTS = Path(__file__).resolve().parents[2] / "data" / "checkpoints"
NAMES = ("llama-tied", "llama-sharded", "mistral", "qwen2")
TRAIN_NAMES = ("llama-tied", "llama-sharded", "mistral", "qwen2")  # qwen2: LoRA only


def folder(name: str) -> Path:
    return CHECKPOINTS / name


def fixture(name: str) -> dict:
    with np.load(folder(name) / "fixture.npz") as f:
        return {k: f[k] for k in f.files}


def lm_fixture(name: str) -> dict:
    """transformers' causal-LM loss and its autograd gradients (``scripts/make_tiny_checkpoints.py``)."""
    with np.load(folder(name) / "fixture_lm.npz") as f:
        return {k: f[k] for k in f.files}

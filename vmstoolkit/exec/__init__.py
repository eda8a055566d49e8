"""The memory-aware runtime: task graphs, memory graphs under a budget, executors over backends.

The user-model entry points are here by name, imported on first use: ``load_model(dir)`` (a
Hugging Face folder, :mod:`vmstoolkit.exec.model.checkpoint`), ``run_generate`` and ``generate``
(:mod:`vmstoolkit.exec.model.generate`), ``run_train`` (:mod:`vmstoolkit.exec.model.train`)."""

_LAZY = {"load_model": "vmstoolkit.exec.model.checkpoint", "Checkpoint": "vmstoolkit.exec.model.checkpoint",
         "run_generate": "vmstoolkit.exec.model.generate", "generate": "vmstoolkit.exec.model.generate",
         "run_train": "vmstoolkit.exec.model.train"}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'vmstoolkit.exec' has no attribute {name!r}")


__all__ = sorted(_LAZY)

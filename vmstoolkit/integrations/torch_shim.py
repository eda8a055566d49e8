"""The compiled shim between PyTorch and vmstoolkit (``csrc/torch_shim.cpp``), built on first use.

PyTorch's pluggable hook (``torch._C._cuda_customAllocator``) takes only ``alloc`` and ``free``:
it hands a null pointer from a failed allocation to the program (the first kernel that touches it
kills the CUDA context), drops ``record_stream`` and refuses every ``torch.cuda`` memory
statistic. The shim subclasses PyTorch's ``CUDAPluggableAllocator`` in C++ so that a failed
allocation raises ``torch.OutOfMemoryError``, ``record_stream`` reaches the allocator and the
statistics come from it. It is compiled by PyTorch's own extension builder
(``torch.utils.cpp_extension.load``: a C++ compiler, ninja and the CUDA headers), once per
machine, and cached in PyTorch's extension folder (``TORCH_EXTENSIONS_DIR``).

Where it cannot be built, :func:`load` says why in one line, and the integration falls back to
the bare hook with Python-level patches (:mod:`vmstoolkit.integrations.torch`), which cannot
raise out-of-memory errors.
"""

from __future__ import annotations

from pathlib import Path

SOURCE = Path(__file__).with_name("csrc") / "torch_shim.cpp"
NAME = "vmstoolkit_torch_shim_v6"  # bump with any change to the source's interface


def load():
    """``(module, "")`` with the built shim, or ``(None, reason)`` when it cannot be built."""
    try:
        from torch.utils.cpp_extension import load as build
    except ImportError as e:
        return None, f"torch.utils.cpp_extension is not importable ({e})"
    try:
        return build(name=NAME, sources=[str(SOURCE)], with_cuda=True, extra_cflags=["-O2"], verbose=False), ""
    except Exception as e:  # a missing compiler, ninja or CUDA headers: say which, in one line
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        return None, f"{type(e).__name__}: {lines[-1] if lines else e}"[:400]

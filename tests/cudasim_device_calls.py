"""The Numba CUDA simulator's device-function calls without a lock round trip when the call's
module is the running kernel's own (tests only).

Every call of a ``@cuda.jit(device=True)`` function under the simulator enters
``kernelapi.swapped_cuda_module``: a global lock, the module's lock, a reference count that
swaps the module's ``cuda`` for the simulated one on first entry and back on last exit, and a
generator context manager. For a device function defined beside the kernel, the kernel launch
itself holds that module swapped for the whole launch, so each such call only takes the locks and
moves the count up and back: profiled on the fp32 GEMM tests, about a fifth of the kernel
threads' time. :func:`install` calls those functions directly; a device function of another
module (``kernels/_mma.py``'s, say) still goes through the stock path, as does everything
outside a launch. Without the expected internals nothing is replaced.
"""

from __future__ import annotations


def install() -> bool:
    """Put the direct path in front of ``FakeCUDAKernel.__call__``; True if it is there."""
    try:
        from numba.cuda.simulator import kernel as K
    except ImportError:
        return False
    fk = getattr(K, "FakeCUDAKernel", None)
    if fk is None or not hasattr(K, "_kernel_context"):
        return False
    if getattr(fk, "_vmstoolkit_device_calls", False):
        return True
    stock = fk.__call__
    held: list[int] = []  # ids of the globals that running launches hold swapped (launches do not nest)

    def __call__(self, *args):
        if self._device or K._kernel_context is not None:
            if held and id(self.fn.__globals__) == held[-1]:
                return self.fn(*args)
            return stock(self, *args)
        held.append(id(self.fn.__globals__))
        try:
            return stock(self, *args)
        finally:
            held.pop()

    fk.__call__ = __call__
    fk._vmstoolkit_device_calls = True
    return True

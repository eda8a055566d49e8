"""The Numba CUDA simulator's device-function calls without a lock round trip when the call's
module is the running kernel's own (tests only).

Every call of a ``@cuda.jit(device=True)`` function under the simulator enters
``kernelapi.swapped_cuda_module``: a global lock, the module's lock, a reference count that
swaps the module's ``cuda`` for the simulated one on first entry and back on last exit, and a
generator context manager. For a device function defined beside the kernel, the kernel launch
itself holds that module swapped for the whole launch, so each such call only takes the locks and
moves the count up and back: profiled on the fp32 GEMM tests, about a fifth of the kernel
threads' time. :func:`install` calls those functions directly. A device function of another
module (``kernels/_mma.py``'s, say) swaps its module at its first call in a launch, as the stock
path does, but keeps it swapped until the launch ends (so its later calls are direct too: the
bf16 kernels call ``_mma``'s helpers tens of thousands of times a test); everything outside a
launch takes the stock path. Those that a launched kernel closes over (the GEMM's, made in a factory) are
not even called through ``FakeCUDAKernel.__call__`` during its launch: the closure cells hold
the Python functions until it ends. Without the expected internals nothing is replaced.
"""

from __future__ import annotations

import threading


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
    # Per running launch (launches do not nest): the ids of the module globals it holds swapped
    # (the kernel's, then each other module whose device function it calls), and the swaps of
    # those other modules, entered at the first such call and left when the launch ends.
    launches: list[tuple[set, list]] = []
    enter_lock = threading.Lock()

    def __call__(self, *args):
        if self._device or K._kernel_context is not None:
            if not launches:
                return stock(self, *args)
            ids, entered = launches[-1]
            g = id(self.fn.__globals__)
            if g not in ids:
                with enter_lock:  # the first call from this module in this launch swaps it
                    if g not in ids:
                        cm = K.swapped_cuda_module(self.fn, K._kernel_context)
                        cm.__enter__()
                        entered.append(cm)
                        ids.add(g)
            return self.fn(*args)
        entered: list = []
        launches.append(({id(self.fn.__globals__)}, entered))
        swapped = _bypass_same_module_device_functions(fk, self.fn)
        try:
            return stock(self, *args)
        finally:
            for cell, v in swapped:
                cell.cell_contents = v
            launches.pop()
            for cm in reversed(entered):
                cm.__exit__(None, None, None)

    fk.__call__ = __call__
    fk._vmstoolkit_device_calls = True
    return True


def _bypass_same_module_device_functions(fk, kernel_fn) -> list:
    """For one launch: every closure cell reachable from the kernel (through the device functions
    it closes over, as ``make_gemm``'s kernels do) that holds a device function of the kernel's
    own module is set to that function's Python function, which is what the call above would
    run; returns the (cell, device function) pairs to put back. A device function reached
    through a module global, or one of another module, is left to the call above."""
    g = kernel_fn.__globals__
    swapped, seen, todo = [], set(), [kernel_fn]
    while todo:
        f = todo.pop()
        for cell in getattr(f, "__closure__", None) or ():
            if id(cell) in seen:
                continue
            seen.add(id(cell))
            try:
                v = cell.cell_contents
            except ValueError:  # not yet bound
                continue
            if type(v) is fk and v._device and v.fn.__globals__ is g:
                swapped.append((cell, v))
                cell.cell_contents = v.fn
                todo.append(v.fn)
    return swapped

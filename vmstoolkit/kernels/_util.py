"""Small helpers shared by the kernel modules: simulator detection, argument checks, streams.

Every launcher in this package takes device arrays (Numba ``DeviceNDArray`` on a GPU, the
simulator's fake arrays under ``NUMBA_ENABLE_CUDASIM=1``), enqueues work on the given stream and
returns at once. Nothing here allocates on the device.
"""

from __future__ import annotations

import numpy as np
from numba import cuda
from numba.cuda.core import config as _cuda_config

from vmstoolkit.errors import KernelError

# Grid-stride elementwise kernels use this many threads per block on a GPU. 256 keeps eight
# warps per block and lets an SM hold eight blocks; the kernels are bandwidth bound, so the exact
# figure matters little. Under the simulator every GPU thread is an OS thread: keep it small.
ELEMENTWISE_THREADS_GPU = 256
ELEMENTWISE_THREADS_SIM = 32
# Upper bound on elementwise blocks: enough to fill 132 SMs several times over; the kernels
# loop (grid-stride) over whatever is left.
ELEMENTWISE_MAX_BLOCKS_GPU = 132 * 16
ELEMENTWISE_MAX_BLOCKS_SIM = 2


def simulating() -> bool:
    """True when ``numba.cuda`` runs on the CPU simulator (``NUMBA_ENABLE_CUDASIM=1``)."""
    return bool(_cuda_config.ENABLE_CUDASIM)


SM_COUNT_SIM = 132  # the H200's: what sm_count() says where no device can be asked (the simulator)


def current_device_ordinal() -> int | None:
    """The current context's device ordinal, from the driver (about 1 us); None without a
    context, or without a driver library (Numba's own calls then say what is missing)."""
    try:
        from cuda.bindings import driver

        err, dev = driver.cuCtxGetDevice()
    except Exception:  # noqa: BLE001 - no driver library: not ours to report here
        return None
    return int(dev) if err == driver.CUresult.CUDA_SUCCESS else None


_DEVICE_PROPS: dict[int, tuple[int, tuple[int, int]]] = {}  # device ordinal -> (SMs, compute capability)


def _device_props() -> tuple[int, tuple[int, int]]:
    """(SM count, compute capability) of the current context's device, asked of the driver once
    per device. The launchers ask for every launch: ``cuda.get_current_device()`` costs 15-30 us
    of host time a call (H100, ``experiments/launch_cost_gpu.py``), ``cuCtxGetDevice`` about 1."""
    ordinal = current_device_ordinal()
    props = _DEVICE_PROPS.get(ordinal) if ordinal is not None else None
    if props is None:
        d = cuda.get_current_device()
        props = (int(d.MULTIPROCESSOR_COUNT), tuple(int(v) for v in d.compute_capability))
        if ordinal is not None:
            _DEVICE_PROPS[ordinal] = props
    return props


def sm_count() -> int:
    """Streaming multiprocessors of the current device (under the simulator: the H200's 132)."""
    if simulating():
        return SM_COUNT_SIM
    return _device_props()[0]


def compute_capability() -> tuple[int, int]:
    """The current device's (major, minor); under the simulator (9, 0), the H200's."""
    if simulating():
        return (9, 0)
    return _device_props()[1]


def check_float32(name: str, a) -> None:
    dtype = np.dtype(a.dtype)
    if dtype != np.float32:
        raise KernelError(f"{name} must be float32, got dtype={dtype} (shape={tuple(a.shape)})")


def check_shape(name: str, a, shape: tuple) -> None:
    if tuple(a.shape) != tuple(shape):
        raise KernelError(f"{name} has shape {tuple(a.shape)}, expected {tuple(shape)}")


def check_ndim(name: str, a, ndim: int) -> None:
    if len(a.shape) != ndim:
        raise KernelError(f"{name} must have {ndim} dimensions, got shape {tuple(a.shape)}")


def elementwise_grid(n: int) -> tuple[int, int]:
    """(blocks, threads) for a grid-stride loop over ``n`` elements."""
    if simulating():
        threads, max_blocks = ELEMENTWISE_THREADS_SIM, ELEMENTWISE_MAX_BLOCKS_SIM
    else:
        threads, max_blocks = ELEMENTWISE_THREADS_GPU, ELEMENTWISE_MAX_BLOCKS_GPU
    blocks = max(1, min(max_blocks, (n + threads - 1) // threads))
    return blocks, threads


def flat(a):
    """A 1-D view of a contiguous device (or simulator) array. A 1-D array is its own view; a
    ``DeviceNDArray``'s view is made once and kept on it (``_vt_flat``): the runtime passes the
    same views to every launch, and ``reshape`` costs about 5 us of host time a call."""
    if len(a.shape) == 1:
        return a
    view = getattr(a, "_vt_flat", None)
    if view is None:
        view = a.reshape(int(np.prod(a.shape)))
        if type(a).__name__ == "DeviceNDArray":
            a._vt_flat = view
    return view


def is_device_array(a) -> bool:
    """True for Numba device arrays, the simulator's fake ones, and CUDA-array-interface objects."""
    return hasattr(a, "__cuda_array_interface__") or type(a).__name__ == "FakeCUDAArray"


def to_device(a, stream=0):
    """``a`` as a device array: device arrays pass through (CUDA-array-interface objects such as
    torch tensors are wrapped without a copy), host arrays are copied."""
    if type(a).__name__ in ("FakeCUDAArray", "DeviceNDArray"):
        return a
    if hasattr(a, "__cuda_array_interface__"):
        return cuda.as_cuda_array(a)
    return cuda.to_device(np.ascontiguousarray(np.asarray(a)), stream=stream)


def check_binary_elementwise(op: str, names: tuple[str, str, str], a, b, y) -> None:
    """float32 inputs and output of one shape, or a ValueError naming ``op`` and the shapes."""
    for name, arr in zip(names, (a, b, y)):
        check_float32(name, arr)
    if tuple(a.shape) != tuple(b.shape) or tuple(y.shape) != tuple(a.shape):
        raise KernelError(
            f"{op}: {names[0]} {tuple(a.shape)}, {names[1]} {tuple(b.shape)} and output "
            f"{tuple(y.shape)} must have one shape"
        )


def launch_binary_elementwise(kernel, a, b, y, stream=0) -> None:
    """Enqueue a grid-stride ``kernel(a, b, y)`` over the flattened arrays (nothing for size 0)."""
    fa, fb, fy = flat(a), flat(b), flat(y)
    if fa.shape[0] == 0:
        return
    blocks, threads = elementwise_grid(fa.shape[0])
    kernel[blocks, threads, stream](fa, fb, fy)


def generated_function(source: str, label: str, names: dict, entry: str = "kernel"):
    """The function ``entry`` defined by generated ``source`` (the kernel generators' output),
    compiled under ``label`` (what tracebacks name) with ``names`` as its globals; its docstring
    is the source, for reading. With the CUDA kernel cache on (:mod:`._cuda_cache`), the file
    name is the source's hash instead, which is how the cache finds the kernel again."""
    from . import _cuda_cache

    code = compile(source, _cuda_cache.generated_name(source) if _cuda_cache.enabled() else label, "exec")
    exec(code, names)  # noqa: S102 - the generators build the source from tile constants alone
    fn = names[entry]
    fn.__doc__ = source
    return fn

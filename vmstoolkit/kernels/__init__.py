"""Numba CUDA kernels of a LLaMA decoder block, each validated against ``reference.py``.

One module per kernel (``gemm``, ``rmsnorm``, ``rope``, ``attention``, ``swiglu``, ``residual``),
each with the same recipe: numpy reference, kernel(s), launcher, ``validate()``. ``block``
chains them into ``llama_block_forward``; ``tasks`` exposes them to the runtime.
"""

from .block import LlamaBlock, LlamaBlockConfig, llama_block_forward
from .tasks import KERNEL_TASKS, KernelTask

__all__ = ["KERNEL_TASKS", "KernelTask", "LlamaBlock", "LlamaBlockConfig", "llama_block_forward"]

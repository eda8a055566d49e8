"""Small graphs for the runtime's tests, and a counting fake of pinned host memory."""

from __future__ import annotations

import random

import numpy as np

from vmstoolkit.exec.errors import CudaCallError
from vmstoolkit.exec.graph import LlamaConfig, TaskGraph, TensorKind, build_llama

TINY = LlamaConfig(n_blocks=3, seq=16, hidden=64, heads=4, kv_heads=2, ffn=128)


def tiny_llama(parts: int = 1, n_gpus: int = 1, n_blocks: int = 3) -> TaskGraph:
    return build_llama(LlamaConfig(n_blocks=n_blocks, seq=16, hidden=64, heads=4, kv_heads=2, ffn=128),
                       parts=parts, n_gpus=n_gpus)


def random_graph(seed: int, n: int = 30, width: int = 16) -> TaskGraph:
    """A random DAG of elementwise ops on (8, width) tensors with long skip connections, so that
    small budgets force activations (not only weights) to be offloaded and reloaded."""
    rng = random.Random(seed)
    g = TaskGraph()
    shape = (8, width)
    x = g.tensor("x", shape, kind=TensorKind.INPUT)
    acts = [x]
    for i in range(n):
        r = rng.random()
        a = acts[-1]
        b = rng.choice(acts)
        y = g.tensor(f"t{i}", shape)
        if i % 3 == 2:  # normalise often so values stay finite through the chain
            w = g.tensor(f"w{i}", (width,), kind=TensorKind.WEIGHT)
            g.add(f"norm{i}", "rmsnorm", [a, w], [y], params={"eps": 1e-6}, flops=32 * width)
        elif r < 0.4:
            g.add(f"add{i}", "residual_add", [a, b], [y], flops=8 * width)
        elif r < 0.7:
            g.add(f"swiglu{i}", "swiglu", [a, b], [y], flops=40 * width)
        else:
            w = g.tensor(f"w{i}", (width,), kind=TensorKind.WEIGHT)
            g.add(f"norm{i}", "rmsnorm", [a, w], [y], params={"eps": 1e-6}, flops=32 * width)
        acts.append(y)
    g.outputs = [acts[-1], acts[n // 2]]
    return g


def weighted_chain(n: int = 8, shape: tuple[int, int] = (8, 16)) -> TaskGraph:
    """Elementwise ops only (fast in Numba's CUDA simulator) over weights and skip connections
    of one shape, so that half the working set offloads activations and reloads weights."""
    g = TaskGraph()
    acts = [g.tensor("x", shape, kind=TensorKind.INPUT)]
    for i in range(n):
        w = g.tensor(f"w{i}", shape, kind=TensorKind.WEIGHT)
        y = g.tensor(f"t{i}", shape)
        if i % 2:
            g.add(f"add{i}", "residual_add", [acts[-1], w], [y], flops=2 * shape[0] * shape[1])
        else:
            g.add(f"swiglu{i}", "swiglu", [acts[-1], acts[max(0, i - 3)]], [y], flops=5 * shape[0] * shape[1])
        acts.append(y)
    g.outputs = [acts[-1], acts[n // 2]]
    return g


class FakeHostMemory:
    """Pinned memory as plain numpy buffers; every call counted. ``refuse`` maps an address to
    the CUresult name its registration fails with."""

    def __init__(self):
        self.allocated: list[np.ndarray] = []  # kept alive: their addresses stay pinned
        self.registered: dict[int, int] = {}  # address -> bytes
        self.unregistered: list[int] = []
        self.refuse: dict[int, str] = {}
        self.flushes = 0

    def alloc(self, nbytes):
        a = np.empty(nbytes, np.uint8)
        self.allocated.append(a)
        return a

    def register(self, array):
        addr = array.__array_interface__["data"][0]
        if addr in self.refuse:
            raise CudaCallError(self.refuse[addr], f"cuMemHostRegister of {array.nbytes} bytes at {addr:#x}")
        assert addr not in self.registered, "registered twice"
        self.registered[addr] = array.nbytes

    def unregister(self, array):
        addr = array.__array_interface__["data"][0]
        del self.registered[addr]
        self.unregistered.append(addr)

    def is_pinned(self, array):
        lo = array.__array_interface__["data"][0]
        hi = lo + max(array.nbytes, 1)
        ranges = [(a.__array_interface__["data"][0], a.nbytes) for a in self.allocated] + list(self.registered.items())
        return any(s <= lo and hi <= s + max(n, 1) for s, n in ranges)

    def flush(self):
        self.flushes += 1

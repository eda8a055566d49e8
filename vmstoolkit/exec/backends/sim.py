"""Discrete-event simulation backend: a virtual clock, per-stream queues, a cost model, jitter.

Each stream is a FIFO: work starts at ``max(stream free, host issue time)`` and lasts its cost
(FLOPs over the GPU's rate or bytes over memory bandwidth for kernels, bytes over the copy
bandwidth for transfers) stretched by seeded jitter ``x [1, 1 + jitter)`` (never shorter, so
the jitter-free cost stays a lower bound). The host pays ``launch_s`` per launch (or the op's
own figure, :attr:`CostModel.launch_s_by_op`) and learns of a completion ``notify_s`` after it.
A launch may name vertices to wait for on the device (``launch(v, after)``, a CUDA stream
waiting on events): it then starts no earlier than their ends.

Several GPUs of one host: by default each has its own host link (a PCIe x16 each way). With
:attr:`CostModel.host_link_bytes_per_s` they share one link per direction instead (one PCIe
switch or root port, or host memory, in front of them all): host <-> device copies of every GPU
then pass through it one at a time, in the order they start (FIFO; no copy overtakes one that
took the link first), each at ``min(link, the GPU's own copy rate)``. The total time a link is
busy is then at least its bytes over its rate, however the copies interleave (a fair-sharing
link would move the same bytes in the same total time, with a different order).

It integrates with asyncio: ``completion()`` hands out futures that :meth:`drive` resolves as
it advances the virtual clock. The executor's callbacks run synchronously when a future
resolves, so after each resolution ``drive`` yields to the loop until the launches they make
are queued, then takes the next earliest event.

With ``numerics=True`` every GPU has a real byte region of ``budget`` bytes and the numpy
kernels run: a vertex reads its inputs from the region when it *starts* and writes its outputs
when it *ends*, so a race the graph allowed would show up as a wrong result in some order.
"""

from __future__ import annotations

import asyncio
import heapq
import random
from dataclasses import dataclass, replace

import numpy as np

from vmstoolkit.exec.errors import ExecutionError, InvalidOptionError
from vmstoolkit.exec.backends.base import select_outputs
from vmstoolkit.exec.bounds import precedence_bound
from vmstoolkit.exec.ops import run_op


@dataclass(frozen=True)
class CostModel:
    """Costs of one H200-like GPU (defaults) as seen by the runtime."""

    flops_per_s: float = 45e12  # fp32 GEMM rate; cuBLAS reaches ~46 TFLOP/s on the H200
    mem_bytes_per_s: float = 3.0e12  # HBM3e for memory-bound kernels
    h2d_bytes_per_s: float = 55e9  # pinned host -> device, measured ~55 GB/s
    d2h_bytes_per_s: float = 55e9
    p2p_bytes_per_s: float = 150e9  # GPU -> GPU over NVLink
    kernel_s: float = 4e-6  # fixed cost of a kernel
    copy_s: float = 8e-6  # fixed cost of a copy
    launch_s: float = 6e-6  # host time to launch a vertex
    notify_s: float = 15e-6  # completion -> host callback
    # host time to launch a vertex of this op ("reload" and "offload" for copies), where it
    # differs from launch_s: ((op, seconds), ...)
    launch_s_by_op: tuple = ()
    # one link shared by every GPU's host <-> device copies, each way (bytes/s); None: a link per GPU
    host_link_bytes_per_s: float | None = None

    @classmethod
    def h200(cls, **changes) -> "CostModel":
        """The H200 machine's figures as measured by the project, host costs included:
        copies 54 GB/s each way (``experiments/results/offload-h200``, runs 7-9); a GEMM
        launch of our Numba kernels 70-225 us of host time (``gemm-h200/run8``: planning, the
        alignment checks, Numba's dispatch; 150 us here); the other kernels and copies are
        estimates (Numba's dispatch plus the CUDA backend's views, event and future): 40 and
        30 us (a ``move``, compaction's device-to-device copy, is a copy too), a completion seen
        30 us after it. The GEMM rate is cuBLAS's 46 TFLOP/s at 90%
        (our variant 13 reaches 86-94%, ``gemm-h200/run8``). The launch costs are from before
        :mod:`vmstoolkit.kernels._launch` (one driver call a launch once planned), whose cost
        the GPU has not measured yet; ``experiments/untuned_shapes.py --gemm-launch-us``
        shows what lower ones would change."""
        gemm = 150e-6
        base = cls(flops_per_s=41e12, h2d_bytes_per_s=54e9, d2h_bytes_per_s=54e9, launch_s=40e-6, notify_s=30e-6,
                   launch_s_by_op=(("linear", gemm), ("linear_dx", gemm), ("linear_dw", gemm),
                                   ("reload", 30e-6), ("offload", 30e-6), ("move", 30e-6)))
        return replace(base, **changes)

    def launch_cost(self, v) -> float:
        """Host seconds to launch vertex ``v``."""
        for op, sec in self.launch_s_by_op:
            if op == v.op:
                return sec
        return self.launch_s

    def duration(self, mg, v) -> float:
        """Jitter-free seconds of vertex ``v`` of memory graph ``mg``."""
        if v.kind == "reload":
            return self.copy_s + v.nbytes / self.h2d_bytes_per_s
        if v.kind == "offload":
            return self.copy_s + v.nbytes / self.d2h_bytes_per_s
        if v.op == "copy":
            return self.copy_s + v.nbytes / self.p2p_bytes_per_s
        moved = sum(mg.buffers[b].size for b in (*v.reads, *v.writes))
        return self.kernel_s + max(v.flops / self.flops_per_s, moved / self.mem_bytes_per_s)

    def lower_bound(self, mg) -> dict:
        """The larger of two bounds on the makespan (:mod:`vmstoolkit.exec.bounds`), jitter-free:
        ``resource_s``, max(compute time, H2D bytes / bandwidth, D2H bytes / bandwidth) of the
        worst GPU (with a shared host link, also every GPU's bytes over the link's rate), and
        ``precedence_s``, the work a vertex's ancestors do on one stream, itself and its
        descendants' work on another (None above ``bounds.MAX_VERTICES`` vertices)."""
        comp = [0.0] * mg.n_gpus
        h2d = [0] * mg.n_gpus
        d2h = [0] * mg.n_gpus
        for v in mg.vertices:
            if v.stream == "compute":
                comp[v.gpu] += self.duration(mg, v)
            elif v.kind == "reload":
                h2d[v.gpu] += v.nbytes
            elif v.kind == "offload":
                d2h[v.gpu] += v.nbytes
        # one micro-batch through a pipeline of GPUs (GPU g + 1 reads what GPU g wrote, and
        # nothing else crosses): compute is serial across them; GPUs that share no tensor (data
        # parallel replicas) or any other layout: only each GPU's own compute is serial
        compute = sum(comp) if _is_pipeline(mg) else max(comp)
        h2d_s = max(h2d) / self.h2d_bytes_per_s
        d2h_s = max(d2h) / self.d2h_bytes_per_s
        if self.host_link_bytes_per_s is not None:
            h2d_s = max(h2d_s, sum(h2d) / self.host_link_bytes_per_s)
            d2h_s = max(d2h_s, sum(d2h) / self.host_link_bytes_per_s)
        resource = max(compute, h2d_s, d2h_s)
        prec = precedence_bound(mg, [self.duration(mg, v) for v in mg.vertices])
        prec_s = None if prec is None else prec[0]
        return {"compute_s": compute, "h2d_s": h2d_s, "d2h_s": d2h_s, "resource_s": resource, "precedence_s": prec_s,
                "lower_bound_s": max(resource, prec_s or 0.0)}


def _is_pipeline(mg) -> bool:
    """Whether the graph's GPUs form a chain of stages: every vertex reads tensors of its own
    GPU or of the one before, and each GPU after the first reads something of the one before."""
    if mg.n_gpus == 1:
        return True
    g = mg.graph
    feeds = set()
    for v in g.vertices:
        for t in v.inputs:
            src = g.tensors[t].gpu
            if src != v.gpu:
                if src != v.gpu - 1:
                    return False
                feeds.add(v.gpu)
    return feeds == set(range(1, mg.n_gpus))


class SimBackend:
    """The :class:`~vmstoolkit.exec.backends.base.Backend` of a discrete-event simulation: costs
    from a :class:`CostModel` with ``jitter``, and with ``numerics`` the numpy values of every
    tensor through the placed regions (``values``: host arrays of weights and inputs)."""

    device_waits = True  # launch(v, after): a stream waits for other vertices' ends on the device

    def __init__(self, cost: CostModel | None = None, *, seed: int = 0, jitter: float = 0.2,
                 numerics: bool = False, values: dict | None = None):
        self.cost = cost or CostModel()
        self.rng = random.Random(seed)
        self.jitter = jitter
        self.numerics = numerics
        self.values = values or {}
        self.now = 0.0

    # -- backend protocol ----------------------------------------------------------------------
    def setup(self, mg) -> None:
        self.mg = mg
        self.now = 0.0
        self.host_free = 0.0
        self.stream_free: dict[tuple[int, str], float] = {}
        self.events: list = []  # (time, seq, kind, payload)
        self.seq = 0
        self.busy: dict[tuple[int, str], float] = {}
        self.spans: list[tuple[int, int, str, float, float]] = []  # (vertex, gpu, stream, start, end)
        self._pending: dict[int, list] = {}
        self._end: dict[int, float] = {}  # vertex -> when its work ends
        self.link_free: dict[str, float] = {}  # "h2d" / "d2h" -> when the shared host link is free
        if self.numerics:
            missing = [t.name for t in mg.graph.tensors if t.kind.value != "activation" and t.id not in self.values]
            if missing:
                raise InvalidOptionError(f"numerics need host values of {missing[:5]}")
            # each GPU's region up to the highest byte the plan places (not the whole budget: a
            # 24 GiB budget for a model of kilobytes would ask the host for 24 GiB)
            top = [0] * mg.n_gpus
            for b in mg.buffers:
                top[b.gpu] = max(top[b.gpu], b.offset + b.size)
            self.regions = [np.zeros(n, dtype=np.uint8) for n in top]
            self.host = {t: np.array(a) for t, a in self.values.items()}
            for b in mg.preloaded:
                self._view(b)[...] = self.host[mg.buffers[b].tensor]

    def clock(self) -> float:
        return self.now

    def launch(self, v, after=()):
        c = self.cost
        self.host_free = max(self.host_free, self.now) + c.launch_cost(v)
        k = (v.gpu, v.stream)
        start = max(self.stream_free.get(k, 0.0), self.host_free, *(self._end[u] for u in after))
        dur = c.duration(self.mg, v) * (1.0 + self.jitter * self.rng.random())
        shared = c.host_link_bytes_per_s is not None and v.kind in ("reload", "offload")
        if shared:  # the link is taken in the order copies start, at min(link, the GPU's own rate)
            rate = c.h2d_bytes_per_s if v.kind == "reload" else c.d2h_bytes_per_s
            if c.host_link_bytes_per_s < rate:
                dur *= (c.copy_s + v.nbytes / c.host_link_bytes_per_s) / (c.copy_s + v.nbytes / rate)
            start = max(start, self.link_free.get(v.stream, 0.0))
        end = start + dur
        if shared:
            self.link_free[v.stream] = end
        self.stream_free[k] = end
        self._end[v.id] = end
        self.busy[k] = self.busy.get(k, 0.0) + dur
        self.spans.append((v.id, v.gpu, v.stream, start, end))
        fut = asyncio.get_running_loop().create_future()
        if self.numerics:
            self._push(start, "start", v)
            self._push(end, "end", v)
        self._push(end + c.notify_s, "notify", fut)
        return fut

    def completion(self, token):
        return token

    async def drive(self, done) -> None:
        while not done.done():
            for _ in range(2):  # let the callbacks of the last resolution queue their launches
                await asyncio.sleep(0)
            if done.done():
                break
            if not self.events:
                raise ExecutionError("simulation deadlock: nothing in flight and the run is not done")
            t, _, kind, payload = heapq.heappop(self.events)
            self.now = max(self.now, t)
            if kind == "notify":
                payload.set_result(t)
            else:
                self._data(kind, payload)

    # -- numerics ------------------------------------------------------------------------------
    def _push(self, t, kind, payload) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, payload))

    def _view(self, bid: int) -> np.ndarray:
        b = self.mg.buffers[bid]
        t = self.mg.graph.tensors[b.tensor]
        return self.regions[b.gpu][b.offset:b.offset + t.nbytes].view(t.dtype).reshape(t.shape)

    def _data(self, kind: str, v) -> None:
        if kind == "start":  # read inputs now
            if v.kind == "reload":
                out = [self.host[v.tensor].copy()]
            elif v.kind in ("offload", "move"):  # a move: compaction's device-to-device copy
                out = [self._view(v.reads[0]).copy()]
            else:
                tv = self.mg.graph.vertices[v.task]
                out = run_op(tv, [self._view(b).copy() for b in v.reads])
            self._pending[v.id] = out
        else:  # write outputs now
            out = self._pending.pop(v.id)
            if v.kind == "offload":
                self.host[v.tensor] = out[0]
            else:
                for b, a in zip(v.writes, out):
                    view = self._view(b)
                    view[...] = a.reshape(view.shape)

    def result(self, ids=None) -> dict[int, np.ndarray]:
        """Values of the graph's output tensors (those in ``ids``, when given) after a numeric run."""
        out = {}
        for t, bid in select_outputs(self.mg.output_location, ids):
            out[t] = self._view(bid).copy() if bid >= 0 else self.host[t].copy()
        return out

    def close(self) -> None:
        """Nothing to give back: the simulation holds no device memory."""

    def utilization(self, makespan: float) -> dict[str, float]:
        return {f"gpu{g}.{s}": busy / makespan for (g, s), busy in sorted(self.busy.items()) if makespan > 0}
